"""The lease keeps using the due index when the table grows under a worker's
session (plan_cache_mode in sql/functions/30_dispatcher.sql).

PL/pgSQL caches a generic plan of a statement after five calls.  Cached
while effect_outbox was empty, the lease's plan read the whole table on
every call until the next ANALYZE (at 1,000 effects/s from an empty table:
26-160 ms per lease and a queue that ran away for a minute).  The plans
are read with auto_explain, sent to this session as NOTICEs.
"""
import json
import uuid

from outbox_test import kill_switch, make_run, query

LEASE = "SELECT count(*) FROM outbox_lease(%s, 'w', %s, 30, '{http}', true, %s, %s)"


def plans_of(conn, sql, args):
    """The plans auto_explain reports for the statements sql runs,
    nested ones included."""
    query(conn, "LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "auto_explain.log_level = notice", "client_min_messages = notice"):
        query(conn, "SET " + setting)
    del conn.notices[:]
    query(conn, sql, args)
    query(conn, "SET auto_explain.log_min_duration = -1")
    return "\n".join(conn.notices)


def test_lease_uses_the_due_index_after_the_table_grew_in_the_same_session(conn):
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    # A fresh install: the table is empty and its statistics say so.
    query(conn, "ANALYZE effect_outbox")
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
        assert "effect_outbox_due_idx" in plans, plans
        assert "Seq Scan on effect_outbox" not in plans, plans


def finished_rows_and_some_in_flight(conn, owner, pending, in_flight):
    """A table of some size: 20,000 completed rows, `pending` new ones of
    which `in_flight` are leased by owner and moved to `sending`.  Returns
    the ids in flight."""
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, state, "
                "completed_at) SELECT %s, 'http', 'http://127.0.0.1:9/done' || g, '{}', 'completed', "
                "now() FROM generate_series(1, 20000) g", (key,))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, %s) g",
          (key, pending))
    ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                     "'{http}', true)", (owner, in_flight))]
    query(conn, "SELECT * FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)",
          (owner, ids, str(uuid.uuid4())))
    return ids


def test_complete_finds_its_rows_by_key_not_by_the_index_of_rows_in_flight(conn):
    """outbox_complete's UPDATE names its rows by effect_id and checks
    state = 'sending'.  The planner took the partial index of rows in
    flight for it (it looks tiny in the statistics) and read all of it on
    every call: under a snapshot held for a minute, every dead entry of every
    effect sent so far (21,000 pages, 58 ms per call).  Since
    its predicate (sql/100_baseline.sql) that index cannot answer this query."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = finished_rows_and_some_in_flight(conn, owner, pending=50, in_flight=50)
    query(conn, "ANALYZE effect_outbox")
    results = json.dumps([{"effect_id": i, "attempt": 1, "outcome": "accepted",
                           "next_state": "completed", "retry_delay_ms": 0, "status": 200,
                           "provider_id": "p"} for i in ids[:10]])
    plans = plans_of(conn, "SELECT * FROM outbox_complete(%s, 'w', %s)", (owner, results))
    assert "Update on effect_outbox" in plans, plans
    assert "effect_outbox_sending_idx" not in plans, plans
    assert "effect_outbox_pkey" in plans, plans
    # The reaper still reads that index.
    plans = plans_of(conn, "SELECT * FROM outbox_reap('w', 500)", None)
    assert "effect_outbox_sending_idx" in plans, plans


def test_kill_switch_lists_every_row_in_flight_from_indexes(conn):
    """outbox_kill_switch_set lists the effects in flight while it holds
    the kill-switch lock that every outbox_mark_sending waits for.  Since
    sql/100_baseline.sql the list reads two partial indexes (rows in
    flight with a deadline, and the ones someone set to `sending` by hand
    without one), not the whole table, and still lists both kinds.
    (`outboxctl status` counts the same two ways: its count is checked in
    test_outboxctl.py, with a row of each kind.)"""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = finished_rows_and_some_in_flight(conn, owner, pending=4, in_flight=3)
    by_hand = query(conn, "UPDATE effect_outbox SET state = 'sending' WHERE state = 'pending' "
                          "RETURNING effect_id::text")[0][0]
    query(conn, "ANALYZE effect_outbox")
    plans = plans_of(conn, "SELECT effect_id::text FROM outbox_kill_switch_set(true, 'op', 'test')", None)
    assert "effect_outbox_sending_idx" in plans, plans
    assert "effect_outbox_sending_nodeadline_idx" in plans, plans
    assert "Seq Scan on effect_outbox" not in plans, plans
    listed = {r[0] for r in query(conn, "SELECT effect_id::text FROM "
                                        "outbox_kill_switch_set(true, 'op', 'test')")}
    assert listed == set(ids) | {by_hand}


def test_weekly_figures_read_only_this_weeks_rows(conn):
    """The workers' weekly figures (outbox_weekly_figures) read this week's effects through
    the created_at block-range index, not the whole table: with the view's
    26 weeks they read every row kept, some twenty seconds at two million."""
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, state, "
                "created_at, completed_at) SELECT %s, 'http', 'http://127.0.0.1:9/old' || g, '{}', "
                "'completed', now() - interval '10 weeks', now() - interval '10 weeks' "
                "FROM generate_series(1, 20000) g", (key,))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/new' || g, '{}' FROM generate_series(1, 10) g",
          (key,))
    # What autovacuum's autosummarize does for a production table.
    query(conn, "SELECT brin_summarize_new_values('effect_outbox_created_brin')")
    query(conn, "ANALYZE effect_outbox")
    plans = plans_of(conn, "SELECT * FROM outbox_weekly_figures('t', 0)", ())
    assert "effect_outbox_created_brin" in plans, plans
    assert "Seq Scan on effect_outbox" not in plans, plans
    assert query(conn, "SELECT automatic_share FROM outbox_weekly_cache")[0][0] == 1
