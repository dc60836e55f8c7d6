# SPDX-License-Identifier: ISC
"""The claim (outbox_claim, outbox_unclaim in sql/functions/35_claim.sql;
dispatcher/claim.c): due rows leased and moved to `sending` in one
statement, under the kill switch's lock, for rows a worker can send at
once; a repeat after a lost answer gets its own rows back; rows that cannot
go after all go back with the attempt undone.
"""
import math
import signal
import threading
import time
import uuid

import psycopg2
import pytest

from outbox_test import (add_due, attempts, enqueue, free_port, http_cfg, kill_switch, query,
                         scalar, scrape, states, wait_for, worker_dsn)

CLAIM = ("SELECT effect_id::text, attempts FROM outbox_claim(%s, 'w', %s, 30, '{http}', %s, "
         "'{}', %s, NULL, NULL, %s)")
UNCLAIM = "SELECT outbox_unclaim(%s, %s::uuid[], %s, %s, %s)"
ROW = ("SELECT state, attempts, lease_owner::text, mark_token::text, leased_at = sending_since, "
       "send_deadline IS NOT NULL FROM outbox_effects WHERE effect_id = %s")


def claim(conn, owner, call, limit=10, env=True, repeat=False):
    return sorted(query(conn, CLAIM, (owner, limit, env, call, repeat)))


def test_a_claim_moves_due_rows_to_sending_in_one_statement(conn):
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    ids = sorted(add_due(conn, 3))
    got = claim(conn, owner, call, limit=2)
    # `attempts` is the count before this attempt, as outbox_lease returns it.
    assert [a for _, a in got] == [0, 0]
    for eid, _ in got:
        assert query(conn, ROW, (eid,)) == [("sending", 1, owner, call, True, True)]
    rest = [i for i in ids if i not in {e for e, _ in got}]
    assert query(conn, ROW, (rest[0],))[0][0:3] == ("pending", 0, None)
    # Rows in flight are listed by the kill switch like marked ones.
    listed = {r[0] for r in query(conn, "SELECT effect_id::text FROM "
                                        "outbox_kill_switch_set(false, 'test', 'test')")}
    assert listed == {e for e, _ in got}


@pytest.mark.parametrize("switch,env", [(False, True), (True, False)], ids=["control", "env"])
def test_no_claim_while_the_kill_switch_is_off(conn, switch, env):
    kill_switch(conn, switch)
    ids = add_due(conn, 2)
    assert claim(conn, str(uuid.uuid4()), str(uuid.uuid4()), env=env) == []
    assert {query(conn, ROW, (i,))[0][0:3] for i in ids} == {("pending", 0, None)}


def test_a_repeated_claim_returns_its_own_rows_and_leases_nothing_new(conn):
    """The first answer was lost with the connection (the rows committed as
    `sending`, the worker never saw them): the repeat returns exactly those
    rows, with the same attempt, and takes no new ones."""
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 4)
    first = claim(conn, owner, call, limit=2)
    assert len(first) == 2
    assert claim(conn, owner, call, limit=2, repeat=True) == first
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'sending'") == 2
    assert scalar(conn, "SELECT sum(attempts) FROM outbox_effects") == 2
    # Another call's repeat, or another owner's, gets nothing.
    assert claim(conn, owner, str(uuid.uuid4()), repeat=True) == []
    assert claim(conn, str(uuid.uuid4()), call, repeat=True) == []


def test_a_repeated_claim_after_the_switch_went_off_puts_its_rows_back(conn):
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 3)
    first = claim(conn, owner, call, limit=2)
    other = claim(conn, owner, str(uuid.uuid4()))
    assert len(first) == 2 and len(other) == 1
    kill_switch(conn, False)
    assert claim(conn, owner, call, repeat=True) == []
    for eid, _ in first:
        assert query(conn, ROW, (eid,)) == [("pending", 0, None, None, None, False)]
    # Only that call's rows: another call's stay `sending` (it may be sending).
    assert query(conn, ROW, (other[0][0],))[0][0] == "sending"


