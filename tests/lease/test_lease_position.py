# SPDX-License-Identifier: ISC
"""Leasing from a position in the due index
(outbox_lease in sql/functions/30_dispatcher.sql, take_batch() in dispatcher/take.c).

A worker leases from just after the last row it leased, so that a lease
does not walk the dead entries earlier rows left at the head of the index
(they cannot be cleaned while a long transaction holds vacuum back).  Rows
that become due behind the position are found by the worker's periodic
scan from the head.  A lease a dead worker left on a pending row does not
hold the row back.
"""
import uuid

import psycopg2

from outbox_test import (add_due, effect, enqueue, finish_as, kill_switch, make_run, query, scalar,
                         wait_for)

LEASE = ("SELECT effect_id::text, available_at FROM outbox_lease(%s, 'w', %s, 30, '{http}', true, "
         "%s, %s)")


def test_lease_comes_back_in_due_order_with_its_position(conn):
    kill_switch(conn, True)
    early = add_due(conn, 3, "now() - interval '2 minutes'")
    late = add_due(conn, 3, "now() - interval '1 minute'")
    rows = query(conn, LEASE, (str(uuid.uuid4()), 10, None, None))
    got = [r[0] for r in rows]
    # Due order, then effect_id within one instant.
    assert got == sorted(early) + sorted(late)
    assert [r[1] for r in rows] == sorted(r[1] for r in rows)


def test_lease_starts_after_the_position_given(conn):
    kill_switch(conn, True)
    ids = sorted(add_due(conn, 6))
    at = scalar(conn, "SELECT available_at FROM outbox_effects WHERE effect_id = %s", (ids[2],))
    rows = query(conn, LEASE, (str(uuid.uuid4()), 10, at, ids[2]))
    # The same instant for all six: the position splits them by id.
    assert [r[0] for r in rows] == ids[3:]
    # The three behind the position are still there for a scan from the head.
    rows = query(conn, LEASE, (str(uuid.uuid4()), 10, None, None))
    assert [r[0] for r in rows] == ids[:3]


def test_a_recent_position_still_finds_rows_that_committed_just_behind_it(conn):
    """A position less than 50 ms old is taken back to 50 ms ago: a row
    from a producer's transaction that started a moment before the last
    row leased, and committed after it, is still found.  One transaction,
    so that now() is the same for the rows and the lease."""
    kill_switch(conn, True)
    behind, ahead = sorted(add_due(conn, 2))
    query(conn, "BEGIN")
    query(conn, "UPDATE effect_live SET available_at = now() - interval '10 milliseconds' "
                "WHERE effect_id = %s", (behind,))
    query(conn, "UPDATE effect_live SET available_at = now() - interval '5 milliseconds' "
                "WHERE effect_id = %s", (ahead,))
    rows = query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', 10, 30, '{http}', true, "
                       "now() - interval '5 milliseconds', %s)", (str(uuid.uuid4()), ahead))
    query(conn, "COMMIT")
    assert [r[0] for r in rows] == [behind, ahead]
    # An old position is exact: nothing behind it comes back.
    [old] = add_due(conn, 1, "now() - interval '1 hour'")
    at = scalar(conn, "SELECT available_at FROM outbox_effects WHERE effect_id = %s", (old,))
    assert query(conn, LEASE, (str(uuid.uuid4()), 10, at, old)) == []


def test_position_does_not_hide_rows_due_later(conn):
    """A retry scheduled in the future is ahead of any position taken now."""
    kill_switch(conn, True)
    ids = add_due(conn, 2)
    rows = query(conn, LEASE, (str(uuid.uuid4()), 10, None, None))
    last_at, last_id = rows[-1][1], rows[-1][0]
    soon = add_due(conn, 1, "now() + interval '200 milliseconds'")
    assert query(conn, LEASE, (str(uuid.uuid4()), 10, last_at, last_id)) == []
    got = wait_for(lambda: query(conn, LEASE, (str(uuid.uuid4()), 10, last_at, last_id)),
                   timeout=10, what="the retry to become due")
    assert [r[0] for r in got] == soon
    assert set(ids).isdisjoint(r[0] for r in got)


