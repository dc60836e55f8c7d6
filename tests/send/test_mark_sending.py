# SPDX-License-Identifier: ISC
"""The sending transition (outbox_mark_sending in sql/functions/30_dispatcher.sql),
repeated after a lost connection: a call token gets its own rows back and
no other call does; a call the worker gave up on (its repeat refused) puts
its rows back and marks nothing later.
"""
import threading
import uuid

import psycopg2

from outbox_test import (add_due, attempts, dsn_as, enqueue, http_cfg, kill_switch, query, scalar,
                         states, wait_for)
from pg_cut_proxy import CutProxy

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
    assert scalar(conn, "SELECT sum(attempts) FROM outbox_effects WHERE effect_id = ANY(%s::uuid[])",
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
                      "FROM outbox_effects WHERE effect_id = ANY(%s::uuid[]) ORDER BY effect_id", (ids,))
    assert got == [("pending", 0, None, None, None, None)] * 3, got
    # Another call's rows are never touched by it: a row marked by a
    # different token stays `sending` (that call's worker may be sending).
    kill_switch(conn, True)
    assert sorted(r[0] for r in query(conn, LEASE, (owner, 10, None, None))) == ids
    other = str(uuid.uuid4())
    assert query(conn, MARK, (owner, ids[:1], other)) == [(ids[0], 1, False)]
    kill_switch(conn, False)
    assert sorted(query(conn, MARK, (owner, ids, call))) == [(ids[1], 0, True), (ids[2], 0, True)]
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (ids[0],)) == "sending"


def test_a_mark_call_given_up_on_puts_its_rows_back_and_marks_nothing_later(conn):
    """outbox_unclaim_call for a mark (the worker gives a mark call up when
    its repeat was refused): the rows the first delivery marked go back to
    pending with the attempt undone and the lease dropped, and that call
    delivered again (a late first call) marks nothing."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ids = sorted(add_due(conn, 3))
    assert sorted(r[0] for r in query(conn, LEASE, (owner, 10, None, None))) == ids
    call = str(uuid.uuid4())
    assert len(query(conn, MARK, (owner, ids[:2], call))) == 2
    assert scalar(conn, "SELECT outbox_unclaim_call(%s, %s)", (owner, call)) == 2
    got = query(conn, "SELECT state, attempts, lease_owner, mark_token FROM outbox_effects "
                      "WHERE effect_id = ANY(%s::uuid[]) ORDER BY effect_id", (ids[:2],))
    assert got == [("pending", 0, None, None)] * 2, got
    # The third row, still leased, and the call once more: nothing marked.
    assert query(conn, MARK, (owner, ids, call)) == []
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'sending'") == 0
    # A new call of the same owner marks the row it still holds.
    assert query(conn, MARK, (owner, ids[2:], str(uuid.uuid4()))) == [(ids[2], 1, False)]


def test_a_mark_whose_repeat_is_refused_gives_its_rows_back_unsent(conn, db, login_as,
                                                                   dispatchers, sink):
    """The first mark commits and its answer is lost with the connection (a
    proxy withholds it); the repeat on the new connection is refused (it
    waits for the kill switch's lock, held here, past the role's
    lock_timeout).  The worker never saw the rows marked and sent nothing:
    it gives the call up, so they are pending again at once with the
    attempt undone, instead of `sending` until the reaper; then each is sent
    once."""
    role = login_as("outbox_dispatcher").info.user
    query(conn, f"ALTER ROLE \"{role}\" SET lock_timeout = '300ms'")
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(3)]
    proxy, hold = CutProxy().start(), threading.Event()
    holder = psycopg2.connect(db)
    try:
        proxy.arm(b"outbox_mark_sending", hold=hold)
        dispatchers({**http_cfg(), "dispatcher": {"claim": False},
                     "database": {"conninfo": proxy.conninfo(dsn_as(db, role)),
                                  "reconnect_min_ms": 50}})
        wait_for(lambda: proxy.cuts == 1, what="the first mark committed, its answer withheld")
        assert states(conn) == {"sending": 3}
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(outbox_kill_switch_lock_key())")
            hold.set()
            wait_for(lambda: states(conn) == {"pending": 3} and scalar(
                conn, "SELECT sum(attempts) FROM outbox_effects") == 0, timeout=10,
                what="the marked rows given back, attempt undone")
            assert sink.received() == []
        holder.rollback()
        wait_for(lambda: states(conn) == {"completed": 3}, what="all sent")
        assert [[a["attempt"] for a in attempts(conn, i)] for i in ids] == [[1]] * 3
        assert len(sink.received()) == 3 and len(sink.keys()) == 3
    finally:
        hold.set()
        holder.close()
        proxy.stop()