def test_a_first_claim_arriving_after_its_repeat_claims_nothing(conn):
    """A retransmitted query, a stalled server: the first call reaches the
    server only after its repeat.  The repeat left the token behind
    (outbox_claim_repeats), so the late first call takes no rows that no
    worker would send."""
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    ids = add_due(conn, 2)
    assert claim(conn, owner, call, repeat=True) == []
    assert claim(conn, owner, call) == []
    assert {query(conn, ROW, (i,))[0][0:3] for i in ids} == {("pending", 0, None)}
    # Another token claims as usual.
    assert len(claim(conn, owner, str(uuid.uuid4()))) == 2


def test_giving_a_claim_up_puts_its_rows_back_and_bars_a_late_first_call(conn):
    """A refused claim may have been a repeat whose first call committed:
    the worker gives the token up (outbox_unclaim_call): that call's rows go
    back to pending with the attempt undone, and the token claims nothing
    from then on."""
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 3)
    first = claim(conn, owner, call, limit=2)
    assert scalar(conn, "SELECT outbox_unclaim_call(%s, %s)", (owner, call)) == 2
    for eid, _ in first:
        assert query(conn, ROW, (eid,)) == [("pending", 0, None, None, None, False)]
    assert claim(conn, owner, call) == []
    assert scalar(conn, "SELECT outbox_unclaim_call(%s, %s)", (owner, str(uuid.uuid4()))) == 0


def test_a_repeat_waits_for_a_first_call_still_running(conn, db):
    """The first call still runs on the old connection (held here behind
    the kill switch's lock) when the repeat arrives: the repeat waits for
    it on the call's lock, then returns its rows."""
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 2)
    holder = psycopg2.connect(db)
    holder.autocommit = True
    query(holder, "SELECT pg_advisory_lock(outbox_kill_switch_lock_key())")
    first_conn = psycopg2.connect(db)
    first_conn.autocommit = True
    results = {}
    t1 = threading.Thread(target=lambda: results.update(first=claim(first_conn, owner, call)))
    t1.start()
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                  "AND database = (SELECT oid FROM pg_database "
                                  "WHERE datname = current_database()) AND NOT granted") == 1,
             what="the first call waiting")
    repeat_conn = psycopg2.connect(db)
    repeat_conn.autocommit = True
    t2 = threading.Thread(target=lambda: results.update(
        repeat=claim(repeat_conn, owner, call, repeat=True)))
    t2.start()
    # The repeat waits on the call's own lock (the first call holds it).
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                  "AND database = (SELECT oid FROM pg_database "
                                  "WHERE datname = current_database()) AND NOT granted "
                                  "AND ((classid::bigint << 32) | objid::bigint) "
                                  "= hashtextextended(%s, 0)", (call,)) == 1,
             what="the repeat waiting on the call's lock")
    query(holder, "SELECT pg_advisory_unlock(outbox_kill_switch_lock_key())")
    t1.join(10)
    t2.join(10)
    assert len(results["first"]) == 2
    assert results["repeat"] == results["first"]
    for c in (holder, first_conn, repeat_conn):
        c.close()


def test_unclaim_keeps_or_releases_the_lease_and_undoes_the_attempt(conn):
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 2)
    (a, _), (b, _) = claim(conn, owner, call)
    # Wrong call token or owner: nothing.
    assert scalar(conn, UNCLAIM, (owner, [a, b], str(uuid.uuid4()), False, 0)) == 0
    assert scalar(conn, UNCLAIM, (str(uuid.uuid4()), [a, b], call, False, 0)) == 0
    # Kept: pending, attempt undone, still ours; the old mark path sends it.
    assert scalar(conn, UNCLAIM, (owner, [a], call, False, 0)) == 1
    assert query(conn, ROW, (a,)) == [("pending", 0, owner, None, None, False)]
    marked = query(conn, "SELECT effect_id::text, attempts FROM outbox_mark_sending("
                         "%s, %s::uuid[], true, '{}', 30, %s)", (owner, [a], str(uuid.uuid4())))
    assert marked == [(a, 1)]
    # Released: pending, no lease, due after the delay.
    assert scalar(conn, UNCLAIM, (owner, [b], call, True, 60000)) == 1
    assert query(conn, ROW, (b,)) == [("pending", 0, None, None, None, False)]
    assert scalar(conn, "SELECT available_at > now() + interval '50 s' FROM outbox_effects "
                        "WHERE effect_id = %s", (b,))
    assert attempts(conn, a) == [] and attempts(conn, b) == []


