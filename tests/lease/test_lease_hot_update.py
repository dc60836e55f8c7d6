# SPDX-License-Identifier: ISC
"""A lease and a claim write no index entry (effect_live in
sql/105_live_queue.sql).

The live row's only indexes are its key and (available_at, effect_id);
leasing, claiming, marking or renewing changes neither, so PostgreSQL
updates the row in place on its page (HOT).  The reaper finds `sending`
rows through their call rows (effect_calls), not through an index of the
live rows, and must still find every one whose lease expired; a completion
takes the row out of the live queue: one DELETE and one history row.
"""
import json
import uuid

from outbox_test import enqueue, expire_sending, kill_switch, make_run, query, scalar

OWNER = "00000000-0000-4000-8000-0000000000aa"


def claim(conn, n=10, types="{http}"):
    return [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_claim(%s, 'w', %s, 30, "
                                      "%s, true, '{}', %s)", (OWNER, n, types, str(uuid.uuid4())))]


def xact_counts(conn, table):
    """(inserted, updated, HOT-updated, deleted) rows of `table` counted by
    this backend and not yet sent to the statistics (since PostgreSQL 15
    that is more than this transaction: compare two readings)."""
    return query(conn, f"SELECT pg_stat_get_xact_tuples_inserted('{table}'::regclass), "
                       f"pg_stat_get_xact_tuples_updated('{table}'::regclass), "
                       f"pg_stat_get_xact_tuples_hot_updated('{table}'::regclass), "
                       f"pg_stat_get_xact_tuples_deleted('{table}'::regclass)")[0]


def counted(conn, tables, action):
    """{table: (inserted, updated, HOT-updated, deleted)} by action(), and
    what it returned."""
    before = {t: xact_counts(conn, t) for t in tables}
    got = action()
    return {t: tuple(a - b for a, b in zip(xact_counts(conn, t), before[t]))
            for t in tables}, got


def lease(conn, n=10, types="{http}"):
    return [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                      "%s, true)", (OWNER, n, types))]


def mark(conn, ids):
    return query(conn, "SELECT effect_id::text FROM outbox_mark_sending(%s, %s::uuid[], true, "
                       "'{}', 30, %s)", (OWNER, ids, str(uuid.uuid4())))


def test_a_lease_is_a_hot_update(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    query(conn, "BEGIN")
    counts, got = counted(conn, ["effect_live"], lambda: lease(conn))
    assert got == [eid]
    # One row updated, in place.
    assert counts == {"effect_live": (0, 1, 1, 0)}
    query(conn, "ROLLBACK")


def test_a_claim_is_a_hot_update_and_a_completion_one_delete_and_one_history_row(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    history = scalar(conn, "SELECT format('effect_history_%%s', to_char(created_at AT TIME ZONE "
                           "'UTC', 'YYYYMM')) FROM effect_outbox WHERE effect_id = %s", (eid,))
    tables = ["effect_live", "effect_outbox", history]
    counts, got = counted(conn, tables, lambda: claim(conn))
    assert got == [eid]
    # One row updated in place; the body is read, never written.
    assert counts == {"effect_live": (0, 1, 1, 0), "effect_outbox": (0, 0, 0, 0),
                      history: (0, 0, 0, 0)}
    counts, done = counted(conn, tables, lambda: query(
        conn, "SELECT applied, state FROM outbox_complete(%s, 'w', %s)",
        (OWNER, json.dumps([{"effect_id": eid, "attempt": 1, "outcome": "accepted",
                             "next_state": "completed", "status": 200, "provider_id": "p"}]))))
    assert done == [(True, "completed")]
    # The live row deleted, one history row: the call and the finish in one.
    assert counts == {"effect_live": (0, 0, 0, 1), "effect_outbox": (0, 0, 0, 0),
                      history: (1, 0, 0, 0)}
    assert query(conn, "SELECT state, attempt, outcome_class, last_provider_id FROM effect_history "
                       "WHERE effect_id = %s", (eid,)) == [("completed", 1, "accepted", "p")]


def test_a_batch_that_takes_whole_pages_is_leased_hot(conn):
    """fillfactor 35 (sql/105_live_queue.sql): a backlog is leased in the order it was
    written, so a batch takes every row of the pages it touches, in one
    transaction: none of their old versions can be pruned before the new
    ones are placed, and the lease is HOT only if the fillfactor kept room
    for all of them.  At the old 80 about one lease in four was.  The claim
    also moves the row to `sending` and fills its NULL lease and call
    columns: its new version is about 1.6 times the pending row, so at 50
    only about two thirds of a claimed batch were HOT."""
    kill_switch(conn, True)
    key = make_run(conn)
    # The bench's webhook payload: rows of a typical size, due in the order
    # they were written.
    payload = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                          "body": {"event": "invoice.paid", "invoice": "INV-000123",
                                   "amount_cents": 129900, "currency": "EUR",
                                   "customer": {"id": "cus_42", "email": "a@example.com"},
                                   "note": "bench payload of a typical webhook size"}})
    # A backlog of its own for each (another type), so that neither finds
    # the other's old versions on its pages.
    seen = {}
    for take, kind in ((lease, "http"), (claim, "email")):
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                    "available_at) SELECT %s, %s, 'http://127.0.0.1:9/' || g, %s::jsonb, "
                    "now() - interval '1 hour' + g * interval '1 millisecond' "
                    "FROM generate_series(1, 500) g", (key, kind, payload))
        query(conn, "BEGIN")
        counts, got = counted(conn, ["effect_live"], lambda: take(conn, 500, "{%s}" % kind))
        assert len(got) == 500
        seen[take.__name__] = counts["effect_live"]
        query(conn, "ROLLBACK")
    assert seen == {"lease": (0, 500, 500, 0), "claim": (0, 500, 500, 0)}