def deliver_first_then_late(conn, sink, before_late=lambda: None):
    """One effect delivered (so the worker holds a position), then a row
    due an hour ago, as a producer's transaction that committed late would
    leave it: behind any position the worker holds.  Returns the late
    row's effect key once it is delivered."""
    first = enqueue(conn, "http", sink.url + "/ok", {})
    wait_for(lambda: effect(conn, first)["state"] == "completed", timeout=20,
             what="the first effect")
    before_late()
    key = make_run(conn)
    late = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                        "available_at) VALUES (%s, 'http', %s, '{}', now() - interval '1 hour') "
                        "RETURNING effect_id", (key, sink.url + "/ok"))
    wait_for(lambda: effect(conn, late)["state"] == "completed", timeout=20,
             what="the row behind the position")
    return scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (late,))


def test_worker_finds_a_row_that_became_due_behind_its_position(conn, dispatchers, sink):
    """A producer transaction that commits late leaves a row whose
    available_at is behind the worker's position: the NOTIFY-driven lease
    from the position cannot see it; the scan from the head must.
    lease_head_slow_ms = 0: always lease from the position."""
    kill_switch(conn, True)
    w = dispatchers({"provider.http": {"allow_hosts": "127.0.0.1"},
                     "dispatcher": {"poll_interval_ms": 100, "lease_head_slow_ms": 0}})
    # A few slow (here: any) leases from the head in a row switch it.
    ekey = deliver_first_then_late(conn, sink, lambda: wait_for(
        lambda: any(e.get("event") == "lease_mode" and e.get("mode") == "position"
                    for e in w.events()), timeout=20, what="leasing from the position"))
    assert sink.count(key=ekey) == 1
    # A head that is only slower than the setting (here: any) is a busy
    # queue, logged at info; warn is for a head over 100 ms (vacuum held
    # back), which an operator should go and look at.
    switched = [e for e in w.events() if e.get("event") == "lease_mode" and e.get("mode") == "position"]
    assert switched[0]["level"] == "info" and switched[0]["head_scan_ms"] < 100, switched[0]


def test_by_default_a_late_commit_is_leased_at_once(conn, dispatchers, sink):
    """With vacuum working the head is fast: every lease scans from it, so a
    row due long ago that commits now goes out on its NOTIFY (the poll is
    10 minutes here: a lease from the position would miss it, and nothing
    else would lease again within the wait)."""
    kill_switch(conn, True)
    # No switch to the position however slow the (ASan, loaded) machine.
    w = dispatchers({"provider.http": {"allow_hosts": "127.0.0.1"},
                     "dispatcher": {"poll_interval_ms": 600000, "lease_head_slow_ms": 60000}})
    ekey = deliver_first_then_late(conn, sink)
    assert sink.count(key=ekey) == 1
    assert not any(e.get("event") == "lease_mode" for e in w.events())


def test_worker_sends_everything_in_a_stream_of_bulk_inserts(conn, dispatchers, sink):
    """Many rows sharing one available_at (one INSERT), several inserts,
    two workers: every row delivered once."""
    kill_switch(conn, True)
    dispatchers({"provider.http": {"allow_hosts": "127.0.0.1"},
                 "dispatcher": {"batch_size": 7}})
    dispatchers({"provider.http": {"allow_hosts": "127.0.0.1"},
                 "dispatcher": {"batch_size": 5}})
    keys = []
    for _ in range(5):
        key = make_run(conn)
        keys.append(key)
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "SELECT %s, 'http', %s || '?n=' || g, '{}' FROM generate_series(1, 40) g",
              (key, sink.url + "/ok"))
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'completed'") == 200,
             timeout=60, what="200 effects completed")
    assert sink.count() == 200
    assert len(sink.keys()) == 200