def test_an_invalid_claimed_row_fails_without_spending_an_attempt(conn):
    kill_switch(conn, True)
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    add_due(conn, 1)
    ((eid, _),) = claim(conn, owner, call)
    # Only under its claim's token: a late call must not fail a row that was
    # claimed (or marked) again since.
    for item in (f'[{{"effect_id": "{eid}", "error": "x"}}]',
                 f'[{{"effect_id": "{eid}", "error": "x", "call": "{uuid.uuid4()}"}}]'):
        assert query(conn, "SELECT * FROM outbox_fail_invalid(%s, %s)", (owner, item)) == []
    assert query(conn, ROW, (eid,))[0][0] == "sending"
    query(conn, "SELECT * FROM outbox_fail_invalid(%s, %s)",
          (owner, f'[{{"effect_id": "{eid}", "error": "bad payload", "call": "{call}"}}]'))
    assert scalar(conn, "SELECT state || ' ' || attempts || ' ' || last_error FROM outbox_effects "
                        "WHERE effect_id = %s", (eid,)) == "failed 0 bad payload"


def test_the_worker_role_may_claim_and_unclaim_and_no_one_else(conn, login_as):
    kill_switch(conn, True)
    add_due(conn, 1)
    worker = login_as("outbox_dispatcher")
    assert len(claim(worker, str(uuid.uuid4()), str(uuid.uuid4()))) == 1
    assert scalar(worker, "SELECT outbox_unclaim_call(%s, %s)",
                  (str(uuid.uuid4()), str(uuid.uuid4()))) == 0
    producer = login_as("outbox_producer")
    for sql, args in ((CLAIM, (str(uuid.uuid4()), 1, True, str(uuid.uuid4()), False)),
                      (UNCLAIM, (str(uuid.uuid4()), [], str(uuid.uuid4()), True, 0)),
                      ("SELECT outbox_unclaim_call(%s, %s)", (str(uuid.uuid4()), str(uuid.uuid4())))):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(producer, sql, args)
    for sql in ("SELECT outbox_claim_repeated(%s)", "SELECT count(*) FROM outbox_claim_repeats "
                                                     "WHERE call = %s"):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(worker, sql, (str(uuid.uuid4()),))


# -- through the worker --------------------------------------------------------

def claimed_total(port):
    m = scrape(port)
    return {k: m[k] for k in ("outbox_claimed_total", "outbox_leased_total")}


def test_the_worker_claims_by_default_and_leases_when_told_not_to(conn, dispatchers, sink):
    """Rows a worker can send at once are claimed (outbox_claimed_total
    counts them); with [dispatcher] claim = false they are leased, then
    marked.  Either way each is sent once."""
    kill_switch(conn, True)
    port = free_port()
    w = dispatchers({**http_cfg(), "metrics": {"listen": f"127.0.0.1:{port}"}})
    for i in range(5):
        enqueue(conn, "http", sink.url + f"/ok?{i}", {})
    wait_for(lambda: states(conn).get("completed") == 5, what="claimed effects delivered")
    assert claimed_total(port) == {"outbox_leased_total": 5, "outbox_claimed_total": 5}
    w.stop()
    port = free_port()
    dispatchers({**http_cfg(), "metrics": {"listen": f"127.0.0.1:{port}"},
                 "dispatcher": {"claim": False}})
    for i in range(5):
        enqueue(conn, "http", sink.url + f"/ok?b{i}", {})
    wait_for(lambda: states(conn).get("completed") == 10, what="leased effects delivered")
    assert claimed_total(port) == {"outbox_leased_total": 5, "outbox_claimed_total": 0}
    assert scalar(conn, "SELECT count(*) FROM effect_attempts") == 10
    assert len(sink.received()) == 10 and len(sink.keys()) == 10


