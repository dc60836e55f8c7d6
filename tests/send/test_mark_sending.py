"""The sending transition (outbox_mark_sending in sql/functions/30_dispatcher.sql),
repeated after a lost connection: a call token gets its own rows back and
no other call does.
"""
import uuid

from outbox_test import add_due, kill_switch, query, scalar

LEASE = ("SELECT effect_id::text, available_at FROM outbox_lease(%s, 'w', %s, 30, '{http}', true, "
         "%s, %s)")
MARK = "SELECT effect_id::text, attempts, blocked FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)"


def test_a_repeated_mark_call_gets_its_own_rows_back_and_no_other_call_does(conn):
    """The worker repeats outbox_mark_sending with the same call token after
    a lost connection: the rows that call moved come back (the first answer
    was never seen, nothing was sent); a different call gets nothing."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = sorted(add_due(conn, 3))
    leased = sorted(r[0] for r in query(conn, LEASE, (owner, 10, None, None)))
    assert leased == ids
    call = str(uuid.uuid4())
    first = sorted(query(conn, MARK, (owner, ids[:2], call)))
    assert first == [(ids[0], 1, False), (ids[1], 1, False)]
    # The same call again, now with the third id too: the two it moved come
    # back unchanged (no second attempt), the third moves now.
    again = sorted(query(conn, MARK, (owner, ids, call)))
    assert again == [(ids[0], 1, False), (ids[1], 1, False), (ids[2], 1, False)]
    # Another call (or no token) never gets rows already sending.
    assert query(conn, MARK, (owner, ids, str(uuid.uuid4()))) == []
    assert query(conn, MARK, (owner, ids, None)) == []
    assert scalar(conn, "SELECT sum(attempts) FROM effect_outbox WHERE effect_id = ANY(%s::uuid[])",
                  (ids,)) == 3


def test_a_repeated_mark_call_after_the_switch_went_off_puts_its_rows_back(conn):
    """The first mark committed, its answer was lost with the connection,
    then the kill switch went off: the repeated call (same token) finds the
    switch off.  The worker never saw those rows marked, so nothing was
    sent: they go back to pending with the attempt undone (not left in
    `sending` for the reaper to make unknown)."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = sorted(add_due(conn, 3))
    assert sorted(r[0] for r in query(conn, LEASE, (owner, 10, None, None))) == ids
    call = str(uuid.uuid4())
    assert sorted(query(conn, MARK, (owner, ids[:2], call))) == [(ids[0], 1, False), (ids[1], 1, False)]
    kill_switch(conn, False)
    again = sorted(query(conn, MARK, (owner, ids, call)))
    assert again == [(ids[0], 0, True), (ids[1], 0, True), (ids[2], 0, True)], again
    got = query(conn, "SELECT state, attempts, lease_owner, sending_since, mark_token, send_deadline "
                      "FROM effect_outbox WHERE effect_id = ANY(%s::uuid[]) ORDER BY effect_id", (ids,))
    assert got == [("pending", 0, None, None, None, None)] * 3, got
    # Another call's rows are never touched by it: a row marked by a
    # different token stays `sending` (that call's worker may be sending).
    kill_switch(conn, True)
    assert sorted(r[0] for r in query(conn, LEASE, (owner, 10, None, None))) == ids
    other = str(uuid.uuid4())
    assert query(conn, MARK, (owner, ids[:1], other)) == [(ids[0], 1, False)]
    kill_switch(conn, False)
    assert sorted(query(conn, MARK, (owner, ids, call))) == [(ids[1], 0, True), (ids[2], 0, True)]
    assert scalar(conn, "SELECT state FROM effect_outbox WHERE effect_id = %s", (ids[0],)) == "sending"
