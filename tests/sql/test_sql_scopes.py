# SPDX-License-Identifier: ISC
"""Scoped pauses and rate limits in SQL (sql/functions/33_scopes.sql;
docs/design.md, "Scoped pauses and rate limits"): the pause's commit point
is the kill switch's lock, the lease parks what it can see is paused, the
mark holds by the host the worker passes, the bucket defers rows to its
slots without spending attempts, and a worker built before scopes existed
takes nothing it would mishandle.
"""
import json
import threading
import uuid

import psycopg2
import pytest

from outbox_test import connect, kill_switch, make_run, query, scalar, wait_for

LEASE = "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, %s, true)"
MARK = ("SELECT effect_id::text, attempts, blocked, held_by, held_until "
        "FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s, %s::text[])")


def add(conn, rows):
    """Effects of one run, due a minute ago: rows = [(type, target), ...]."""
    key = make_run(conn)
    ids = []
    for i, (t, target) in enumerate(rows):
        ids.append(str(scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                                    "payload) VALUES (%s, %s, %s, '{}') RETURNING effect_id",
                              (key, t, target))))
    query(conn, "UPDATE effect_live SET available_at = now() - interval '1 minute' "
                "WHERE effect_id = ANY(%s::uuid[])", (ids,))
    return ids


def pause(conn, kind, value, paused=True):
    return query(conn, "SELECT effect_id::text FROM outbox_scope_pause(%s, %s, %s, 'op', 'why')",
                 (kind, value, paused))


def lock_waiters(conn, *calls, event=None):
    """Sessions of this database waiting for a lock (of the event given)
    in a statement that calls one of `calls`."""
    like = " OR ".join("query LIKE %s" for _ in calls)
    return scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND (%s IS NULL OR wait_event = %s) AND datname = current_database() "
                        f"AND ({like})", (event, event) + tuple(f"%{c}%" for c in calls))


def live(conn, eid):
    return dict(zip(("state", "attempts", "held_by", "available_at", "lease_owner"), query(
        conn, "SELECT state, attempts, held_by, available_at::text, lease_owner::text "
              "FROM effect_live WHERE effect_id = %s", (eid,))[0]))


def test_target_host_reading(conn):
    cases = {"https://API.Example.com:8443/x": "api.example.com", "http://[::1]:80/": "::1",
             "http://u:p@h.example/": "h.example", "Task/Ext__c": None, "a@b.org": None,
             "ftp://x.example/": None, "https://": None}
    for target, host in cases.items():
        assert scalar(conn, "SELECT outbox_target_host(%s)", (target,)) == host, target


# Every spelling of one address libcurl connects to, and the one the worker
# writes (providers/lib/hostname.c; tests/unit/test_hosts.c has the same).
SPELLINGS = {
    "127.0.0.2": "127.0.0.2", "2130706434": "127.0.0.2", "0x7f000002": "127.0.0.2",
    "0X7F000002": "127.0.0.2", "0x7f.0.0.2": "127.0.0.2", "0x7f.0x0.0x0.0x2": "127.0.0.2",
    "0177.0.0.2": "127.0.0.2", "0177.0000.0000.0002": "127.0.0.2", "017700000002": "127.0.0.2",
    "127.2": "127.0.0.2", "127.0.2": "127.0.0.2", "127.0.0x2": "127.0.0.2",
    "127.000.000.002": "127.0.0.2", "127.0.0.2.": "127.0.0.2", "0": "0.0.0.0",
    "4294967295": "255.255.255.255", "1.16777215": "1.255.255.255", "1.2.65535": "1.2.255.255",
    "::ffff:127.0.0.2": "127.0.0.2", "[::ffff:127.0.0.2]": "127.0.0.2",
    "::FFFF:7F00:2": "127.0.0.2", "0:0:0:0:0:ffff:7f00:0002": "127.0.0.2",
    "0000:0000:0000:0000:0000:ffff:127.0.0.2": "127.0.0.2",
    "::1": "::1", "[::1]": "::1", "0:0:0:0:0:0:0:1": "::1",
    "0000:0000:0000:0000:0000:0000:0000:0001": "::1", "2001:DB8::1": "2001:db8::1",
    "2001:0db8:0000:0000:0000:0000:0000:0001": "2001:db8::1",
    "2001:db8:0:1:0:0:0:1": "2001:db8:0:1::1", "2001:db8:0:0:1:0:0:1": "2001:db8::1:0:0:1",
    "2001:db8:0:1:1:1:1:1": "2001:db8:0:1:1:1:1:1", "::": "::",
    "::102:304": "::1.2.3.4", "::ffff:0:102:304": "::ffff:0:102:304",
    "API.Example.COM": "api.example.com", "api.example.com.": "api.example.com",
    "localhost": "localhost", "xn--bcher-kva.example": "xn--bcher-kva.example",
    "a_b.example": "a_b.example", "00x1": "00x1", "0x": "0x",
}
NONSENSE = ["", ".", "127.0.0.2:80", "::::", "1.2.3.4.5", "256.1.1.1", "4294967296", "1.16777216",
            "[127.0.0.1]", "fe80::1%eth0", "a..example", "-a.example", "host/path", "user@host",
            "1::2::3", "::ffff:1.2.3.256", "::/0", "1.2.3.4/8", "127.0.0.08"]


