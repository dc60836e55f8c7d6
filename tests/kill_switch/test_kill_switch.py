# SPDX-License-Identifier: ISC
"""The kill switch (docs/design.md, "Kill switch"): the control row and
the AI_ACTIONS_ENABLED environment variable stop every send, switching
off releases leases without spending attempts, and outbox_kill_switch_set
lists the sends in flight from indexes.

Where a test asserts that something does NOT happen (no send while the
kill switch is off), it observes a bounded window in which the worker
provably polled several times (poll_interval_ms=200), then proves the
worker is alive by letting the effects through.
"""
import time
import uuid

import pytest

from outbox_test import (effect, enqueue, finished_rows_and_some_in_flight, http_cfg, kill_switch,
                         make_run, plans_of, query, run_ctl, scalar, states, wait_for)


def observe_nothing_sent(conn, sink, ids, seconds=1.5):
    """A bounded window (several poll intervals): nothing may be sent."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert sink.count() == 0
        rows = query(conn, "SELECT state, attempts, lease_owner FROM outbox_effects "
                           "WHERE effect_id = ANY(%s::uuid[])", ([str(i) for i in ids],))
        assert all(r[0] == "pending" and r[1] == 0 for r in rows), rows
        time.sleep(0.1)


def test_kill_switch_control_row_off_then_on(conn, dispatchers, sink):
    ids = [enqueue(conn, "http", sink.url + "/ok", {"i": i}) for i in range(20)]
    # New database: the switch is off (deny by default).
    assert scalar(conn, "SELECT enabled FROM outbox_control") is False
    w = dispatchers(http_cfg())
    observe_nothing_sent(conn, sink, ids)
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE lease_owner IS NOT NULL") == 0
    r = run_ctl(["--db", w.dsn, "kill-switch", "on", "--operator", "ops", "--reason", "test"])
    assert r.returncode == 0, r.stderr
    wait_for(lambda: states(conn).get("completed") == 20, what="all delivered")
    assert all(v == 1 for v in sink.keys().values()) and len(sink.keys()) == 20
    assert all(effect(conn, i)["attempts"] == 1 for i in ids)


@pytest.mark.parametrize("value", [None, "false", "TRUE", "1", "true "])
def test_kill_switch_environment(conn, dispatchers, sink, value):
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + "/ok", {"i": i}) for i in range(5)]
    w = dispatchers(http_cfg(), env={"AI_ACTIONS_ENABLED": value})
    assert any(e.get("event") == "kill_switch_env" for e in w.events())
    observe_nothing_sent(conn, sink, ids)
    w.stop()
    dispatchers(http_cfg(), name="w-on")
    wait_for(lambda: states(conn).get("completed") == 5, what="delivered once enabled")
    assert sink.count() == 5 and all(effect(conn, i)["attempts"] == 1 for i in ids)


def test_kill_switch_off_releases_leases_without_spending_attempts(conn, dispatchers, sink):
    """Rows leased while the switch was on and blocked at the sending
    transition go back unleased, attempts unchanged."""
    kill_switch(conn, True)
    key = make_run(conn)
    # Lease rows as a worker would, then turn the switch off before marking.
    ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}, key=key) for i in range(3)]
    owner = "11111111-1111-4111-8111-111111111111"
    leased = query(conn, "SELECT effect_id FROM outbox_lease(%s, 'manual', 10, 30, '{http}', true)",
                   (owner,))
    assert len(leased) == 3
    kill_switch(conn, False)
    rows = query(conn, "SELECT effect_id, attempts, blocked FROM outbox_mark_sending(%s, %s::uuid[], "
                       "true, '{}', 30)", (owner, [str(i) for i in ids]))
    assert len(rows) == 3 and all(r[2] for r in rows) and all(r[1] == 0 for r in rows)
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE lease_owner IS NOT NULL "
                        "OR state <> 'pending' OR attempts <> 0") == 0


def test_kill_switch_lists_every_row_in_flight_from_indexes(conn):
    """outbox_kill_switch_set lists the effects in flight while it holds
    the kill-switch lock that every outbox_mark_sending waits for.  The
    list reads the call rows (effect_calls: every claim or mark that moved
    rows to `sending`, a mark without a call token included, which gets a
    token of its own) and the live rows by key, not the whole queue, and
    lists the rows of every kind of call.  (`outboxctl status` counts the
    same way: its count is checked in test_outboxctl.py.)"""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = finished_rows_and_some_in_flight(conn, owner, pending=5, in_flight=3)
    (untokened,), = query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', 1, 30, "
                                "'{http}', true)", (owner,))
    assert query(conn, "SELECT effect_id::text FROM outbox_mark_sending(%s, %s::uuid[], true, "
                       "'{}', 30)", (owner, [untokened])) == [(untokened,)]
    (claimed,), = query(conn, "SELECT effect_id::text FROM outbox_claim(%s, 'w', 1, 30, '{http}', "
                              "true, '{}', %s)", (owner, str(uuid.uuid4())))
    query(conn, "ANALYZE effect_live, effect_outbox, effect_calls")
    plans = plans_of(conn, "SELECT effect_id::text FROM outbox_kill_switch_set(true, 'op', 'test')", None)
    assert "effect_live_pkey" in plans, plans
    assert "Seq Scan on effect_live" not in plans, plans
    assert "Seq Scan on effect_outbox" not in plans, plans
    listed = {r[0] for r in query(conn, "SELECT effect_id::text FROM "
                                        "outbox_kill_switch_set(true, 'op', 'test')")}
    assert listed == set(ids) | {untokened, claimed}
