# SPDX-License-Identifier: ISC
"""Failover to a promoted standby under a steady stream.

Each test starts its own primary and streaming standby (`pg_basebackup
-R`, tests/lib/ha.py), with the shared server's roles copied over; the
workers' and the producer's conninfo lists both hosts with
target_session_attrs=read-write.  Mid-run the primary is stopped hard
(`pg_ctl stop -m immediate`) and the standby promoted (`pg_ctl promote`),
the way a failover manager does it.  `lag` pauses the primary's WAL sender
for that long first (SIGSTOP, then SIGKILL with restart_after_crash off: a
crash, not a shutdown), so the standby misses the last `lag` seconds of
WAL, as a standby behind on a real network would.

Synchronous replication (synchronous_standby_names = '*',
synchronous_commit = on): nothing acknowledged is lost, nothing is sent
twice, nothing starts after a kill-switch `off` that returned before the
failover, and every effect ends in a final state.  Asynchronous: measured
and printed (docs/running-a-fleet.md, "High availability"); what is
asserted there is what still holds: every effect on the new primary ends
final and was sent.
"""
import os
import re
import signal
import threading
import time

import psycopg2
import pytest

from ha import Cluster, copy_roles, dsn_dbname, rehost
from outbox_test import (Dispatcher, admin_dsn, connect, enqueue, query, run_ctl, scalar, states,
                         wait_for)

FINAL = ("completed", "failed", "unknown")
CFG = {"database": {"reconnect_min_ms": 50, "reconnect_max_ms": 500},
       "dispatcher": {"batch_size": 16, "poll_interval_ms": 100, "lease_seconds": 3},
       "provider.http": {"max_per_host": 8}}


@pytest.fixture
def cluster(request, db):
    """(Cluster, conninfo for both hosts, admin conninfo of the primary)
    with the test's database migrated on it; the kill switch on."""
    c = Cluster(synchronous=request.param).start()
    try:
        name = dsn_dbname(db)
        copy_roles(admin_dsn(), c.primary.dsn())
        adm = connect(c.primary.dsn())
        query(adm, f"CREATE DATABASE {name}")
        adm.close()
        both = rehost(db, c.both(), target_session_attrs="read-write", connect_timeout=2)
        for args in (["migrate"], ["kill-switch", "on", "--operator", "ops", "--reason", "start"]):
            r = run_ctl(["--db", both] + args)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        yield c, both
    finally:
        c.stop()


def crash_primary(c, lag):
    """Stop the primary hard; with lag > 0, its WAL sender paused for lag
    seconds first (the standby then lacks that much of the stream)."""
    if lag > 0:
        sender = scalar(connect(c.primary.dsn()), "SELECT pid FROM pg_stat_replication")
        os.kill(sender, signal.SIGSTOP)
        time.sleep(lag)          # the stream runs on, unreplicated, this long
        os.kill(sender, signal.SIGKILL)   # the postmaster takes all down
    return c.fail_over()


class Producer(threading.Thread):
    """Inserts n effects (to target?p-i) at about rate per second through
    the multi-host conninfo.  An insert whose connection broke is looked up
    after reconnecting (by its target) and done again if it is not there:
    `acked` ends as the targets the producer was told are committed."""

    def __init__(self, dsn, target, n, rate):
        super().__init__(daemon=True)
        self.dsn, self.target, self.n, self.rate = dsn, target, n, rate
        self.acked, self.retried, self.errors = [], 0, []

    def connect(self):
        deadline = time.monotonic() + 60
        while True:
            try:
                return connect(self.dsn)
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def run(self):
        try:
            c = self.connect()
            t0 = time.monotonic()
            for i in range(self.n):
                t = f"{self.target}?p-{i}"
                broke = False     # an insert broke: it may have committed
                while True:
                    # The look-up runs on a new connection, which may break
                    # too (the failover still under way): retried the same.
                    try:
                        if broke and scalar(c, "SELECT count(*) FROM outbox_effects "
                                               "WHERE target = %s", (t,)):
                            break
                        enqueue(c, "http", t, {"n": i})
                        break
                    except psycopg2.Error:
                        self.retried += 1
                        broke = True
                        c = self.connect()
                self.acked.append(t)
                ahead = t0 + (i + 1) / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)   # the producer's pace, not a wait for a condition
            c.close()
        except Exception as e:   # reported by the test
            self.errors.append(repr(e))


def start_workers(dsn, tmp_path, n=2):
    return [Dispatcher(dsn, tmp_path, CFG, name=f"ha{i + 1}").start() for i in range(n)]