def test_the_database_reads_every_spelling_of_a_host_as_the_worker_does(conn):
    for given, canon in SPELLINGS.items():
        assert scalar(conn, "SELECT outbox_host_canon(%s)", (given,)) == canon, given
    for given in NONSENSE:
        assert scalar(conn, "SELECT outbox_host_canon(%s)", (given,)) is None, given
    # In a target: the URL host, in every spelling libcurl accepts.
    for given, canon in SPELLINGS.items():
        if given.endswith(".") or given in ("[::1]", "[::ffff:127.0.0.2]"):
            continue
        url_host = f"[{given}]" if ":" in given else given
        for target in (f"http://{url_host}/x", f"HTTPS://user:pw@{url_host}:8443/x?q#f"):
            assert scalar(conn, "SELECT outbox_target_host(%s)", (target,)) == canon, target


def test_a_scope_host_is_stored_as_the_worker_spells_it_and_nonsense_is_refused(conn):
    for given, canon in SPELLINGS.items():
        assert scalar(conn, "SELECT outbox_scope_value('host', %s)", (given,)) == canon, given
    for given in NONSENSE:
        with pytest.raises(psycopg2.Error) as e:
            query(conn, "SELECT outbox_scope_value('host', %s)", (given,))
        assert e.value.pgcode == "22023", given
        conn.rollback()
    with pytest.raises(psycopg2.Error) as e:
        query(conn, "SELECT outbox_scope_pause('host', '127.0.0.2:80', true, 'op', 'why')")
    assert "not a host name or address" in str(e.value)
    conn.rollback()


def test_the_lease_parks_a_paused_type_and_crm_object_and_walks_past_them(conn):
    """Paused rows at the head of the queue are parked (not leased, no
    attempt) and the lease goes on to the rows behind them; resuming puts
    exactly that scope's rows back, due now."""
    kill_switch(conn, True)
    mail = add(conn, [("email", f"u{i}@example.com") for i in range(5)])
    task = add(conn, [("crm", "Task/Ext__c")])
    note = add(conn, [("crm", "Note/Ext__c")])
    pause(conn, "type", "email")
    pause(conn, "crm_object", "TASK")
    got = [r[0] for r in query(conn, LEASE, (str(uuid.uuid4()), 2, ["email", "crm"]))]
    assert got == note
    for eid in mail:
        assert live(conn, eid)["held_by"] == "type:email"
        assert live(conn, eid)["available_at"] == "infinity" and live(conn, eid)["attempts"] == 0
    assert live(conn, task[0])["held_by"] == "crm_object:task"
    assert scalar(conn, "SELECT waiting FROM outbox_scope_status WHERE kind = 'type'") == 5
    pause(conn, "type", "email", False)
    assert all(live(conn, e)["held_by"] is None for e in mail)
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY(%s::uuid[]) "
                        "AND available_at <= now()", (mail,)) == 5
    assert live(conn, task[0])["held_by"] == "crm_object:task"    # still paused


def test_the_mark_holds_by_the_host_the_worker_passes(conn):
    """A crm target names no host: the worker's host decides at the mark."""
    kill_switch(conn, True)
    ids = add(conn, [("crm", "Task/Ext__c"), ("crm", "Note/Ext__c")])
    owner = str(uuid.uuid4())
    assert len(query(conn, LEASE, (owner, 10, ["crm"]))) == 2
    pause(conn, "host", "acme.my.salesforce.com")
    rows = {r[0]: r for r in query(conn, MARK, (owner, ids, str(uuid.uuid4()),
                                                ["acme.my.salesforce.com", "other.example"]))}
    assert rows[ids[0]][2] is True and rows[ids[0]][3] == "host:acme.my.salesforce.com"
    assert rows[ids[1]][2] is False and rows[ids[1]][1] == 1
    held = live(conn, ids[0])
    assert held["state"] == "pending" and held["attempts"] == 0 and held["lease_owner"] is None
    assert held["available_at"] == "infinity"