def test_an_expired_pending_lease_is_leased_again_and_neither_sweep_nor_reaper_touch_it(conn):
    """A worker that leased and died before marking leaves its lease on a
    pending row; the next lease takes the row as if it were free.  Since
    013 the sweep does not tidy such leases: that UPDATE read the whole
    table (no index may hold a pending row's lease, or leases stop being
    HOT)."""
    kill_switch(conn, True)
    query(conn, "UPDATE outbox_sweeps SET last_run = '-infinity'")
    [eid] = add_due(conn, 1)
    query(conn, "UPDATE effect_live SET lease_owner = gen_random_uuid(), lease_worker = 'gone', "
                "lease_expires_at = now() - interval '1 second' WHERE effect_id = %s", (eid,))
    assert query(conn, "SELECT * FROM outbox_reap('w', 500)") == []
    assert query(conn, "SELECT * FROM outbox_sweep('w', 60, 0)") == []
    assert query(conn, "SELECT lease_worker, state FROM outbox_effects WHERE effect_id = %s",
                 (eid,)) == [("gone", "pending")]
    owner = str(uuid.uuid4())
    leased = query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w2', 10, 30, '{http}', true, "
                         "NULL, NULL)", (owner,))
    assert leased == [(eid,)]
    assert query(conn, "SELECT lease_owner::text, lease_worker, lease_expires_at > now() "
                       "FROM outbox_effects WHERE effect_id = %s", (eid,)) == [(owner, "w2", True)]


CLAIM = ("SELECT effect_id::text, due_entries FROM outbox_claim(%s, 'w', %s, 30, '{http}', true, "
         "'{}', %s)")


def hold_snapshot(db):
    """A REPEATABLE READ transaction that has taken its snapshot (a report,
    a pg_dump): what it might still read cannot be cleaned up."""
    holder = psycopg2.connect(db)
    holder.set_session(isolation_level="REPEATABLE READ")
    holder.cursor().execute("SELECT count(*) FROM effect_outbox")
    return holder


def test_a_claim_says_how_many_index_entries_its_walk_read(conn, db):
    """outbox_claim's due_entries: the due index's entries its walk read,
    the same on every row.  Under a held snapshot the entries of effects
    finished since stay at the head and each walk from there reads them;
    once they can be cleaned up a walk reads about what it returns."""
    kill_switch(conn, True)
    holder = hold_snapshot(db)
    finish_as(conn, add_due(conn, 500, "now() - interval '1 hour'"), "completed")
    add_due(conn, 3)
    rows = query(conn, CLAIM, (str(uuid.uuid4()), 10, str(uuid.uuid4())))
    assert len(rows) == 3 and len({r[1] for r in rows}) == 1, rows
    assert rows[0][1] >= 503, rows
    holder.rollback()
    holder.close()
    query(conn, "VACUUM effect_live")
    add_due(conn, 3)
    rows = query(conn, CLAIM, (str(uuid.uuid4()), 10, str(uuid.uuid4())))
    # The three, and the three claimed above (`sending`, still in the index).
    assert len(rows) == 3 and 3 <= rows[0][1] <= 6 + 3, rows


def test_a_head_full_of_entries_no_claim_can_take_is_left_whatever_the_machine(conn, db,
                                                                              dispatchers, sink):
    """However fast the machine (lease_head_slow_ms = 60000: no scan is
    slow by its time), a claim from the head whose walk passed over more
    than 2,000 entries it could not take (here the dead ones a held
    snapshot keeps) switches the worker at once to claiming from its
    position (a count is not a busy moment: no three in a row).  Once the snapshot has ended and the entries are
    cleaned up, the next scan from the head that finds a row finds it
    quickly, and the worker is back at the head."""
    kill_switch(conn, True)
    holder = hold_snapshot(db)
    finish_as(conn, add_due(conn, 3000, "now() - interval '1 hour'"), "completed")
    w = dispatchers({"provider.http": {"allow_hosts": "127.0.0.1"},
                     "dispatcher": {"poll_interval_ms": 100, "lease_head_slow_ms": 60000}})

    def switched():
        return [e for e in w.events() if e.get("event") == "lease_mode"]

    one = enqueue(conn, "http", sink.url + "/ok", {})
    wait_for(lambda: effect(conn, one)["state"] == "completed", timeout=20,
             what="an effect past the dead entries")
    wait_for(lambda: switched(), timeout=20, what="claiming from the position")
    e = switched()[0]
    assert e["mode"] == "position" and e["head_entries"] > 2000, e
    assert e["head_scan_ms"] < 60000 and e["level"] == "info", e
    holder.rollback()
    holder.close()
    query(conn, "VACUUM effect_live")
    # A row behind the position: only a scan from the head finds it.
    ekey = deliver_first_then_late(conn, sink)
    assert sink.count(key=ekey) == 1
    wait_for(lambda: len(switched()) >= 2, timeout=20, what="back at the head")
    assert switched()[1]["mode"] == "head", switched()
