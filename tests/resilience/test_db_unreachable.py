# SPDX-License-Identifier: ISC
"""A database a worker cannot reach: at start (nothing listens on the
port), and a connection black-holed under it (packets dropped, no reset).

- Unreachable at start: the worker retries with exponential backoff and
  jitter from the first failure, logs a bounded number of lines and burns
  no CPU; once the database answers it is serving within the backoff cap.
- Black hole: every connection through tests/servers/pg_cut_proxy.py stops
  passing anything and never closes.  On loopback the kernel still takes
  the data, so only the worker's own deadlines (a statement's answer, a
  connect) get it out: it reconnects within a bound derived from
  lease_seconds and reconnect_max_ms, records the outcome of the send that
  finished during the outage, and nothing is sent twice.
- The statement timeout the worker sets on its connections is the
  server's: a statement stuck on a lock past it fails, the connection
  stays.
"""
import os
import time

from outbox_test import (effect, enqueue, free_port, kill_switch, query, scalar, states, wait_for,
                         worker_dsn)
from pg_cut_proxy import CutProxy

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """utime + stime of a process, in seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def count_events(w, *names):
    return sum(1 for e in w.events() if e.get("event") in names)


def serving(w):
    return count_events(w, "serving") > 0


def test_worker_started_with_the_database_unreachable_backs_off(db, dispatchers):
    port = free_port()          # nothing listens there yet
    proxy = CutProxy()
    reconnect_max_ms = 2000
    w = dispatchers({"database": {"conninfo": proxy.conninfo(worker_dsn(db), port=port),
                                  "reconnect_min_ms": 100, "reconnect_max_ms": reconnect_max_ms}})
    cpu0 = cpu_seconds(w.proc.pid)
    # A measurement window: what the worker does with nothing to reach.
    time.sleep(3)
    cpu = cpu_seconds(w.proc.pid) - cpu0
    failures = [e for e in w.events() if e.get("event") in ("db_connect_failed", "db_disconnected")]
    assert not serving(w)
    assert 1 <= len(failures) <= 10, f"{len(failures)} lines in 3 s: {failures[:3]}"
    assert "attempt" in failures[-1]["msg"], failures[-1]
    assert cpu < 0.3, f"{cpu:.2f} s of CPU in 3 s while the database was unreachable"

    proxy.start(port=port)
    try:
        t = time.monotonic()
        # Within the backoff cap (plus a connect and the schema check).
        wait_for(lambda: serving(w), timeout=reconnect_max_ms / 1000 + 5,
                 what="serving once the database answers")
        assert time.monotonic() - t <= reconnect_max_ms / 1000 + 5
        connected = [e for e in w.events() if e.get("event") == "db_connected"]
        assert connected and "attempt" in connected[0]["msg"], connected
    finally:
        proxy.stop()


# The bounds the worker derives from lease_seconds (dispatcher/worker.c,
# docs/operating.md): statement_timeout = max(5 s, lease_seconds / 2), and
# an answer or a connect that takes 2 s longer than that is a lost
# connection.
LEASE_S = 6
STATEMENT_TIMEOUT_S = max(5, LEASE_S / 2)
RESPONSE_DEADLINE_S = STATEMENT_TIMEOUT_S + 2
RECONNECT_MAX_MS = 1000


def test_a_black_holed_connection_is_left_within_a_bound(conn, db, dispatchers, sink):
    kill_switch(conn, True)
    proxy = CutProxy().start()
    try:
        w = dispatchers({"database": {"conninfo": proxy.conninfo(worker_dsn(db)),
                                      "reconnect_min_ms": 50, "reconnect_max_ms": RECONNECT_MAX_MS},
                         "dispatcher": {"lease_seconds": LEASE_S},
                         "provider.http": {"timeout_ms": 10000}})
        wait_for(lambda: serving(w), what="serving")
        eid = str(enqueue(conn, "http", f"{sink.url}/delay/1500", {"body": {"n": 1}}))
        key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
        wait_for(lambda: sink.count(key) == 1, what="the send under way")
        connected0 = count_events(w, "db_connected")
        proxy.blackhole()
        t_hole = time.monotonic()
        # The provider answers 200 during the outage: an outcome to record.
        wait_for(lambda: sink.processed(key) == 1, what="the sink to answer")
        # The outage: 3 s of nothing passing.
        time.sleep(3)
        proxy.heal()
        # Both connections dropped and made again: the stuck statement's
        # deadline, then at most a wedged connect's deadline and the backoff.
        bound = 2 * RESPONSE_DEADLINE_S + RECONNECT_MAX_MS / 1000 + 3
        wait_for(lambda: count_events(w, "db_connected") >= connected0 + 2,
                 timeout=bound, what="both connections made again")
        e = wait_for(lambda: (lambda x: x if x["state"] == "completed" else None)(effect(conn, eid)),
                     timeout=bound, what=f"the outcome recorded (now {effect(conn, eid)})")
        assert time.monotonic() - t_hole <= bound + 1
        assert e["provider_id"] == sink.taken[key][0]
        # The worker's own 200 is in the attempts log: recorded directly,
        # or as late evidence after the reaper made it unknown.
        got = query(conn, "SELECT outcome_class, cas_applied, resolution FROM effect_attempts "
                          "WHERE effect_id = %s AND worker = %s ORDER BY attempt_id", (eid, w.name))
        assert got and got[-1][0] == "accepted" and got[-1][1], got
        assert count_events(w, "db_disconnected") >= 2

        # And it carries on: more effects, each sent once.
        for i in range(5):
            enqueue(conn, "http", f"{sink.url}/ok", {"body": {"after": i}})
        wait_for(lambda: states(conn).get("completed") == 6, what="the effects after the outage")
        assert all(v == 1 for v in sink.keys().values()), "nothing sent twice"
    finally:
        proxy.stop()


def test_a_statement_stuck_past_the_statement_timeout_fails_on_the_server(conn, db, dispatchers):
    """The worker sets statement_timeout on its own connections: a lease
    stuck behind a lock is cancelled by the server (an error the worker
    counts) before the worker's own deadline would drop the connection."""
    kill_switch(conn, True)
    w = dispatchers({"dispatcher": {"lease_seconds": LEASE_S, "claim": False}})
    wait_for(lambda: serving(w), what="serving")
    import psycopg2
    locker = psycopg2.connect(db)
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE effect_live IN ACCESS EXCLUSIVE MODE")
            wait_for(lambda: any("statement timeout" in (e.get("msg") or "") for e in w.events()),
                     timeout=STATEMENT_TIMEOUT_S + 5, what="a statement cancelled by its timeout")
        locker.rollback()
    finally:
        locker.close()
    assert count_events(w, "db_disconnected") == 0, "the connection stays"