def test_a_lease_parks_past_a_scope_row_another_transaction_holds_and_counts_it_later(conn, db):
    """A paused scope's row held by another transaction (a mark, which
    locks the scopes in key order and may be waiting for a bucket the
    claim around this lease holds): the lease parks the row without
    waiting for it, its count goes to the log, the status shows it at
    once, and the sweep's fold moves it onto the scope's row."""
    kill_switch(conn, True)
    pause(conn, "host", "paused.example")
    (held,) = add(conn, [("http", "https://paused.example/a")])
    other = connect(db)
    query(other, "BEGIN")
    query(other, "SELECT 1 FROM outbox_scopes WHERE value = 'paused.example' FOR UPDATE")
    try:
        query(conn, "SET lock_timeout = '500ms'")
        assert query(conn, LEASE, (str(uuid.uuid4()), 10, ["http"])) == []
        query(conn, "RESET lock_timeout")
        assert live(conn, held)["held_by"] == "host:paused.example"
        assert scalar(conn, "SELECT held_total FROM outbox_scopes") == 0
        assert query(conn, "SELECT kind, value, n FROM outbox_scope_held_log") == \
            [("host", "paused.example", 1)]
        assert scalar(conn, "SELECT held_total FROM outbox_scope_status") == 1
        # The fold skips a row it cannot take now.
        assert scalar(conn, "SELECT outbox_scope_held_fold()") == 0
    finally:
        query(other, "ROLLBACK")
        other.close()
    assert scalar(conn, "SELECT outbox_scope_held_fold()") == 1
    assert scalar(conn, "SELECT held_total FROM outbox_scopes") == 1
    assert scalar(conn, "SELECT count(*) FROM outbox_scope_held_log") == 0
    assert scalar(conn, "SELECT held_total FROM outbox_scope_status") == 1
    # A scope cleared takes its log with it.
    query(conn, "INSERT INTO outbox_scope_held_log (kind, value, n) "
                "VALUES ('host', 'paused.example', 2)")
    pause(conn, "host", "paused.example", False)
    assert scalar(conn, "SELECT count(*) FROM outbox_scope_held_log") == 0


def test_the_bucket_lets_its_burst_go_and_defers_the_rest_to_successive_slots(conn):
    """2 per second, a burst of 3: of 10 rows 3 go, 7 are deferred to slots
    half a second apart; a later row (another worker's) to the slot after
    them.  (The slots are 500 ms apart so that a slow machine does not
    refill the bucket between the statements.)"""
    kill_switch(conn, True)
    ids = add(conn, [("http", f"https://api.example.com/{i}") for i in range(10)])
    query(conn, "SELECT outbox_scope_limit('host', 'api.example.com', 2, 3, 'op', 'why')")
    owner = str(uuid.uuid4())
    assert len(query(conn, LEASE, (owner, 10, ["http"]))) == 10
    rows = query(conn, MARK, (owner, ids, str(uuid.uuid4()), None))
    went = [r for r in rows if not r[2]]
    held = sorted((r for r in rows if r[2]), key=lambda r: r[4])
    assert len(went) == 3 and len(held) == 7
    assert all(r[3] == "host:api.example.com" and r[1] == 0 for r in held)
    gaps = [(b[4] - a[4]).total_seconds() for a, b in zip(held, held[1:])]
    assert all(abs(g - 0.5) < 0.001 for g in gaps), gaps
    # A second worker's rows come after the first one's slots, not at once.
    more = add(conn, [("http", "https://api.example.com/late")])
    other = str(uuid.uuid4())
    assert len(query(conn, LEASE, (other, 10, ["http"]))) == 1
    late = query(conn, MARK, (other, more, str(uuid.uuid4()), None))[0]
    assert late[2] is True and late[4] > held[-1][4]
    assert scalar(conn, "SELECT held_total FROM outbox_scopes") == 8
    # At its slot a deferred row has paid: it goes without drawing again,
    # while the bucket (in debt for the later slots) holds a new row.
    query(conn, "UPDATE effect_live SET available_at = CASE WHEN effect_id = %s THEN now() "
                "ELSE available_at + interval '1 hour' END WHERE effect_id = ANY(%s::uuid[])",
          (held[0][0], [r[0] for r in held]))
    fresh = add(conn, [("http", "https://api.example.com/fresh")])
    assert len(query(conn, LEASE, (owner, 10, ["http"]))) == 2
    rows = {r[0]: r for r in query(conn, MARK, (owner, [held[0][0]] + fresh, str(uuid.uuid4()), None))}
    assert rows[held[0][0]][2] is False and rows[fresh[0]][2] is True


