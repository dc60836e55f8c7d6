# SPDX-License-Identifier: ISC
"""`unknown` effects resolved from evidence (outbox_complete, providers/lib/http_lookup.c):

- late acceptance: a worker stopped past its lease, whose provider's 2xx
  arrives after the reaper made the effect `unknown` -> completed with the
  provider's id, sent once;
- late proof of not sending: a worker whose `sending` confirmation came
  back too late sends nothing -> the effect goes back to `pending` with the
  same key and is sent once;
- asking the provider: the http provider's lookup (reconcile_url) finds a
  request the server took but never answered -> completed; finds nothing
  for a request the server never read -> pending after the minimum age,
  then sent once; a lookup that errors or times out -> stays unknown.

Plus the SQL rules that make it safe: only the attempt's own lease owner,
only that attempt, only accepted / not_sent; a repeated batch is answered
the same way; a stranger's outcome leaves no row.

Real workers, real PostgreSQL, the real sink (tests/servers/http_sink.py).
No fixed sleeps: every wait is a condition with a deadline.
"""
import json
import signal
import uuid

import pytest

from effect_arrange import arrange
from outbox_test import (effect, enqueue, free_port, kill_switch, query, run_ctl, scalar,
                         unknown_resolved, wait_for)

OWNER = "11111111-1111-4111-8111-111111111111"
OTHER = "22222222-2222-4222-8222-222222222222"


def wait_state(conn, eid, *states, timeout=30):
    return wait_for(lambda: (lambda e: e if e and e["state"] in states else None)(effect(conn, eid)),
                    timeout=timeout, what=f"effect {eid} in {states} (now {effect(conn, eid)})")


def key_of(conn, eid):
    return scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))


def rows(conn, eid):
    return query(conn, "SELECT attempt, outcome_class, cas_applied, resolution, "
                       "worker LIKE 'reaper:%%' FROM effect_attempts WHERE effect_id = %s "
                       "ORDER BY attempt_id", (eid,))


def reap_when_expired(conn, eid):
    """The reaper's own function, once the effect's lease has expired."""
    wait_for(lambda: scalar(conn, "SELECT send_deadline < now() FROM outbox_effects "
                                  "WHERE effect_id = %s", (eid,)),
             timeout=30, what="the stopped worker's lease to expire")
    got = query(conn, "SELECT effect_id::text, state FROM outbox_reap('test-reaper', 10)")
    assert (eid, "unknown") in got, got


# -- late acceptance ----------------------------------------------------------

def test_late_acceptance_completes_with_the_providers_id(conn, dispatchers, sink):
    """SIGSTOP while the sink holds the answer; the reaper makes it unknown;
    SIGCONT: the 2xx arrives and completes the effect, sent once."""
    kill_switch(conn, True)
    port = free_port()
    w = dispatchers({"dispatcher": {"lease_seconds": 4},
                     "metrics": {"listen": f"127.0.0.1:{port}"},
                     "provider.http": {"timeout_ms": 60000}})
    eid = str(enqueue(conn, "http", f"{sink.url}/delay/3000", {"body": {"n": 1}}))
    key = key_of(conn, eid)
    wait_for(lambda: sink.count(key) == 1, what="the sink to take the request")
    w.signal(signal.SIGSTOP)
    try:
        reap_when_expired(conn, eid)
        assert effect(conn, eid)["state"] == "unknown"
        # The sink answers while the worker is stopped; the answer waits in
        # the socket.
        wait_for(lambda: sink.processed(key) == 1, what="the sink to process it")
    finally:
        w.signal(signal.SIGCONT)
    e = wait_state(conn, eid, "completed")
    assert e["provider_id"] == sink.taken[key][0]
    assert sink.count(key) == 1 and sink.processed(key) == 1
    assert rows(conn, eid) == [(1, "ambiguous", True, None, True),
                               (1, "accepted", True, "late_accepted", False)]
    # The run, as a reader gets it (settled from its effects first).
    query(conn, "SELECT outbox_settle_runs(ARRAY(SELECT idempotency_key FROM effect_outbox "
                "WHERE effect_id = %s))", (eid,))
    assert scalar(conn, "SELECT w.state FROM workflow_runs w JOIN effect_outbox b "
                        "ON b.idempotency_key = w.idempotency_key WHERE b.effect_id = %s",
                  (eid,)) == "completed"
    wait_for(lambda: unknown_resolved(port, "late_accepted") == 1, what="the late_accepted counter")
    assert any(ev.get("event") == "unknown_resolved" and ev.get("how") == "late_accepted"
               for ev in w.events())


# -- late proof of not sending ------------------------------------------------

