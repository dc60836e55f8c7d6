# SPDX-License-Identifier: ISC
"""The fleet behind PgBouncer in transaction pooling mode.

Debian's pgbouncer (1.18) runs in front of the test PostgreSQL on a free
loopback port.  Two workers (`[database] poll_only = true`), two producers
and `outboxctl` all go through it.  Checked: every effect is delivered
exactly once; `kill-switch off` holds (once it returns, nothing it did not
list is sent); and nothing the fleet does relies on session state, seen
from the server: its statement log (log_statement = all for the test's
database) has no LISTEN, no named prepared statement (1.18 passes only
the unnamed one through transaction pooling), no PREPARE, no SET other than
the parameters PgBouncer itself keeps in step, no session-level advisory
lock call; and pg_locks never shows an advisory lock on a backend outside a
transaction.
"""
import os
import re
import threading
import time

import psycopg2
import pytest

from ha import PgBouncer, dsn_dbname
from outbox_test import (Dispatcher, connect, enqueue, query, run_ctl, scalar, states,
                         wait_for)

WORKERS = 2
POOL = 2 * WORKERS           # default_pool_size: per database and role
N = 1200                      # effects, from two producers
# What PgBouncer sends itself when it hands a server connection to a
# client whose tracked parameters differ (1.18: these five).
BOUNCER_SETS = re.compile(r"^(SET (application_name|client_encoding|datestyle|timezone|"
                          r"standard_conforming_strings)\s*=\s*'[^']*';\s*)+$", re.I)


@pytest.fixture
def bouncer(conn):
    roles = [r for (r,) in query(conn, "SELECT rolname FROM pg_roles WHERE rolcanlogin")]
    b = PgBouncer((os.environ["PGHOST"], os.environ["PGPORT"]), roles, pool_size=POOL).start()
    yield b
    b.stop()


class Watch(threading.Thread):
    """Samples, every 20 ms until stopped: the database's backends (all
    of them PgBouncer's server connections but the test's own), advisory
    locks held by a backend not in a transaction, and PgBouncer's pools."""

    def __init__(self, dsn, bouncer):
        super().__init__(daemon=True)
        self.db = connect(dsn)
        self.admin = psycopg2.connect(bouncer.admin_dsn())
        self.admin.autocommit = True
        self.pids, self.session_locks = set(), []
        self.peak = {"sv_active": 0, "cl_waiting": 0, "maxwait_ms": 0.0}
        self.halt = threading.Event()

    def run(self):
        me = scalar(self.db, "SELECT pg_backend_pid()")
        seen_idle = set()
        while not self.halt.is_set():
            for (pid,) in query(self.db, "SELECT pid FROM pg_stat_activity "
                                         "WHERE datname = current_database() AND pid <> %s", (me,)):
                self.pids.add(pid)
            # pg_locks is read live, pg_stat_activity from a snapshot: a
            # transaction lock can show next to a backend that looked idle.
            # A lock held outside a transaction shows twice in a row with
            # the backend idle since the same moment.
            idle = set(query(
                self.db, "SELECT l.pid, l.classid, l.objid, a.state_change FROM pg_locks l "
                         "JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' "
                         "AND l.granted AND a.state = 'idle' AND a.datname = current_database()"))
            self.session_locks += sorted(idle & seen_idle)
            seen_idle = idle
            with self.admin.cursor() as cur:
                cur.execute("SHOW POOLS")
                cols = [d[0] for d in cur.description]
                for row in cur.fetchall():
                    p = dict(zip(cols, row))
                    if p["database"] != "pgbouncer":
                        self.peak["sv_active"] = max(self.peak["sv_active"], p["sv_active"])
                        self.peak["cl_waiting"] = max(self.peak["cl_waiting"], p["cl_waiting"])
                        self.peak["maxwait_ms"] = max(self.peak["maxwait_ms"],
                                                      p["maxwait"] * 1000 + p["maxwait_us"] / 1000)
            self.halt.wait(0.02)

    def stop(self):
        self.halt.set()
        self.join(10)
        self.db.close()
        self.admin.close()


def produce(dsn, target, n, tag, ids, errors):
    try:
        c = connect(dsn)
        for i in range(n):
            ids.append(enqueue(c, "http", f"{target}?{tag}-{i}", {"n": i}))
        c.close()
    except Exception as e:   # reported by the test
        errors.append(repr(e))


def statements_of(pids, log_text):
    """(kind, text) of each statement the server logged for these
    backends: kind is `statement` (simple protocol) or the prepared
    statement's name (extended protocol: `<unnamed>` or a name)."""
    out = []
    for m in re.finditer(r"^\S+ \S+ \S+ \[(\d+)\] LOG:  (statement|execute ([^:]+)): (.*)$",
                         log_text, re.M):
        if int(m.group(1)) in pids:
            out.append(("statement" if m.group(2) == "statement" else m.group(3), m.group(4)))
    return out