def test_a_pause_waits_for_a_mark_in_progress_and_lists_its_sends(conn, db):
    """The commit point: a pause cannot commit while a mark holds the
    switch's lock shared; once it returns, that mark's rows are the ones
    it lists, and a later mark holds the scope's rows."""
    kill_switch(conn, True)
    ids = add(conn, [("http", "https://api.example.com/a"), ("http", "https://api.example.com/b")])
    owner = str(uuid.uuid4())
    assert len(query(conn, LEASE, (owner, 1, ["http"]))) == 1
    first = scalar(conn, "SELECT effect_id::text FROM effect_live WHERE lease_owner = %s", (owner,))
    marker = connect(db)
    marker.autocommit = False
    with marker.cursor() as cur:
        cur.execute(MARK, (owner, [first], str(uuid.uuid4()), ["api.example.com"]))
        assert cur.fetchall()[0][2] is False
    listed = []
    t = threading.Thread(target=lambda: listed.extend(r[0] for r in pause(connect(db), "type", "http")))
    t.start()
    wait_for(lambda: lock_waiters(conn, "outbox_scope_pause", event="advisory") == 1,
             what="the pause waiting")
    assert t.is_alive(), "the pause committed while a mark held the switch's lock"
    marker.commit()
    t.join(10)
    assert listed == [first]
    second = [i for i in ids if i != first]
    assert len(query(conn, LEASE, (owner, 10, ["http"]))) == 0   # parked by the lease
    assert live(conn, second[0])["held_by"] == "type:http"
    marker.close()


def sending(conn, rows):
    """Effects moved to `sending` by one owner, as a worker without scopes
    marks them (no hosts passed): their ids, and the owner."""
    ids = add(conn, rows)
    owner = str(uuid.uuid4())
    assert len(query(conn, LEASE, (owner, len(ids), list({t for t, _ in rows})))) == len(ids)
    marked = query(conn, MARK, (owner, ids, str(uuid.uuid4()), None))
    assert all(r[2] is False for r in marked)
    return ids, owner


def completed(eid):
    return json.dumps([{"effect_id": eid, "attempt": 1, "outcome": "accepted",
                        "next_state": "completed", "provider_id": "p-1"}])


def test_a_host_pause_lists_its_sends_in_flight_in_every_spelling(conn):
    """The host of each send in flight is read as the worker connects to
    it: every spelling of 127.0.0.2 is listed, 127.0.0.3 is not."""
    kill_switch(conn, True)
    spellings = ["127.0.0.2", "2130706434", "0x7f000002", "0x7f.0.0.2", "0177.0.0.2", "127.2",
                 "127.000.000.002", "[::ffff:127.0.0.2]", "[::ffff:7f00:2]",
                 "[0:0:0:0:0:ffff:7f00:2]"]
    mine, _ = sending(conn, [("http", f"http://{h}:8080/x") for h in spellings])
    other, _ = sending(conn, [("http", "http://127.0.0.3:8080/x"), ("http", "http://0x7f000003/")])
    listed = sorted(r[0] for r in pause(conn, "host", "::ffff:127.0.0.2"))
    assert listed == sorted(mine), (len(listed), len(mine))
    assert not set(other) & set(listed)


CLAIM = ("SELECT effect_id::text FROM outbox_claim(%s, 'w', 10, 30, %s, true, '{}', %s, "
         "p_lease_if_scoped => true, p_type_hosts => %s)")


CLAIM_CHECKED = ("SELECT effect_id::text, leased_only, check_hosts FROM outbox_claim(%s, 'w', 10, "
                 "30, %s, true, '{}', %s, p_lease_if_scoped => true, p_type_hosts => %s)")


def claim_checked(conn, types, type_hosts, owner=None):
    return sorted(query(conn, CLAIM_CHECKED, (owner or str(uuid.uuid4()), types,
                                              str(uuid.uuid4()), type_hosts)))


def tokens(conn, value):
    return scalar(conn, "SELECT tokens FROM outbox_scopes WHERE value = %s", (value,))


