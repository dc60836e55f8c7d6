# SPDX-License-Identifier: ISC
"""The upgrade of docs/running-a-fleet.md ("Rolling restart and upgrade")
with the workers serving and a producer streaming, from each released
schema: the workers of the release (built from the repository's history,
tests/lib/releases.py) deliver, this tree's `outboxctl migrate` runs under
them, then the rolling restart puts this tree's workers in their place.

- From the last release (71088d8, schema 106): migrate runs while the old
  workers serve (every function file applied again as well, so that the
  runner takes the locks of a full upgrade however little this tree
  changed); the old workers keep delivering on the new schema until they
  are restarted.
- From the release before the live queue (9d05c90, schema 103): migrate
  refuses while its workers are connected (105 rewrites their tables),
  with a message that says to stop them, and changes nothing; once they
  are stopped it runs, and the new workers take over.

Either way every effect the producer wrote is delivered once (the sink
counts each key), none is lost, and no producer call (a run's claim and an
enqueue) waited longer than BOUND_S.

And the runner's locks themselves, on a migrated database: a session
holding a lock the migration needs (an operator's open transaction that
read a view the function files replace) makes migrate roll back and try
again, never holding the producers past the bound."""
import os
import re
import subprocess
import threading
import time
import uuid

import psycopg2
import psycopg2.errors
import pytest

from outbox_test import (BUILD_DIR, Dispatcher, dsn_for, producer_dsn, query,
                         scalar, wait_for)
from releases import release_build

# What a producer's call may wait, at most, while migrate runs online: the
# runner's pre-lock bound (500 ms) and the migrations' run time, with room
# for a loaded machine.  From a release before the live queue, producers
# wait for the copy of 105 (docs/running-a-fleet.md: an upgrade window),
# so there a call may wait as long as migrate ran, and no longer.
BOUND_S = 1.5


class Worker(Dispatcher):
    """A worker of another build (bindir: its outbox-dispatcher and
    providers/)."""

    def __init__(self, dsn, tmp_path, name, bindir):
        super().__init__(dsn, tmp_path, {"dispatcher": {"provider_dir": os.path.join(bindir, "providers")}},
                         name=name)
        self.bindir = bindir

    def start(self, wait_ready=True):
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([os.path.join(self.bindir, "outbox-dispatcher"), "--config",
                                      self.config_path] + self.args,
                                     stdout=self.logf, stderr=self.logf, env=self.env)
        if wait_ready:
            wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout=60,
                     what=f"{self.name} ready")
            assert self.proc.poll() is None, f"{self.name} exited: {self.log()}"
        return self


class Producer:
    """Claims a run and enqueues one http effect, again and again, timing
    each call; the calls are those of every release (their signatures are
    kept)."""

    def __init__(self, dsn, url):
        self.dsn, self.url = dsn, url
        self.keys, self.errors, self.waits = [], [], []
        # Calls refused once while a migration that rewrites the tables
        # committed under them (their function began with the old body),
        # each retried as n8n redelivers: kept apart from errors.
        self.straddled = []
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        try:
            c = psycopg2.connect(producer_dsn(self.dsn))
            c.autocommit = True
            cur = c.cursor()
            n = 0
            while not self.stop_ev.is_set():
                key = f"upo-{n}-{uuid.uuid4().hex[:8]}"
                t = time.monotonic()
                try:
                    cur.execute("SELECT status FROM outbox_claim_run(%s, 'h', gen_random_uuid(), 300)",
                                (key,))
                    cur.execute("SELECT effect_id FROM outbox_enqueue(%s, 'http', %s, %s::jsonb)",
                                (key, self.url + "/idem", '{"body": {"n": %d}}' % n))
                except psycopg2.errors.UndefinedColumn as e:
                    self.straddled.append(repr(e))
                    n += 1
                    continue
                self.waits.append(time.monotonic() - t)
                self.keys.append(key)
                n += 1
                self.stop_ev.wait(0.01)
            c.close()
        except Exception as e:   # reported by the test
            self.errors.append(repr(e))

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stop_ev.set()
        self.thread.join(timeout=30)
        assert not self.errors, self.errors


