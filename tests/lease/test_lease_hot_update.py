# SPDX-License-Identifier: ISC
"""A lease writes no index entry (send_deadline in sql/100_baseline.sql).

The reaper's index is on send_deadline, derived from lease_expires_at only
while a row is `sending`; leasing or renewing a pending row changes no
indexed value, so PostgreSQL can update it in place on its page (HOT).
The reaper must still find every `sending` row whose lease expired, however
the expiry was written.
"""
import json
import uuid

from outbox_test import enqueue, kill_switch, make_run, query, scalar

OWNER = "00000000-0000-4000-8000-0000000000aa"


def lease(conn, n=10):
    return [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                      "'{http}', true)", (OWNER, n))]


def mark(conn, ids):
    return query(conn, "SELECT effect_id::text FROM outbox_mark_sending(%s, %s::uuid[], true, "
                       "'{}', 30, %s)", (OWNER, ids, str(uuid.uuid4())))


def test_a_lease_is_a_hot_update(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    query(conn, "BEGIN")
    assert lease(conn) == [eid]
    # Counters of this transaction: one row updated, in place.
    assert scalar(conn, "SELECT pg_stat_get_xact_tuples_updated('effect_outbox'::regclass)") == 1
    assert scalar(conn, "SELECT pg_stat_get_xact_tuples_hot_updated('effect_outbox'::regclass)") == 1
    query(conn, "ROLLBACK")


def test_a_batch_that_takes_whole_pages_is_leased_hot(conn):
    """fillfactor 45 (sql/100_baseline.sql): a backlog is leased in the order it was
    written, so a batch takes every row of the pages it touches, in one
    transaction: none of their old versions can be pruned before the new
    ones are placed, and the lease is HOT only if the fillfactor kept room
    for all of them.  At the old 80 about one lease in four was."""
    kill_switch(conn, True)
    key = make_run(conn)
    # The bench's webhook payload: rows of a typical size, due in the order
    # they were written.
    payload = json.dumps({"method": "POST", "headers": {"X-Bench": "1"},
                          "body": {"event": "invoice.paid", "invoice": "INV-000123",
                                   "amount_cents": 129900, "currency": "EUR",
                                   "customer": {"id": "cus_42", "email": "a@example.com"},
                                   "note": "bench payload of a typical webhook size"}})
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, available_at) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, %s::jsonb, "
                "now() - interval '1 hour' + g * interval '1 millisecond' "
                "FROM generate_series(1, 500) g", (key, payload))
    query(conn, "BEGIN")
    assert len(lease(conn, 500)) == 500
    assert scalar(conn, "SELECT pg_stat_get_xact_tuples_updated('effect_outbox'::regclass)") == 500
    assert scalar(conn, "SELECT pg_stat_get_xact_tuples_hot_updated('effect_outbox'::regclass)") == 500
    query(conn, "ROLLBACK")


def test_send_deadline_follows_the_lease_only_while_sending(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    lease(conn)
    assert scalar(conn, "SELECT send_deadline FROM effect_outbox WHERE effect_id = %s", (eid,)) is None
    assert mark(conn, [eid]) == [(eid,)]
    assert scalar(conn, "SELECT send_deadline = lease_expires_at FROM effect_outbox "
                        "WHERE effect_id = %s", (eid,)) is True
    # A renewal moves both.
    query(conn, "UPDATE effect_outbox SET lease_expires_at = now() + interval '10 seconds' "
                "WHERE effect_id = %s", (eid,))
    query(conn, "SELECT * FROM outbox_renew(%s, %s::uuid[], 60, 3600)", (OWNER, [eid]))
    assert scalar(conn, "SELECT send_deadline = lease_expires_at AND send_deadline > now() + "
                        "interval '50 seconds' FROM effect_outbox WHERE effect_id = %s", (eid,)) is True


def test_the_reaper_finds_a_sending_row_whose_lease_was_expired_by_hand(conn):
    kill_switch(conn, True)
    eid = str(enqueue(conn, "http", "http://127.0.0.1:9/x", {}))
    live = str(enqueue(conn, "http", "http://127.0.0.1:9/y", {}))
    lease(conn)
    assert sorted(mark(conn, [eid, live])) == sorted([(eid,), (live,)])
    assert query(conn, "SELECT * FROM outbox_reap('w', 500)") == []
    query(conn, "UPDATE effect_outbox SET lease_expires_at = now() - interval '1 second' "
                "WHERE effect_id = %s", (eid,))
    reaped = query(conn, "SELECT effect_id::text, state FROM outbox_reap('w', 500)")
    assert reaped == [(eid, "unknown")]
    assert scalar(conn, "SELECT state FROM effect_outbox WHERE effect_id = %s", (live,)) == "sending"