# The `sending` transition waits for a lock the test holds, so that the
# test can stop the worker while its statement is in the server, then let
# the statement commit: no race against a sleep.
HELD_MARK_LOCK = 3442
HELD_MARK = f"""
CREATE FUNCTION test_held_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state = 'pending' AND NEW.state = 'sending' THEN
        PERFORM pg_advisory_xact_lock_shared({HELD_MARK_LOCK});
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER test_held_mark BEFORE UPDATE ON effect_live
    FOR EACH ROW EXECUTE FUNCTION test_held_mark();
"""


@pytest.mark.parametrize("claim,statement", [(False, "outbox_mark_sending("),
                                             (True, "outbox_claim(")], ids=["mark", "claim"])
def test_mark_confirmed_too_late_goes_back_to_pending_and_is_sent_once(conn, dispatchers, sink,
                                                                        claim, statement):
    """The worker is stopped while its `sending` transition commits (the
    mark, or the claim that leases and marks in one); the reaper makes it
    unknown; resumed, the worker reads a confirmation too late to act on,
    sends nothing and records not sent: back to pending, then sent once."""
    kill_switch(conn, True)
    query(conn, HELD_MARK)
    scalar(conn, "SELECT pg_advisory_lock(%s)", (HELD_MARK_LOCK,))
    port = free_port()
    w = dispatchers({"dispatcher": {"lease_seconds": 4, "claim": claim},
                     "metrics": {"listen": f"127.0.0.1:{port}"}})
    eid = str(enqueue(conn, "http", f"{sink.url}/ok", {"body": {"n": 2}}))
    key = key_of(conn, eid)
    try:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                                      "'Lock' AND wait_event = 'advisory' "
                                      "AND datname = current_database() AND query LIKE %s",
                                (f"%{statement}%",)),
                 what="the worker's sending transition waiting for the test's lock")
        w.signal(signal.SIGSTOP)
        scalar(conn, "SELECT pg_advisory_unlock(%s)", (HELD_MARK_LOCK,))
        wait_for(lambda: effect(conn, eid)["state"] == "sending",
                 what="the sending transition to commit while the worker is stopped")
        query(conn, "DROP TRIGGER test_held_mark ON effect_live")
        reap_when_expired(conn, eid)
        assert sink.count(key) == 0
    finally:
        scalar(conn, "SELECT pg_advisory_unlock_all()")
        w.signal(signal.SIGCONT)
    e = wait_state(conn, eid, "completed")
    assert sink.count(key) == 1 and sink.processed(key) == 1
    assert e["attempts"] == 2
    got = rows(conn, eid)
    assert got[:2] == [(1, "ambiguous", True, None, True),
                       (1, "not_sent", True, "late_not_sent", False)], got
    assert got[2] == (2, "accepted", True, None, False), got
    err = scalar(conn, "SELECT error_text FROM effect_attempts WHERE effect_id = %s "
                       "AND outcome_class = 'not_sent'", (eid,))
    assert "confirmed too late" in err
    wait_for(lambda: unknown_resolved(port, "late_not_sent") == 1, what="the late_not_sent counter")


# -- asking the provider (http lookup) ----------------------------------------

def lookup_cfg(sink, url="{origin}/lookup?key={key}", **extra):
    sec = {"timeout_ms": 800, "reconcile_url": url, "reconcile_targets": sink.url + "/",
           "reconcile_min_age_seconds": 3, "reconcile_timeout_ms": 1000}
    sec.update(extra)
    return {"provider.http": sec}


def unknown_effect(conn, sink, path):
    eid = str(enqueue(conn, "http", f"{sink.url}{path}", {"body": {"p": path}}))
    wait_state(conn, eid, "unknown")
    return eid, key_of(conn, eid)


def reconcile(db):
    r = run_ctl(["--db", db, "reconcile", "--wait", "30"])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def wait_http_registered(conn):
    wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'http'"),
             what="http registered as able to reconcile")


def test_lookup_finds_a_request_the_server_took_but_never_answered(conn, dispatchers, sink, db):
    kill_switch(conn, True)
    port = free_port()
    dispatchers({**lookup_cfg(sink), "metrics": {"listen": f"127.0.0.1:{port}"}})
    wait_http_registered(conn)
    eid, key = unknown_effect(conn, sink, "/hang")
    out = reconcile(db)
    assert "sent: completed" in out, out
    e = wait_state(conn, eid, "completed")
    assert e["provider_id"] == sink.taken[key][0]
    assert sink.count(key) == 1, "the lookup never re-sends"
    classes = [r[1] for r in rows(conn, eid)]
    assert classes == ["ambiguous", "reconciled_sent"], classes
    lookups = [r for r in sink.received() if r["path"] == "/lookup"]
    assert lookups and lookups[0]["method"] == "GET" and lookups[0]["key"] is None
    wait_for(lambda: unknown_resolved(port, "lookup_sent") == 1, what="the lookup_sent counter")