def test_two_poll_only_workers_through_pgbouncer_transaction_mode(db, conn, bouncer, sink, tmp_path):
    name = dsn_dbname(db)
    via = bouncer.via(db)
    query(conn, f"ALTER DATABASE {name} SET log_statement = 'all'")
    server_log = os.path.join(os.environ["PG_TEST_DIR"], "server.log")
    log_from = os.path.getsize(server_log)

    # outboxctl through PgBouncer: migrate (one transaction, its advisory
    # lock a transaction lock), the switch, status.
    for args in (["migrate"], ["kill-switch", "on", "--operator", "ops", "--reason", "start"],
                 ["status"]):
        r = run_ctl(["--db", via] + args)
        assert r.returncode == 0, (args, r.stdout, r.stderr)

    watch = Watch(db, bouncer)
    watch.start()
    cfg = {"database": {"poll_only": True},
           "dispatcher": {"batch_size": 16, "poll_interval_ms": 100},
           "provider.http": {"max_per_host": 8, "max_attempts": 1}}
    workers = [Dispatcher(via, tmp_path, cfg, name=f"pgb{i + 1}").start() for i in range(WORKERS)]
    try:
        ids, errors = [], []
        producers = [threading.Thread(target=produce,
                                      args=(via, sink.url + "/delay/20", N // 2, f"p{t}", ids, errors))
                     for t in range(2)]
        for p in producers:
            p.start()
        wait_for(lambda: sink.count() >= 150 or errors, timeout=60, what="a steady stream")
        assert not errors, errors

        r = run_ctl(["--db", via, "kill-switch", "off", "--operator", "ops", "--reason", "pgbouncer"])
        returned = time.time()
        assert r.returncode == 0, r.stderr
        listed = set(re.findall(r"key=([0-9a-f]{64})", r.stdout))
        for p in producers:
            p.join(60)
        assert not errors, errors
        assert len(ids) == N
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'sending'") == 0,
                 what="in-flight sends to finish")
        late = [q for q in sink.received() if q["t"] > returned and q["key"] not in listed]
        assert late == [], f"{len(late)} sends started after kill-switch off returned"
        before = sink.count()
        assert states(conn).get("pending", 0) > 0, "the switch went off before the stream ran dry"
        # Several poll intervals of both workers: nothing is sent.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert sink.count() == before
            time.sleep(0.05)

        r = run_ctl(["--db", via, "kill-switch", "on", "--operator", "ops", "--reason", "resume"])
        assert r.returncode == 0, r.stderr
        wait_for(lambda: states(conn).get("completed") == N, timeout=90,
                 what=f"all {N} delivered ({states(conn)})")
        counts = sink.keys()
        assert len(counts) == N and set(counts.values()) == {1}, "each effect exactly once"
        assert scalar(conn, "SELECT count(*) FROM effect_attempts") == N
        r = run_ctl(["--db", via, "status"])
        assert r.returncode == 0, r.stderr
    finally:
        for w in workers:
            w.stop()
        watch.stop()

    # What the server saw: nothing that needs a session of its own.
    assert watch.session_locks == [], f"advisory locks held outside a transaction: {watch.session_locks[:5]}"
    with open(server_log, errors="replace") as f:
        f.seek(log_from)
        stmts = statements_of(watch.pids, f.read())
    assert len(stmts) > 1000, f"the statement log has the fleet's statements ({len(stmts)})"
    named = {k for k, _ in stmts if k not in ("statement", "<unnamed>")}
    assert named == set(), f"named prepared statements: {named}"
    text = [s for _, s in stmts]
    for word in ("LISTEN", "UNLISTEN", "PREPARE", "DEALLOCATE", "DISCARD", "RESET",
                 "pg_advisory_lock(", "pg_try_advisory_lock(", "pg_advisory_lock_shared(",
                 "TEMP TABLE", "TEMPORARY"):
        hits = [s for s in text if word.lower() in s.lower()]
        assert hits == [], f"{word}: {hits[:3]}"
    sets = [s for s in text if re.match(r"\s*SET\b", s, re.I)
            and not re.match(r"\s*SET\s+LOCAL\b", s, re.I) and not BOUNCER_SETS.match(s.strip())]
    assert sets == [], f"session SET statements: {sets[:5]}"
    assert any("outbox_claim" in s or "outbox_lease" in s for s in text)
    assert any("outbox_kill_switch_set" in s for s in text)
    print(f"pgbouncer pool_size {POOL} for {WORKERS} workers + 2 producers + outboxctl: "
          f"peak sv_active {watch.peak['sv_active']}, peak cl_waiting {watch.peak['cl_waiting']}, "
          f"max wait {watch.peak['maxwait_ms']:.1f} ms; {len(watch.pids)} server connections, "
          f"{len(stmts)} statements logged")