def figures(line):
    """The measured figures, on stdout (-s) and in $OUTBOX_FIGURES if set."""
    print("\n" + line)
    if os.environ.get("OUTBOX_FIGURES"):
        with open(os.environ["OUTBOX_FIGURES"], "a") as f:
            f.write(line + "\n")


def migrate(dsn, exe=None, *args):
    return subprocess.run([exe or os.path.join(BUILD_DIR, "outboxctl"), "--db", dsn, "migrate",
                           *args], capture_output=True, text=True, timeout=600)


def version(conn):
    return scalar(conn, "SELECT max(version) FROM schema_migrations")


def completed(conn, keys=None):
    """Completed effects (of keys): the read view, or the one table of a
    release before the live queue."""
    table = "outbox_effects" if scalar(conn, "SELECT to_regclass('outbox_effects') IS NOT NULL") \
        else "effect_outbox"
    if keys is None:
        return scalar(conn, f"SELECT count(*) FROM {table} WHERE state = 'completed'")
    return scalar(conn, f"SELECT count(*) FROM {table} WHERE state = 'completed' "
                        "AND idempotency_key = ANY(%s)", (keys,))


def delivered_once(conn, sink, keys):
    """Every key completed, and the sink took each exactly once."""
    def done():
        n = scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = ANY(%s) "
                         "AND state = 'completed'", (keys,))
        return n == len(keys)
    wait_for(done, timeout=240, what="every effect delivered")
    states = dict(query(conn, "SELECT state, count(*) FROM outbox_effects GROUP BY state"))
    assert states == {"completed": len(keys)}, states
    counts = {}
    for req in sink.received():
        if req.get("key"):
            counts[req["key"]] = counts.get(req["key"], 0) + 1
    effect_keys = dict(query(conn, "SELECT effect_key, idempotency_key FROM outbox_effects"))
    twice = {k: n for k, n in counts.items() if n > 1}
    lost = set(effect_keys) - set(counts)
    return lost, twice