def test_lookup_not_found_requeues_only_after_the_minimum_age(conn, dispatchers, sink, db):
    kill_switch(conn, True)
    dispatchers(lookup_cfg(sink))
    wait_http_registered(conn)
    eid, key = unknown_effect(conn, sink, "/drop-unread/1")
    assert sink.processed(key) == 0
    # At once: not found, but too young to be definitive.
    age = scalar(conn, "SELECT extract(epoch FROM now() - max(started_at)) FROM effect_attempts "
                       "WHERE effect_id = %s", (eid,))
    if age < 2.5:
        out = reconcile(db)
        assert "cannot tell" in out and "reconcile_min_age_seconds" in out, out
        assert effect(conn, eid)["state"] == "unknown"
    wait_for(lambda: scalar(conn, "SELECT now() - max(started_at) > interval '3.2 s' "
                                  "FROM effect_attempts WHERE effect_id = %s", (eid,)),
             what="the minimum age")
    out = reconcile(db)
    assert "not sent: pending again" in out, out
    e = wait_state(conn, eid, "completed")
    assert sink.processed(key) == 1 and sink.count(key) == 2
    assert e["provider_id"] == sink.taken[key][0]
    classes = [r[1] for r in rows(conn, eid)]
    assert classes[0] == "ambiguous" and classes[-2:] == ["reconciled_not_sent", "accepted"], classes


@pytest.mark.parametrize("url,words", [
    ("{origin}/status/500?key={key}", "neither found nor not found"),
    ("{origin}/hang?key={key}", "lookup failed"),
    ("{origin}/status/200?key={key}", "without a provider id"),
])
def test_lookup_that_errors_or_times_out_leaves_it_unknown(conn, dispatchers, sink, db, url, words):
    kill_switch(conn, True)
    dispatchers(lookup_cfg(sink, url=url, reconcile_id_json="/missing"))
    wait_http_registered(conn)
    eid, key = unknown_effect(conn, sink, "/hang")
    out = reconcile(db)
    assert "cannot tell: stays unknown" in out and words in out, out
    assert effect(conn, eid)["state"] == "unknown"
    assert sink.count(key) == 1
    assert [r[1] for r in rows(conn, eid)] == ["ambiguous", "reconcile_unknown"]


def test_no_lookup_configured_leaves_http_unknowns_alone(conn, dispatchers, sink, db):
    """Off by default: http effects are not even leased for reconciliation."""
    kill_switch(conn, True)
    dispatchers({"provider.http": {"timeout_ms": 800}})
    eid, key = unknown_effect(conn, sink, "/hang")
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_providers WHERE name = 'http'"),
             what="registration")
    assert scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'http'") is False
    r = run_ctl(["--db", db, "reconcile", "--wait", "0"])
    assert [x[1] for x in rows(conn, eid)] == ["ambiguous"], r.stdout


@pytest.mark.parametrize("extra,words", [
    ({"reconcile_targets": ""}, "reconcile_targets"),
    ({"reconcile_found_status": "200,abc"}, "reconcile_found_status"),
    ({"reconcile_not_found_status": "200"}, "both found and not found"),
    ({"reconcile_id_json": "id"}, "JSON pointer"),
    ({"reconcile_id_json": ""}, "reconcile_id_header"),
    ({"reconcile_method": "get"}, "reconcile_method"),
    ({"reconcile_url": "ftp://x/{key}"}, "reconcile_url"),
])
def test_lookup_config_errors_name_the_key(db, tmp_path, sink, extra, words):
    from outbox_test import Dispatcher
    d = Dispatcher(db, tmp_path, lookup_cfg(sink, **extra))
    d.start(wait_ready=False)
    try:
        rc = d.wait(timeout=30)
    finally:
        d.stop()
    assert rc != 0
    assert words in d.log() and ".ini:" in d.log(), d.log()


# -- the SQL rules --------------------------------------------------------------

def sending_effect(conn, owner=OWNER):
    """An http effect in `sending`, attempt 1, leased by owner."""
    eid = str(enqueue(conn, "http", "https://x.example/h", {"body": {}}))
    arrange(conn, eid, "sending", attempts=1, lease_owner=owner, lease_worker="w",
            leased_at="SQL:now()", sending_since="SQL:now()",
            lease_expires_at="SQL:now() - interval '1 s'")
    return eid