def test_a_claim_pays_for_the_limits_its_rows_certainly_meet_and_leases_otherwise(conn):
    """A limit on a host no due row goes to: the claim moves the rows to
    `sending`, draws nothing and returns the scoped host for the worker to
    check.  A row to the limited host (its URL's host; a CRM row by its
    instance's host): claimed too, one token drawn, that host left out of
    its check.  A bucket short of a token, a host only perhaps in the URL,
    a row of a type with no host known: a lease, nothing drawn.  A worker
    that passes no hosts (built before the check): a lease."""
    kill_switch(conn, True)
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', 0.5, 1, 'op', 'why')")
    web = add(conn, [("http", "https://api.example/x"), ("http", "https://other.example/y")])
    assert claim_checked(conn, ["http"], [None]) == sorted(
        (i, False, ["limited.example"]) for i in web)
    assert {live(conn, i)["state"] for i in web} == {"sending"}
    assert tokens(conn, "limited.example") == 1
    # A row to the limited host among them: claimed, its token drawn.
    other, to_limited = add(conn, [("http", "https://api.example/z"),
                                   ("http", "https://LIMITED.example/q")])
    assert claim_checked(conn, ["http"], [None]) == sorted(
        [(other, False, ["limited.example"]), (to_limited, False, [])])
    assert live(conn, to_limited)["state"] == "sending"
    assert tokens(conn, "limited.example") == 0
    # The bucket is short now (a token in 2 s): a lease, nothing drawn.
    at = scalar(conn, "SELECT tokens_at FROM outbox_scopes WHERE value = 'limited.example'")
    (next_one,) = add(conn, [("http", "https://limited.example/r")])
    assert claim_checked(conn, ["http"], [None]) == [(next_one, True, None)]
    assert live(conn, next_one)["state"] == "pending"
    assert scalar(conn, "SELECT tokens_at FROM outbox_scopes WHERE value = 'limited.example'") == at
    # A host only perhaps the URL's: a lease, whatever the bucket holds.
    # (Each leased row keeps its lease: the next claim walks past it.)
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', 1000, 100, 'op', 'why')")
    for target in ["https://api.example/?to=limited.example", "https://u@limited.example/",
                   "https://limited.example.evil/", "ftp://limited.example/",
                   "https://limited.example\\@other.example/",
                   # A password, not a port: the host is the one after '@'.
                   "https://limited.example:x@other.example/p",
                   "https://limited.example:@2130706433/q",
                   "https://limited.example:80@other.example/"]:
        (row,) = add(conn, [("http", target)])
        assert claim_checked(conn, ["http"], [None]) == [(row, True, None)], target
    assert tokens(conn, "limited.example") == 100
    # A port is the limited host's: drawn for.
    (port,) = add(conn, [("http", "https://limited.example:8443/p")])
    assert claim_checked(conn, ["http"], [None]) == [(port, False, [])]
    # A CRM row by its instance's host: unscoped, drawn for, or unknown.
    for type_hosts, expect in [(["crm.example"], (False, ["limited.example"])),
                               (["limited.example"], (False, [])), ([None], (True, None))]:
        (rec,) = add(conn, [("crm", "Task/Ext__c")])
        got = claim_checked(conn, ["crm"], type_hosts)
        assert got == [(rec,) + expect], (type_hosts, got)
    assert 98 < tokens(conn, "limited.example") < 99.1
    # A worker that passes no hosts: a lease while any host is scoped.
    (old,) = add(conn, [("http", "https://api.example/w")])
    assert claim_checked(conn, ["http"], None) == [(old, True, None)]