def stream_through_failover(cluster, sink, tmp_path, lag, n=1500, rate=300):
    """The run: n effects at rate/s, the primary crashed at 40 %; returns
    the figures (and leaves the assertions to the caller)."""
    c, both = cluster
    workers = start_workers(both, tmp_path)
    try:
        prod = Producer(both, sink.url + "/ok", n, rate)
        prod.start()
        wait_for(lambda: len(prod.acked) >= n * 0.4 or prod.errors, timeout=60, what="40 % produced")
        assert sink.count() > 0, "sends before the failover"
        sent_before = sink.count()
        took = crash_primary(c, lag)
        prod.join(120)
        assert not prod.errors and not prod.is_alive(), prod.errors
        new = connect(c.standby.dsn(dsn_dbname(both)))
        wait_for(lambda: not scalar(new, "SELECT count(*) FROM outbox_effects WHERE state NOT IN %s",
                                    (FINAL,)), timeout=60,
                 what=f"every effect final on the new primary ({states(new)})")
    finally:
        for w in workers:
            w.stop()
    rows = dict(query(new, "SELECT effect_key, target FROM outbox_effects"))
    targets = set(rows.values())
    counts = sink.keys()
    f = {"lag_s": lag, "failover_s": round(took, 2), "produced": n, "acked": len(prod.acked),
         "producer_retries": prod.retried, "sent_before_failover": sent_before,
         "lost": len(set(prod.acked) - targets),
         "sent_twice": sum(1 for k, v in counts.items() if v > 1 and k in rows),
         "sent_row_lost": sum(1 for k in counts if k not in rows),
         "never_sent": sum(1 for k in rows if k not in counts),
         "states": states(new),
         "reconnects": sum(1 for w in workers for e in w.events() if e.get("event") == "db_connected") - 4}
    new.close()
    print(f"failover figures: {f}")
    return f


@pytest.mark.exclusive
@pytest.mark.parametrize("cluster", [True], indirect=True)
@pytest.mark.parametrize("lag", [0, 0.5])
def test_synchronous_standby_promoted_mid_stream_loses_and_repeats_nothing(cluster, sink, tmp_path, lag):
    f = stream_through_failover(cluster, sink, tmp_path, lag)
    assert f["acked"] == f["produced"]
    assert f["lost"] == 0, f
    assert f["sent_twice"] == 0 and f["sent_row_lost"] == 0, f
    assert f["never_sent"] == 0 and f["states"] == {"completed": f["produced"]}, f


@pytest.mark.exclusive
@pytest.mark.parametrize("cluster", [False], indirect=True)
@pytest.mark.parametrize("lag", [0, 0.5])
def test_asynchronous_standby_promoted_mid_stream_measured(cluster, sink, tmp_path, lag):
    """Not a guarantee: the figures go to docs/running-a-fleet.md.  What
    holds: every effect the new primary has ends final (completed, or
    unknown where its outcome was lost), and each of them was sent."""
    f = stream_through_failover(cluster, sink, tmp_path, lag)
    assert f["acked"] == f["produced"]
    assert f["never_sent"] == 0, f


@pytest.mark.exclusive
@pytest.mark.parametrize("cluster", [True], indirect=True)
def test_kill_switch_off_before_a_failover_holds_on_the_promoted_standby(cluster, sink, tmp_path):
    c, both = cluster
    n = 600
    pc = connect(rehost(both, [("127.0.0.1", c.primary.port)]))
    for i in range(n):
        enqueue(pc, "http", f"{sink.url}/delay/40?{i}", {})
    pc.close()
    workers = start_workers(both, tmp_path)
    try:
        wait_for(lambda: sink.count() >= 60, what="a steady stream")
        r = run_ctl(["--db", both, "kill-switch", "off", "--operator", "ops", "--reason", "failover"])
        returned = time.time()
        assert r.returncode == 0, r.stderr
        listed = set(re.findall(r"key=([0-9a-f]{64})", r.stdout))
        crash_primary(c, 0)
        new = connect(c.standby.dsn(dsn_dbname(both)))
        # The sends in flight finish; their outcomes reach the new primary.
        wait_for(lambda: scalar(new, "SELECT count(*) FROM outbox_effects WHERE state = 'sending'") == 0,
                 timeout=60, what="in-flight sends recorded on the new primary")
        wait_for(lambda: all(sum(e.get("event") == "db_connected" for e in w.events()) >= 4
                             for w in workers), what="both connections of each worker back")
        late = [q for q in sink.received() if q["t"] > returned and q["key"] not in listed]
        assert late == [], f"{len(late)} sends started after kill-switch off returned"
        before = sink.count()
        assert states(new).get("pending", 0) > 0
        deadline = time.monotonic() + 1.5   # several poll intervals on the new primary
        while time.monotonic() < deadline:
            assert sink.count() == before
            time.sleep(0.05)
        r = run_ctl(["--db", both, "kill-switch", "on", "--operator", "ops", "--reason", "after"])
        assert r.returncode == 0, r.stderr
        wait_for(lambda: states(new).get("completed") == n, timeout=90,
                 what=f"the rest delivered ({states(new)})")
    finally:
        for w in workers:
            w.stop()
    counts = sink.keys()
    assert len(counts) == n and set(counts.values()) == {1}, "each effect exactly once"
