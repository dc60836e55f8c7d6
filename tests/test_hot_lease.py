"""A lease writes no index entry (sql/009_hot_lease.sql).

The reaper's index is on send_deadline, derived from lease_expires_at only
while a row is `sending`; leasing or renewing a pending row changes no
indexed value, so PostgreSQL can update it in place on its page (HOT).
The reaper must still find every `sending` row whose lease expired, however
the expiry was written.
"""
import uuid

from outbox_test import enqueue, kill_switch, query, scalar

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