def test_a_claimed_row_pays_once_whether_repeated_given_back_or_released(conn):
    """What each claimed row drew is kept with its call.  The claim's repeat
    tells each row's unpaid hosts as the first call did (not every scoped
    host, which would send the rows to a mark that draws again).  A row
    given back to be marked gets its tokens back, once, from every bucket
    it drew on, and pays at its mark; a row released unsent (the worker
    stopping) gets them back too."""
    kill_switch(conn, True)
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', 0.01, 5, 'op', 'why')")
    query(conn, "SELECT outbox_scope_limit('type', 'http', 0.01, 5, 'op', 'why')")
    a, b, c = add(conn, [("http", "https://limited.example/a"), ("http", "https://limited.example/b"),
                         ("http", "https://limited.example/c")])
    owner, call = str(uuid.uuid4()), str(uuid.uuid4())
    first = sorted(query(conn, CLAIM_CHECKED.replace("p_lease_if_scoped", "p_repeat => false, "
                                                     "p_lease_if_scoped"),
                         (owner, ["http"], call, [None])))
    assert first == sorted((i, False, []) for i in (a, b, c))
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (2, 2)
    drawn = scalar(conn, "SELECT drawn FROM effect_calls WHERE call = %s", (call,))
    assert drawn == {i: ["host:limited.example", "type:http"] for i in (a, b, c)}
    repeat = sorted(query(conn, CLAIM_CHECKED.replace("p_lease_if_scoped", "p_repeat => true, "
                                                      "p_lease_if_scoped"),
                          (owner, ["http"], call, [None])))
    assert repeat == first
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (2, 2)
    # Given back to be marked: refunded, once.
    assert scalar(conn, "SELECT outbox_unclaim(%s, %s::uuid[], %s, false)", (owner, [a], call)) == 1
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (3, 3)
    assert scalar(conn, "SELECT outbox_unclaim(%s, %s::uuid[], %s, false)", (owner, [a], call)) == 0
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (3, 3)
    # Its mark pays for it: one token from each bucket, as one send.
    marked = query(conn, MARK, (owner, [a], str(uuid.uuid4()), None))
    assert [m[2] for m in marked] == [False]
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (2, 2)
    # Released unsent: refunded.
    assert scalar(conn, "SELECT outbox_unclaim(%s, %s::uuid[], %s, true)", (owner, [b, c], call)) == 2
    assert (round(tokens(conn, "limited.example")), round(tokens(conn, "http"))) == (4, 4)
    assert scalar(conn, "SELECT drawn FROM effect_calls WHERE call = %s", (call,)) == {}


def test_two_claims_on_one_bucket_draw_its_tokens_once(conn, db):
    """A claim that draws a bucket's last tokens holds the bucket's row
    until it commits; a second claim meeting the same limit waits for it
    and reads the tokens as that commit left them: short, so it leases (a
    claim reading the tokens of its snapshot would draw them again)."""
    kill_switch(conn, True)
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', 0.01, 2, 'op', 'why')")
    first = add(conn, [("http", "https://limited.example/a"), ("http", "https://limited.example/b")])
    holder = psycopg2.connect(db)
    holder.autocommit = False
    with holder.cursor() as cur:
        cur.execute(CLAIM_CHECKED, (str(uuid.uuid4()), ["http"], str(uuid.uuid4()), [None]))
        assert sorted(r[0] for r in cur.fetchall() if not r[1]) == sorted(first)
    (late,) = add(conn, [("http", "https://limited.example/c")])
    got = []
    other = connect(db)
    t = threading.Thread(target=lambda: got.extend(claim_checked(other, ["http"], [None])))
    t.start()
    wait_for(lambda: lock_waiters(conn, "outbox_claim", event="transactionid") == 1,
             what="the second claim waiting for the bucket")
    holder.commit()
    t.join(10)
    assert not t.is_alive()
    assert got == [(late, True, None)]
    assert round(tokens(conn, "limited.example")) == 0
    holder.close()
    other.close()


