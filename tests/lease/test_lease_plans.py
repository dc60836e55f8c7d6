# SPDX-License-Identifier: ISC
"""The lease keeps using the due index when the queue grows under a worker's
session (sql/functions/30_dispatcher.sql).

PL/pgSQL caches a generic plan of a statement after five calls.  Cached
while the queue was empty, the old lease's plan read the whole table on
every call until the next ANALYZE (at 1,000 effects/s from an empty table:
26-160 ms per lease and a queue that ran away for a minute).  The hot path
now keeps its cached generic plans, so each must be an index probe
whatever the statistics said when it was made.  The plans are read with
auto_explain, sent to this session as NOTICEs.
"""
import json
import uuid

from outbox_test import finished_rows_and_some_in_flight, kill_switch, make_run, plans_of, query


LEASE = "SELECT count(*) FROM outbox_lease(%s, 'w', %s, 30, '{http}', true, %s, %s)"


def test_lease_uses_the_due_index_after_the_table_grew_in_the_same_session(conn):
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    # A fresh install: the table is empty and its statistics say so.
    query(conn, "ANALYZE effect_live, effect_outbox")
    # More calls than PL/pgSQL needs to settle on a cached plan, from both
    # the head and a position.
    for _ in range(8):
        query(conn, LEASE, (owner, 10, None, None))
        query(conn, LEASE, (owner, 10, "2000-01-01", str(uuid.uuid4())))
    # Then a busy morning, before autoanalyze has looked at the table.
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, 20000) g",
          (key,))
    for args in ((owner, 5, None, None), (owner, 5, "2000-01-01", str(uuid.uuid4()))):
        plans = plans_of(conn, LEASE, args)
        assert "effect_live_due_idx" in plans, plans
        assert "Seq Scan on effect_live" not in plans, plans
        assert "Seq Scan on effect_outbox" not in plans, plans


def test_complete_finds_its_rows_by_key_not_by_a_scan(conn):
    """outbox_complete names its rows by effect_id.  The old planner took
    the partial index of rows in flight for it (it looks tiny in the
    statistics) and read all of it on every call: under a snapshot held for
    a minute, every dead entry of every effect sent so far (21,000 pages,
    58 ms per call).  The live queue has no such index; its statements
    must probe the live rows, the bodies and the history by key."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = finished_rows_and_some_in_flight(conn, owner, pending=50, in_flight=50)
    query(conn, "ANALYZE effect_live, effect_outbox, effect_history")
    results = json.dumps([{"effect_id": i, "attempt": 1, "outcome": "accepted",
                           "next_state": "completed", "retry_delay_ms": 0, "status": 200,
                           "provider_id": "p"} for i in ids[:10]])
    plans = plans_of(conn, "SELECT * FROM outbox_complete(%s, 'w', %s)", (owner, results))
    assert "Delete on effect_live" in plans, plans
    assert "effect_live_pkey" in plans, plans
    for table in ("effect_live", "effect_outbox", "effect_history"):
        assert f"Seq Scan on {table}" not in plans, plans
    # The reaper reads the call rows by deadline, then the live rows by key.
    query(conn, "UPDATE effect_calls SET deadline = now() - interval '1 second'")
    plans = plans_of(conn, "SELECT * FROM outbox_reap('w', 500)", None)
    assert "effect_calls_deadline_idx" in plans, plans
    assert "effect_live_pkey" in plans, plans
    assert "Seq Scan on effect_live" not in plans, plans