def test_a_connection_given_up_on_has_its_statement_cancelled_on_the_server(conn, db, dispatchers):
    """The server's limit is the role's (here 10 minutes, so the worker sets
    none of its own), and a lease waits on a lock past the worker's own
    deadline (statement_timeout + 2 s): the worker gives the connection
    up, and cancels the statement on the server as it does, so the backend
    it leaves does not go on waiting in the lock's queue beside the one the
    retried lease waits on."""
    import psycopg2
    kill_switch(conn, True)
    dsn = worker_dsn(db) + " options='-c statement_timeout=600000'"
    w = dispatchers({"database": {"conninfo": dsn},
                     "dispatcher": {"lease_seconds": LEASE_S, "claim": False}})
    wait_for(lambda: serving(w), what="serving")
    waiting_sql = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                   "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
    locker = psycopg2.connect(db)
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE effect_live IN ACCESS EXCLUSIVE MODE")
            first = wait_for(lambda: [r[0] for r in query(conn, waiting_sql)],
                             timeout=STATEMENT_TIMEOUT_S + 10, what="a statement waiting on the lock")
            wait_for(lambda: count_events(w, "db_disconnected") > 0,
                     timeout=STATEMENT_TIMEOUT_S + 15, what="the worker's deadline")
            wait_for(lambda: not set(first) & {r[0] for r in query(conn, waiting_sql)},
                     timeout=10, what="the given-up backend's statement cancelled")
        locker.rollback()
    finally:
        locker.close()


def test_a_statement_timeout_the_conninfo_sets_is_kept(conn, db, dispatchers):
    """A statement_timeout of 0 set in the conninfo's options is the
    operator's choice: the worker sets its own only where nobody set one,
    so a statement stuck on a lock is not cancelled by the server (the
    worker's own deadline gives the connection up instead)."""
    import psycopg2
    kill_switch(conn, True)
    dsn = worker_dsn(db) + " options='-c statement_timeout=0'"
    w = dispatchers({"database": {"conninfo": dsn},
                     "dispatcher": {"lease_seconds": LEASE_S, "claim": False}})
    wait_for(lambda: serving(w), what="serving")
    locker = psycopg2.connect(db)
    try:
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE effect_live IN ACCESS EXCLUSIVE MODE")
            wait_for(lambda: count_events(w, "db_disconnected") > 0,
                     timeout=STATEMENT_TIMEOUT_S + 15, what="the worker's own deadline")
        locker.rollback()
    finally:
        locker.close()
    assert not any("statement timeout" in (e.get("msg") or "") for e in w.events()), \
        "the server cancelled a statement: the worker replaced the conninfo's statement_timeout"


def keepalive_timers(pid, pg_port):
    """Seconds left on the keepalive timers of pid's TCP connections to
    the database (ss -o shows them while a connection is idle)."""
    import re
    import subprocess
    out = subprocess.run(["ss", "-tnpoH", "state", "established", "dport", f"= :{pg_port}"],
                         capture_output=True, text=True, check=True).stdout
    unit = {"ms": 0.001, "sec": 1, "min": 60}
    return [float(m.group(1)) * unit[m.group(2)] for line in out.splitlines() if f"pid={pid}," in line
            for m in [re.search(r"timer:\(keepalive,([0-9.]+)(ms|sec|min)", line)] if m]


def test_a_service_file_gives_the_tcp_settings(db, dispatchers, tmp_path):
    """A conninfo that names a service: libpq fills in the service file's
    keys only where nothing set them, so the worker leaves its own
    keepalive defaults (a third of lease_seconds: 10 s) out and the
    file's keepalives_idle (300 s) is what the connections get."""
    params = dict(kv.split("=", 1) for kv in worker_dsn(db).split())
    params["host"] = "127.0.0.1"       # TCP: keepalives mean nothing on a Unix socket
    svc = tmp_path / "pg_service.conf"
    svc.write_text("[outbox]\n" + "".join(f"{k}={v}\n" for k, v in params.items()) +
                   "keepalives=1\nkeepalives_idle=300\nkeepalives_interval=30\n")
    w = dispatchers({"database": {"conninfo": "service=outbox"}},
                    env={"PGSERVICEFILE": str(svc)})
    wait_for(lambda: serving(w), what="serving")
    timers = wait_for(lambda: (lambda t: t if len(t) == 2 else None)(
        keepalive_timers(w.proc.pid, params["port"])), what="both connections' keepalive timers")
    assert min(timers) > 60, f"keepalive timers {timers}: the worker's defaults, not the service's"