def test_a_claim_leaves_to_the_mark_what_a_pause_holds_or_a_limit_deferred(conn):
    """A row a pause may hold (a host in its URL, its CRM object) turns the
    claim into a lease, which parks what it can see is paused; the claim
    then takes the rows behind.  A limit of the row's type is drawn on as a
    host's is.  A row a limit deferred has paid for its slot (the mark lets
    it go without drawing again): the claim leaves it to the mark, even
    with tokens in the bucket."""
    kill_switch(conn, True)
    pause(conn, "host", "paused.example")
    owner = str(uuid.uuid4())
    held, free = add(conn, [("http", "https://paused.example/a"), ("http", "https://api.example/b")])
    assert claim_checked(conn, ["http"], [None], owner) == [(free, True, None)]
    assert live(conn, held)["held_by"] == "host:paused.example"
    pause(conn, "crm_object", "Task")
    task, note = add(conn, [("crm", "Task/Ext__c"), ("crm", "Note/Ext__c")])
    assert claim_checked(conn, ["crm"], ["crm.example"], owner) == [(note, True, None)]
    assert live(conn, task)["held_by"] == "crm_object:task"
    query(conn, "SELECT outbox_release(%s, %s::uuid[], 0)", (owner, [free, note]))
    assert claim_checked(conn, ["crm", "http"], ["crm.example", None]) == sorted(
        [(free, False, ["paused.example"]), (note, False, ["paused.example"])])
    # A type limit: drawn on, then short.
    query(conn, "SELECT outbox_scope_limit('type', 'http', 2, 2, 'op', 'why')")
    two = add(conn, [("http", "https://api.example/1"), ("http", "https://api.example/2")])
    assert claim_checked(conn, ["http"], [None]) == sorted(
        (i, False, ["paused.example"]) for i in two)
    assert tokens(conn, "http") == 0
    (late,) = add(conn, [("http", "https://api.example/3")])
    assert claim_checked(conn, ["http"], [None], owner) == [(late, True, None)]
    mark = query(conn, MARK, (owner, [late], str(uuid.uuid4()), None))
    assert mark[0][2] is True and mark[0][3] == "type:http"     # deferred to its slot
    # Once the bucket has a token again, the deferred row is due: the
    # claim leases it, drawing nothing, for the mark to let it go.
    wait_for(lambda: scalar(conn, "SELECT s.tokens + 2 * extract(epoch FROM now() - s.tokens_at) >= 1 "
                                  "AND l.available_at <= now() FROM outbox_scopes s, effect_live l "
                                  "WHERE s.kind = 'type' AND l.effect_id = %s", (late,)), timeout=10)
    at = scalar(conn, "SELECT tokens_at FROM outbox_scopes WHERE kind = 'type'")
    assert claim_checked(conn, ["http"], [None]) == [(late, True, None)]
    assert scalar(conn, "SELECT tokens_at FROM outbox_scopes WHERE kind = 'type'") == at


def test_a_host_pause_lists_each_send_under_the_host_its_worker_connects_to(conn):
    """The host a send's call recorded decides: an email marked for the
    relay, a CRM record claimed for its instance, an http request by its
    URL.  A pause of one of them lists that one alone, not every send
    whose target has no URL.  A call recorded without hosts (a worker
    built before them) is listed under every host paused."""
    kill_switch(conn, True)
    (mail,) = add(conn, [("email", "someone@example.com")])
    owner = str(uuid.uuid4())
    assert query(conn, LEASE, (owner, 1, ["email"])) == [(mail,)]
    assert query(conn, MARK, (owner, [mail], str(uuid.uuid4()), ["relay.example"]))[0][2] is False
    web, rec = add(conn, [("http", "https://API.example:8443/x"), ("crm", "Task/Ext__c")])
    claimed = query(conn, CLAIM, (str(uuid.uuid4()), ["http", "crm"], str(uuid.uuid4()),
                                  [None, "crm.example"]))
    assert sorted(r[0] for r in claimed) == sorted([web, rec])
    (old,) = add(conn, [("crm", "Task/Ext__c")])
    assert len(query(conn, CLAIM, (str(uuid.uuid4()), ["crm"], str(uuid.uuid4()), None))) == 1
    for host, sends in [("relay.example", [mail]), ("crm.example", [rec]),
                        ("api.example", [web]), ("elsewhere.example", [])]:
        listed = sorted(r[0] for r in pause(conn, "host", host))
        assert listed == sorted(sends + [old]), (host, listed)
        pause(conn, "host", host, paused=False)


@pytest.mark.parametrize("kind", ["global", "type"])
def test_the_in_flight_list_is_exact_when_the_pause_commits(conn, db, kind):
    """A send that finishes while the pause's transaction is open waits for
    its commit (so it was in flight when the pause committed, and is
    listed); one that finished before the pause read the rows is not
    listed, even if its finish committed after the pause's statement began."""
    kill_switch(conn, True)
    ids, owner = sending(conn, [("http", "https://api.example.com/a"),
                                ("http", "https://api.example.com/b")])
    off = ("SELECT effect_id::text FROM outbox_kill_switch_set(false, 'op', 'why')"
           if kind == "global" else
           "SELECT effect_id::text FROM outbox_scope_pause('type', 'http', true, 'op', 'why')")
    # 1. A finish in progress when the pause starts: the pause waits for it
    #    and leaves its row out.
    finisher = connect(db)
    finisher.autocommit = False
    with finisher.cursor() as cur:
        cur.execute("SELECT applied FROM outbox_complete(%s, 'w', %s)", (owner, completed(ids[0])))
        assert cur.fetchall() == [(True,)]
    op = connect(db)
    op.autocommit = False
    listed = []

    def run_pause():
        with op.cursor() as cur:
            cur.execute(off)
            listed.extend(r[0] for r in cur.fetchall())
    t = threading.Thread(target=run_pause)
    t.start()
    wait_for(lambda: lock_waiters(conn, "outbox_scope_pause", "outbox_kill_switch_set") == 1,
             what="the pause waiting for the finish in progress")
    finisher.commit()
    t.join(10)
    assert not t.is_alive()
    assert listed == [ids[1]]
    # 2. A finish of a listed send while the pause is open waits for its
    #    commit: at the commit, the list is what was in flight.
    done = []

    def finish():
        with finisher.cursor() as cur:
            cur.execute("SELECT applied FROM outbox_complete(%s, 'w', %s)",
                        (owner, completed(ids[1])))
            done.extend(cur.fetchall())
        finisher.commit()
    f = threading.Thread(target=finish)
    f.start()
    wait_for(lambda: lock_waiters(conn, "outbox_complete") == 1,
             what="the finish waiting for the pause to commit")
    assert scalar(conn, "SELECT state FROM effect_live WHERE effect_id = %s", (ids[1],)) == "sending"
    op.commit()
    f.join(10)
    assert done == [(True,)]
    finisher.close()
    op.close()