@pytest.mark.slow
@pytest.mark.parametrize("release", ["71088d8", "9d05c90"])
def test_upgrade_under_a_serving_fleet(unmigrated_db, tmp_path, release):
    from http_sink import Sink
    old = release_build(release)
    dsn = dsn_for(unmigrated_db)
    r = migrate(dsn, os.path.join(old, "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    was = version(conn)
    query(conn, "SELECT outbox_kill_switch_set(true, 'test', 'upgrade test')")
    sink = Sink().start()
    workers = [Worker(dsn, tmp_path, f"old{i}", old).start() for i in (1, 2)]
    producer = Producer(dsn, sink.url).start()
    new_workers = []
    try:
        wait_for(lambda: len(producer.keys) >= 30 and completed(conn) >= 20,
                 timeout=180, what="the old workers delivering")
        before = len(producer.keys)
        if release == "71088d8":
            # A full upgrade's locks: every function file is applied again.
            query(conn, "DELETE FROM schema_functions")
            t = time.monotonic()
            r = migrate(dsn)
            took = time.monotonic() - t
            assert r.returncode == 0, r.stdout + r.stderr
            assert "applied functions/" in r.stdout, r.stdout
            # The old workers deliver on the new schema.
            mid = len(producer.keys)
            wait_for(lambda: len(producer.keys) >= mid + 30, timeout=120, what="more effects")
            wait_for(lambda: completed(conn, producer.keys[mid:mid + 30]) == 30,
                     timeout=180, what="the old workers delivering on the new schema")
            for w in workers:
                assert "does not exist" not in w.log(), w.log()[-3000:]
            # The rolling restart.
            for i, w in enumerate(workers, 1):
                w.stop()
                new_workers.append(Dispatcher(dsn, tmp_path, {}, name=f"new{i}").start())
        else:
            r = migrate(dsn)
            assert r.returncode != 0, r.stdout
            assert "105_live_queue rewrites the tables the workers read" in r.stderr, r.stderr
            assert "Stop every worker of the fleet first" in r.stderr, r.stderr
            assert re.search(r"\b4 worker connections open \(outbox lease old1, outbox lease old2, "
                             r"outbox records old1, outbox records old2\)", r.stderr), r.stderr
            assert version(conn) == was
            # The documented order for this release: stop, migrate, start.
            for w in workers:
                w.stop()
            t = time.monotonic()
            r = migrate(dsn)
            took = time.monotonic() - t
            assert r.returncode == 0, r.stdout + r.stderr
            new_workers = [Dispatcher(dsn, tmp_path, {}, name=f"new{i}").start() for i in (1, 2)]
        assert version(conn) > was or release == "71088d8"
        wait_for(lambda: len(producer.keys) >= before + 100 or producer.errors, timeout=180,
                 what="the producer streaming")
        assert not producer.errors, producer.errors
        # Online (71088d8): no call is refused.  Stop-first (105 rewrites
        # the tables): at most the one call that straddled its commit, as
        # docs/running-a-fleet.md says.
        assert len(producer.straddled) <= (0 if release == "71088d8" else 1), producer.straddled
        producer.stop()
        lost, twice = delivered_once(conn, sink, producer.keys)
        worst = max(producer.waits)
        figures(f"{release}: migrate {took:.2f} s, {len(producer.keys)} effects, lost {len(lost)}, "
              f"twice {len(twice)}, longest producer call {worst * 1000:.0f} ms")
        assert not lost and not twice, (lost, twice)
        bound = BOUND_S if release == "71088d8" else took + BOUND_S
        assert worst < bound, f"a producer call waited {worst:.2f} s (migrate ran {took:.2f} s)"
    finally:
        producer.stop_ev.set()
        # Shown only when the test fails.
        print(f"producer: {len(producer.keys)} effects, errors {producer.errors}")
        for w in workers + new_workers:
            print(f"--- {w.name}\n{w.log()[-3000:]}")
            if w.proc and w.proc.poll() is None:
                w.stop()
        sink.stop()
        conn.close()


def test_migrate_takes_its_locks_or_none_and_never_holds_producers(db):
    """An operator's transaction reading outbox_scope_status (a view the
    function files replace) stays open until migrate has rolled back three
    attempts (or 4 s): the runner before this one waited for it holding
    effect_outbox (its triggers are replaced first), and every producer
    waited with it; this one holds nothing while it waits, and then
    runs."""
    from http_sink import Sink
    conn = psycopg2.connect(db)
    conn.autocommit = True
    sink = Sink().start()
    producer = Producer(db, sink.url).start()
    holder = psycopg2.connect(db)
    notes = []
    try:
        wait_for(lambda: len(producer.keys) >= 10, what="the producer streaming")
        query(conn, "DELETE FROM schema_functions")
        holder.cursor().execute("SELECT count(*) FROM outbox_scope_status")
        t = time.monotonic()
        proc = subprocess.Popen([os.path.join(BUILD_DIR, "outboxctl"), "--db", db, "migrate"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: notes.extend(proc.stderr), daemon=True)
        reader.start()
        wait_for(lambda: sum("rolled back" in n for n in notes) >= 3 or proc.poll() is not None
                 or time.monotonic() - t > 4, timeout=60, what="three attempts rolled back")
        held = time.monotonic() - t
        holder.commit()
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out + "".join(notes)
        reader.join(timeout=10)
        took = time.monotonic() - t
        assert "applied functions/" in out, out
        n = len(producer.keys)
        wait_for(lambda: len(producer.keys) >= n + 10, what="the producer after migrate")
        producer.stop()
        worst = max(producer.waits)
        figures(f"migrate under a lock held {held:.2f} s: {took:.2f} s, {len(notes)} notes; "
              f"longest producer call {worst * 1000:.0f} ms")
        assert worst < BOUND_S, f"a producer call waited {worst:.2f} s"
        assert any("lock timeout" in n for n in notes), notes
    finally:
        producer.stop_ev.set()
        holder.close()
        sink.stop()
        conn.close()