def complete(conn, owner, eid, outcome, next_state, attempt=1, provider_id=None):
    res = [{"effect_id": eid, "attempt": attempt, "outcome": outcome, "next_state": next_state,
            "retry_delay_ms": 0, "provider_id": provider_id, "status": 200}]
    return query(conn, "SELECT applied, state, resolved FROM outbox_complete(%s, 'w', %s)",
                 (owner, json.dumps(res)))[0]


def test_sql_late_outcomes_resolve_only_their_own_attempt(conn):
    reaped = [sending_effect(conn) for _ in range(5)]
    got = dict(query(conn, "SELECT effect_id::text, state FROM outbox_reap('r', 10)"))
    assert all(got[e] == "unknown" for e in reaped)
    a, b, c, d, f = reaped
    # accepted: completed, with the id; repeated batch: the same answer.
    assert complete(conn, OWNER, a, "accepted", "completed", provider_id="p-1") == \
        (True, "completed", "late_accepted")
    assert complete(conn, OWNER, a, "accepted", "completed", provider_id="p-1") == \
        (True, "completed", "late_accepted")
    assert effect(conn, a)["provider_id"] == "p-1"
    # not_sent: pending, same key, workers woken.
    assert complete(conn, OWNER, b, "not_sent", "pending") == (True, "pending", "late_not_sent")
    assert effect(conn, b)["state"] == "pending"
    # ambiguous (and retry, terminal): no evidence, stays unknown, logged.
    assert complete(conn, OWNER, c, "ambiguous", "unknown") == (False, None, None)
    assert complete(conn, OWNER, c, "terminal", "failed") == (False, None, None)
    assert effect(conn, c)["state"] == "unknown"
    # another owner: not its attempt; nothing changes and nothing is logged.
    assert complete(conn, OTHER, d, "accepted", "completed", provider_id="p-x") == (False, None, None)
    assert effect(conn, d)["state"] == "unknown"
    assert [r[1] for r in rows(conn, d)] == ["ambiguous"]
    # another attempt (an operator requeued it and it was sent again): no.
    query(conn, "UPDATE effect_live SET attempts = 2 WHERE effect_id = %s", (f,))
    assert complete(conn, OWNER, f, "accepted", "completed") == (False, None, None)
    assert effect(conn, f)["state"] == "unknown"
    # every resolution row says how; the ambiguous one says nothing.
    assert rows(conn, a) == [(1, "ambiguous", True, None, True),
                             (1, "accepted", True, "late_accepted", False)]
    assert rows(conn, c)[1:] == [(1, "ambiguous", False, None, False)]


def test_sql_a_stranger_leaves_no_attempt_row(conn):
    eid = sending_effect(conn)
    assert complete(conn, OTHER, eid, "accepted", "completed") == (False, None, None)
    assert rows(conn, eid) == []
    assert complete(conn, str(uuid.uuid4()), str(uuid.uuid4()), "accepted", "completed") == \
        (False, None, None)
    # the owner itself is recorded and applied as before.
    assert complete(conn, OWNER, eid, "accepted", "completed", provider_id="p") == \
        (True, "completed", None)


# -- who may ask for a pass ---------------------------------------------------------

def test_a_flood_of_notifications_from_any_login_asks_the_provider_nothing(conn, dispatchers, sink,
                                                                          db, login_as):
    """NOTIFY needs no privilege, and 'reconcile' was what `outboxctl
    reconcile` sent: a producer sending it every 5 ms made 2,389 lookups in
    10 s, each carrying the lookup's credential.  A notification is a
    wake-up now: a request is a row only operators write
    (outbox_request_reconcile), and an effect asked within the last minute
    is asked again only after one.  Two seconds of a producer login's
    notifications ask the provider nothing; the operator's request that
    follows asks it once."""
    import time

    import psycopg2
    kill_switch(conn, True)
    dispatchers(lookup_cfg(sink, url="{origin}/status/500?key={key}"))
    wait_http_registered(conn)
    eid, _ = unknown_effect(conn, sink, "/hang")
    assert "cannot tell" in reconcile(db)
    asked = sink.count(path_prefix="/status/500")
    assert asked >= 1

    p = login_as("outbox_producer")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(p, "SELECT outbox_request_reconcile()")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(p, "UPDATE outbox_reconcile_requests SET requested_at = now()")
    d = login_as("outbox_dispatcher")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(d, "SELECT outbox_request_reconcile()")
    sent, end = 0, time.monotonic() + 2.0
    while time.monotonic() < end:
        query(p, "SELECT pg_notify('effect_outbox', 'reconcile')")
        sent += 1
    assert sent > 200, sent
    # The operator's request comes after every one of them: once it has
    # been served, so have they.
    assert "cannot tell" in reconcile(db)
    assert sink.count(path_prefix="/status/500") == asked + 1, (sent, asked)
    assert effect(conn, eid)["state"] == "unknown"