def test_a_worker_built_before_scopes_takes_nothing_it_would_mishandle(conn):
    """Its claim (without p_lease_if_scoped) would send merely leased rows
    as marked: while a scope is set it takes nothing.  Its mark (the
    six-argument form) still holds rows, reading hosts from the targets."""
    kill_switch(conn, True)
    ids = add(conn, [("http", "https://api.example.com/a")])
    query(conn, "SELECT outbox_scope_limit('type', 'http', 1000, 1000, 'op', 'why')")
    owner = str(uuid.uuid4())
    old_claim = ("SELECT count(*) FROM outbox_claim(%s, 'w', 10, 30, '{http}', true, '{}', %s, "
                 "p_max_payload_bytes => 1000000)")
    assert scalar(conn, old_claim, (owner, str(uuid.uuid4()))) == 0
    assert live(conn, ids[0])["lease_owner"] is None
    rows = query(conn, "SELECT effect_id::text, leased_only FROM outbox_claim(%s, 'w', 10, 30, "
                       "'{http}', true, '{}', %s, p_lease_if_scoped => true)",
                 (owner, str(uuid.uuid4())))
    assert rows == [(ids[0], True)] and live(conn, ids[0])["state"] == "pending"
    pause(conn, "host", "api.example.com")
    old_mark = query(conn, "SELECT effect_id::text, blocked FROM outbox_mark_sending(%s, "
                           "%s::uuid[], true, '{}', 30)", (owner, ids))
    assert old_mark == [(ids[0], True)]
    assert live(conn, ids[0])["held_by"] == "host:api.example.com"


def test_a_scope_on_a_type_the_claim_does_not_take_leaves_it_one_statement(conn):
    """A pause or limit of email does not touch an http worker's claim: its
    rows go straight to `sending` (leased_only false); a host scope, which
    only the worker can match, or a scope of its own type makes it a lease."""
    kill_switch(conn, True)
    claim = ("SELECT effect_id::text, leased_only FROM outbox_claim(%s, 'w', 10, 30, %s, true, "
             "'{}', %s, p_lease_if_scoped => true)")
    query(conn, "SELECT outbox_scope_limit('type', 'email', 5, 5, 'op', 'why')")
    query(conn, "SELECT outbox_scope_pause('type', 'crm', true, 'op', 'why')")
    query(conn, "SELECT outbox_scope_pause('crm_object', 'Task', true, 'op', 'why')")
    ids = add(conn, [("http", "https://api.example.com/a")])
    rows = query(conn, claim, (str(uuid.uuid4()), ["http"], str(uuid.uuid4())))
    assert rows == [(ids[0], False)] and live(conn, ids[0])["state"] == "sending"
    # The same scopes meet a claim that takes crm: a lease.
    crm = add(conn, [("crm", "Note/Ext__c")])
    query(conn, "SELECT outbox_scope_pause('type', 'crm', false, 'op', 'why')")
    rows = query(conn, claim, (str(uuid.uuid4()), ["crm"], str(uuid.uuid4())))
    assert rows == [(crm[0], True)]
    # Any host scope: a lease (the worker knows the host it connects to).
    more = add(conn, [("http", "https://other.example/a")])
    query(conn, "SELECT outbox_scope_limit('host', 'api.example.com', 5, 5, 'op', 'why')")
    rows = query(conn, claim, (str(uuid.uuid4()), ["http"], str(uuid.uuid4())))
    assert rows == [(more[0], True)]