def test_send_deadline_follows_the_lease_only_while_sending(conn):
    """The view's send_deadline (what the kill switch's in-flight list and
    outboxctl show) and the call row's deadline (what the reaper reads)."""
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    lease(conn)
    assert scalar(conn, "SELECT send_deadline FROM outbox_effects WHERE effect_id = %s", (eid,)) is None
    assert scalar(conn, "SELECT count(*) FROM effect_calls") == 0
    assert mark(conn, [eid]) == [(eid,)]
    assert scalar(conn, "SELECT send_deadline = lease_expires_at FROM outbox_effects "
                        "WHERE effect_id = %s", (eid,)) is True
    assert scalar(conn, "SELECT c.deadline <= l.lease_expires_at FROM effect_calls c "
                        "JOIN effect_live l ON l.effect_id = ANY (c.ids) "
                        "WHERE l.effect_id = %s", (eid,)) is True
    # A renewal moves the lease (the call's deadline stays the earlier bound:
    # the reaper then looks, finds the row renewed, and moves it on).
    query(conn, "UPDATE effect_live SET lease_expires_at = now() + interval '10 seconds' "
                "WHERE effect_id = %s", (eid,))
    query(conn, "SELECT * FROM outbox_renew(%s, %s::uuid[], 60, 3600)", (OWNER, [eid]))
    assert scalar(conn, "SELECT send_deadline = lease_expires_at AND send_deadline > now() + "
                        "interval '50 seconds' FROM outbox_effects WHERE effect_id = %s", (eid,)) is True


def test_the_reaper_finds_a_sending_row_whose_lease_was_expired_by_hand(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    live = str(enqueue(conn, "http", "http://127.0.0.1:9/y", {}))
    lease(conn)
    assert sorted(mark(conn, [eid, live])) == sorted([(eid,), (live,)])
    assert query(conn, "SELECT * FROM outbox_reap('w', 500)") == []
    # Both the live row's lease and its call's deadline passed; the other
    # row of the same call is still within its lease.
    expire_sending(conn, [eid])
    query(conn, "UPDATE effect_live SET lease_expires_at = now() + interval '30 seconds' "
                "WHERE effect_id = %s", (live,))
    reaped = query(conn, "SELECT effect_id::text, state FROM outbox_reap('w', 500)")
    assert reaped == [(eid, "unknown")]
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (live,)) == "sending"
    # The call stays, due again at its remaining row's lease.
    assert scalar(conn, "SELECT deadline > now() FROM effect_calls WHERE %s = ANY (ids)",
                  (live,)) is True
    assert query(conn, "SELECT * FROM outbox_reap('w', 500)") == []