def test_a_claim_whose_answer_was_lost_is_repeated_and_its_rows_sent_once(conn, db, dispatchers,
                                                                            sink):
    """The claim commits, the connection breaks before its answer arrives
    (a proxy withholds it): the worker repeats the call after reconnecting,
    gets the same rows back and sends each once.  Without the repeat flag
    the repeat would claim nothing new and the rows would sit in `sending`
    until the reaper made them unknown."""
    from pg_cut_proxy import CutProxy
    proxy = CutProxy().start()
    try:
        kill_switch(conn, True)
        ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(5)]
        proxy.arm(b"outbox_claim")
        dispatchers({**http_cfg(), "database": {"conninfo": proxy.conninfo(worker_dsn(db)),
                                                "reconnect_min_ms": 50}})
        wait_for(lambda: states(conn).get("completed") == 5, timeout=20, what="all delivered")
        assert proxy.cuts == 1
        assert all(len(attempts(conn, i)) == 1 for i in ids)
        assert len(sink.received()) == 5 and len(sink.keys()) == 5
    finally:
        proxy.stop()


def test_a_worker_that_also_serves_email_never_claims(conn, dispatchers, sink, smtp):
    """email's thread pool queues sends (no OUTBOX_CAP_STARTS_AT_ONCE): a
    claimed row could wait `sending` there, and a worker dying then would
    leave a never-sent `unknown`.  A worker serving it leases, then marks."""
    kill_switch(conn, True)
    port = free_port()
    dispatchers({**http_cfg(), "metrics": {"listen": f"127.0.0.1:{port}"},
                 "provider.email": {"server": f"127.0.0.1:{smtp.port}", "starttls": "off"},
                 "dispatcher": {"providers": "http,email"}})
    enqueue(conn, "http", sink.url + "/ok?mixed", {})
    enqueue(conn, "email", "someone@example.com",
            {"from": "Outbox <noreply@example.com>", "subject": "s", "text": "t\n"})
    wait_for(lambda: states(conn).get("completed") == 2, what="both delivered")
    assert claimed_total(port) == {"outbox_leased_total": 2, "outbox_claimed_total": 0}


def test_rows_claimed_while_the_worker_stops_go_back_unsent(conn, db, dispatchers, sink):
    """SIGTERM with a claim on the wire (held here behind the kill switch's
    lock): the claim commits, its answer finds the worker stopping, and the
    rows go back to pending with the attempt undone; nothing is sent and
    the worker exits cleanly."""
    kill_switch(conn, True)
    holder = psycopg2.connect(db)
    holder.autocommit = True
    try:
        query(holder, "SELECT pg_advisory_lock(outbox_kill_switch_lock_key())")
        ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(3)]
        w = dispatchers(http_cfg())
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity "
                                      "WHERE wait_event_type = 'Lock' "
                                      "AND datname = current_database() "
                                      "AND query LIKE '%%outbox_claim%%'"),
                 what="the worker's claim waiting (not another of its statements)")
        w.signal(signal.SIGTERM)
        wait_for(lambda: any(e.get("event") == "stopping" for e in w.events()),
                 what="the worker stopping")
        query(holder, "SELECT pg_advisory_unlock(outbox_kill_switch_lock_key())")
        assert w.wait(timeout=20) == 0, w.log()
    finally:
        holder.close()
    # Claimed (leased_at set by the claim), then given back.
    got = query(conn, "SELECT state, attempts, lease_owner, mark_token, leased_at IS NOT NULL "
                      "FROM outbox_effects WHERE effect_id = ANY(%s::uuid[])", (ids,))
    assert got == [("pending", 0, None, None, True)] * 3, got
    assert scalar(conn, "SELECT count(*) FROM effect_attempts") == 0
    assert sink.received() == []


