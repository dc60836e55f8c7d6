# SPDX-License-Identifier: ISC
"""A worker and its database connection: a PostgreSQL restart during a run,
backends terminated under the worker, and a connection lost under a query
without a callback; every effect is delivered once afterwards.
"""
import time

import pytest

from outbox_test import (enqueue, final, http_cfg, kill_switch, make_run, pg_restart, query,
                         run_state, scalar, states, wait_for)


@pytest.mark.exclusive
def test_postgres_restart_during_a_run(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    n = 300
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/delay/5?' || g, '{}' FROM generate_series(1, %s) g",
          (key, sink.url, n))
    cfg = {"database": {"reconnect_min_ms": 50, "reconnect_max_ms": 500},
           "dispatcher": {"batch_size": 16}, **http_cfg()}
    dispatchers(cfg, name="a")
    dispatchers(cfg, name="b")
    wait_for(lambda: sink.count() >= 30, what="some progress")
    conn.close()
    pg_restart()
    c = wait_for(lambda: _try_connect(), timeout=30, what="database back")
    wait_for(lambda: scalar(c, "SELECT count(*) FROM outbox_effects WHERE state = 'completed'") == n,
             timeout=60, what="all delivered after the restart")
    assert sink.count() == n
    assert all(v == 1 for v in sink.keys().values()), "no effect sent twice"
    assert scalar(c, "SELECT count(*) FROM effect_attempts") == n
    assert run_state(c, key) == "completed"
    c.close()


_DSN = {}


def _try_connect():
    import psycopg2
    try:
        c = psycopg2.connect(_DSN["dsn"])
        c.autocommit = True
        return c
    except psycopg2.OperationalError:
        return None


@pytest.fixture(autouse=True)
def _remember_dsn(db):
    _DSN["dsn"] = db


def test_terminated_backends_reconnect(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/ok?' || g, '{}' FROM generate_series(1, 100) g",
          (key, sink.url))
    cfg = {"database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()}
    w = dispatchers(cfg)
    wait_for(lambda: sink.count() >= 10, what="some progress")
    for _ in range(3):
        query(conn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        time.sleep(0.05)
    wait_for(lambda: states(conn).get("completed") == 100, timeout=30, what="all delivered")
    assert sink.count() == 100 and all(v == 1 for v in sink.keys().values())
    # Logged when the worker notices the cut, which may come after the last
    # completion (a connection it was not using at the time).
    wait_for(lambda: any(e.get("event") == "db_disconnected" for e in w.events()),
             what="db_disconnected")
    assert any(e.get("event") == "db_disconnected" for e in w.events())


def test_connection_lost_under_a_query_without_callback(db, conn, dispatchers, sink):
    """A statement whose answer nobody waits for (provider registration)
    is on the wire when its backend is terminated: the worker reconnects
    and carries on (it used to call a NULL callback: found by the chaos
    run once registration moved to the second connection)."""
    import psycopg2
    kill_switch(conn, True)
    locker = psycopg2.connect(db)
    try:
        cur = locker.cursor()
        cur.execute("LOCK TABLE outbox_providers IN EXCLUSIVE MODE")
        cfg = {"database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()}
        w = dispatchers(cfg)
        pid = wait_for(lambda: scalar(conn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                            "AND query LIKE 'SELECT outbox_register_providers%%' "
                                            "AND wait_event_type = 'Lock'"),
                       what="registration blocked on the lock")
        query(conn, "SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: any(e.get("event") == "db_disconnected" for e in w.events()),
                 what="the worker saw the connection go")
    finally:
        locker.rollback()
        locker.close()
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert w.proc.poll() is None