def test_no_claims_while_a_breaker_is_open(conn, dispatchers):
    """Rows are claimed until the host's breaker opens; then they are
    leased (a claimed row behind the breaker could only be given back, a
    non-HOT update each way) and wait, released until the breaker
    half-opens, without spending attempts."""
    kill_switch(conn, True)
    port, mport = free_port(), free_port()
    ids = [enqueue(conn, "http", f"http://127.0.0.1:{port}/x?{i}", {}) for i in range(6)]
    # batch_size 2 with max_per_host 1: a claim of one row is half a batch.
    t0 = time.monotonic()
    w = dispatchers({**http_cfg(breaker_failures=2, breaker_open_ms=60000, max_per_host=1,
                                max_attempts=50),
                     "dispatcher": {"batch_size": 2},
                     "metrics": {"listen": f"127.0.0.1:{mport}"}})

    def probes():   # one each 1, 3, 7, ... s after the opening (dispatcher/hosts.h)
        return int(math.log2(time.monotonic() - t0 + 1))

    wait_for(lambda: any(e.get("event") == "breaker_open" for e in w.events()), what="breaker open")
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE attempts = 0 "
                                  "AND lease_owner IS NULL AND available_at > now()")
             >= len(ids) - 3 - probes(), what="effects held behind the open breaker")
    assert scalar(conn, "SELECT sum(attempts) FROM outbox_effects") <= 3 + probes()
    assert scalar(conn, "SELECT count(*) FROM effect_attempts") <= 3 + probes()
    m = claimed_total(mport)
    assert 2 <= m["outbox_claimed_total"] <= 3 < m["outbox_leased_total"], m


def test_a_row_claimed_as_its_breaker_opens_waits_unsent_with_its_attempt_undone(conn, db,
                                                                                 dispatchers, sink):
    """claimed_new's "kept" path: the claim left with room for the row, and
    the host's breaker opened before the answer came back.  The row is not
    sent; it goes back to pending under the worker's lease with the attempt
    undone (outbox_unclaim, keep), waits for the breaker, and is then sent
    once.  The claim is held on the wire by the kill switch's lock (which
    it takes shared) while an earlier send to the same host times out.
    No poll: a claim a poll started before the second row's insert would
    wait on the lock too, but its transaction's now() is older than the
    row's available_at, so it would find nothing and the row be leased."""
    kill_switch(conn, True)
    mport = free_port()
    w = dispatchers({**http_cfg(breaker_failures=1, breaker_open_ms=1500, timeout_ms=1000,
                                max_attempts=1, max_per_host=4),
                     "dispatcher": {"batch_size": 2, "poll_interval_ms": 60000},
                     "metrics": {"listen": f"127.0.0.1:{mport}"}})
    first = enqueue(conn, "http", sink.url + "/hang", {})
    wait_for(lambda: any(r["path"].startswith("/hang") for r in sink.received()),
             what="the first send in flight")
    holder = psycopg2.connect(db)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(outbox_kill_switch_lock_key())")
            second = enqueue(conn, "http", sink.url + "/ok", {})
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity "
                                          "WHERE wait_event_type = 'Lock' "
                                          "AND datname = current_database() "
                                          "AND query LIKE '%%outbox_claim%%' "
                                          "AND xact_start >= (SELECT available_at "
                                          "  FROM outbox_effects WHERE effect_id = %s)",
                                    (second,)) >= 1,
                     what="the second row's claim, begun after its insert, waiting on "
                          "the kill switch's lock")
            wait_for(lambda: any(e.get("event") == "breaker_open" for e in w.events()),
                     what="the breaker opened by the first send's timeout")
        holder.rollback()
    finally:
        holder.close()
    wait_for(lambda: query(conn, "SELECT state, attempts, lease_owner IS NOT NULL OR "
                                 "available_at > now() FROM outbox_effects WHERE effect_id = %s",
                           (second,)) == [("pending", 0, True)],
             what="the claimed row given back unsent, attempt undone")
    assert attempts(conn, second) == []
    assert not any(r["path"].startswith("/ok") for r in sink.received())
    assert scrape(mport)["outbox_claimed_total"] == 2
    wait_for(lambda: states(conn).get("completed") == 1, timeout=20,
             what="the row sent once the breaker half-opened")
    assert query(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (second,)) == \
        [("completed",)]
    assert [a["outcome_class"] for a in attempts(conn, second)] == ["accepted"]
    assert len([r for r in sink.received() if r["path"].startswith("/ok")]) == 1
    # The first effect: one provider call (max_attempts = 1), never repeated.
    assert len(attempts(conn, first)) == 1
