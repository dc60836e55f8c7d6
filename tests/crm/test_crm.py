# SPDX-License-Identifier: ISC
"""The crm provider end to end: real workers (build/outbox-dispatcher with
build/providers/outbox_crm.so) against a local server that follows
Salesforce's upsert-by-external-id and lookup behaviour
(tests/servers/crm_server.py), plus the reconciliation SQL and
`outboxctl reconcile`.

No fixed sleeps: every wait is a condition polled with a deadline.
"""
import json
import signal
import subprocess

import psycopg2
import pytest

from outbox_test import (attempts, run_state as settled_run_state, connect, effect, finish_as, kill_switch, make_run, query,
                         run_ctl, scalar, wait_for)

from crm_server import CrmServer  # noqa: E402

TOKEN = "00Dxx0000001gPL!AQ4AQFakeTokenForTests.9b1d6f"
TARGET = "Task/Outbox_Key__c"
OWNER = "11111111-1111-4111-8111-111111111111"
OTHER = "22222222-2222-4222-8222-222222222222"


# -- fixtures and helpers ---------------------------------------------------

@pytest.fixture
def crm():
    s = CrmServer(token=TOKEN).start()
    yield s
    s.stop()


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "crm_token"
    p.write_text(TOKEN + "\n")
    p.chmod(0o600)
    return p


def crm_config(url, token_file, **extra):
    sec = {"instance_url": url, "access_token": f"file:{token_file}",
           "timeout_ms": 3000, "connect_timeout_ms": 1000,
           "backoff_base_ms": 10, "backoff_cap_ms": 100, "max_attempts": 5}
    sec.update(extra)
    return {"provider.crm": sec, "provider.http": None, "dispatcher": {"providers": "crm"}}


def start_worker(dispatchers, crm, token_file, **extra):
    return dispatchers(crm_config(crm.url, token_file, **extra))


def set_state(conn, eid, state):
    """An effect put in `state` as the test arranges it: an open state on
    its live row (an unknown one never due), a finished one as its live
    row's DELETE with the finishing history row."""
    if state in ("completed", "failed"):
        finish_as(conn, [eid], state)
    else:
        query(conn, "UPDATE effect_live SET state = %s, available_at = CASE WHEN %s = 'unknown' "
                    "THEN 'infinity' WHEN available_at = 'infinity' THEN now() ELSE available_at END "
                    "WHERE effect_id = %s", (state, state, eid))


def set_type(conn, where, args):
    """Effects (chosen by a WHERE on effect_outbox) of another type, as their
    producer would have written them."""
    query(conn, f"UPDATE effect_live SET effect_type = 'email' WHERE effect_id IN "
                f"(SELECT effect_id FROM effect_outbox WHERE {where})", args)
    query(conn, f"UPDATE effect_outbox SET effect_type = 'email' WHERE {where}", args)


def crm_effect(conn, payload, target=TARGET, state=None, attempts_=0):
    """One crm effect on a fresh approved run; returns (effect_id, effect_key).
    A str payload is inserted as written (numbers jansson cannot hold)."""
    run = make_run(conn)
    text = payload if isinstance(payload, str) else json.dumps(payload)
    row = query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                      "VALUES (%s, 'crm', %s, %s) RETURNING effect_id, effect_key",
                (run, target, text))
    if state is not None:
        query(conn, "UPDATE effect_live SET attempts = %s, last_error_class = 'ambiguous', "
                    "last_error = 'arranged by the test' WHERE effect_id = %s", (attempts_, row[0][0]))
        set_state(conn, str(row[0][0]), state)
    # Approved once its effect is in (the approval gate admits effects while processing).
    query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key = %s", (run,))
    return str(row[0][0]), row[0][1]


def wait_state(conn, eid, *states, timeout=30):
    return wait_for(lambda: (lambda e: e if e and e["state"] in states else None)(effect(conn, eid)),
                    timeout=timeout, what=f"effect {eid} in {states} (now {effect(conn, eid)})")


def run_state(conn, eid):
    """The state of the effect's run, settled as a reader gets it."""
    return settled_run_state(conn, scalar(conn, "SELECT idempotency_key FROM effect_outbox "
                                                "WHERE effect_id = %s", (eid,)))


def classes(conn, eid):
    return [(a["outcome_class"], a["provider_status"]) for a in attempts(conn, eid)]


def no_secret_in(worker):
    log = worker.log()
    assert TOKEN not in log, "the access token leaked into the worker's log"
    assert "Bearer" not in log


def ctl(db, *args, timeout=60):
    return run_ctl(["--db", db] + list(args), timeout=timeout)


def wait_registered(conn):
    wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'crm'"),
             what="the crm provider registered as able to reconcile")


# -- sends --------------------------------------------------------------------

def test_upsert_creates_record(conn, dispatchers, crm, token_file):
    kill_switch(conn, True)
    w = start_worker(dispatchers, crm, token_file)
    payload = {"Subject": "Call back about the refund", "Priority": "High", "IsReminderSet": False,
               "ActivityDate": None, "CallDurationInSeconds": 90}
    eid, key = crm_effect(conn, payload)
    e = wait_state(conn, eid, "completed")

    rec = crm.record("Task", "Outbox_Key__c", key)
    assert rec is not None and rec["Outbox_Key__c"] == key
    assert e["provider_id"] == rec["Id"] and rec["Id"].startswith("00T")
    assert e["attempts"] == 1 and e["last_status"] == 201
    assert classes(conn, eid) == [("accepted", 201)]
    assert attempts(conn, eid)[0]["provider_id"] == rec["Id"]
    assert run_state(conn, eid) == "completed"

    (req,) = [r for r in crm.requests if r.ext == key]
    assert req.method == "PATCH"
    assert req.path == f"/services/data/v59.0/sobjects/Task/Outbox_Key__c/{key}"
    assert req.headers["Authorization"] == f"Bearer {TOKEN}"
    assert req.headers["Content-Type"] == "application/json"
    assert json.loads(req.body) == payload
    no_secret_in(w)


def test_numbers_leave_as_the_producer_wrote_them(conn, dispatchers, crm, token_file):
    """The fields are sent as stored, not re-encoded by jansson (which
    holds 19.99 as a double and printed 19.989999999999998, 1.50 as 1.5,
    and refused an integer beyond 64 bits as invalid JSON)."""
    kill_switch(conn, True)
    start_worker(dispatchers, crm, token_file)
    eid, key = crm_effect(conn, '{"Subject": "Refund", "Amount__c": 19.99, "Rate__c": 1.50, '
                                '"Ledger_Id__c": 123456789012345678901234567890}')
    e = wait_state(conn, eid, "completed")
    assert e["attempts"] == 1
    (req,) = [r for r in crm.requests if r.ext == key]
    sent = json.loads(req.body, parse_float=str, parse_int=str)
    assert sent == {"Subject": "Refund", "Amount__c": "19.99", "Rate__c": "1.50",
                    "Ledger_Id__c": "123456789012345678901234567890"}
    assert b" " not in req.body.replace(b'"Refund"', b"")   # compact, as before


def test_upsert_same_key_updates_without_duplicate(conn, dispatchers, crm, token_file):
    """A record that already carries the effect's key (an earlier call got
    through) is updated in place: 200 with its Id, no second record."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "second version"})
    existing = crm.put("Task", "Outbox_Key__c", key, {"Subject": "first version"})
    start_worker(dispatchers, crm, token_file)
    e = wait_state(conn, eid, "completed")
    assert e["provider_id"] == existing and e["last_status"] == 200
    assert len(crm.records_for(key)) == 1
    assert crm.record("Task", "Outbox_Key__c", key)["Subject"] == "second version"
    assert classes(conn, eid) == [("accepted", 200)]


def test_update_answered_204_looks_the_id_up(conn, dispatchers, token_file):
    """Before API v46.0 an update answers 204 with no body: the provider
    asks for the record's Id with one GET."""
    crm = CrmServer(token=TOKEN, update_status=204).start()
    try:
        kill_switch(conn, True)
        eid, key = crm_effect(conn, {"Subject": "x"})
        existing = crm.put("Task", "Outbox_Key__c", key)
        start_worker(dispatchers, crm, token_file)
        e = wait_state(conn, eid, "completed")
        assert e["provider_id"] == existing and e["last_status"] == 204
        assert crm.count(key, "PATCH") == 1 and crm.count(key, "GET") == 1
        get = [r for r in crm.requests if r.method == "GET"][0]
        assert get.path.endswith(f"/Outbox_Key__c/{key}?fields=Id")
    finally:
        crm.stop()


def test_update_204_lookup_failing_keeps_a_local_reference(conn, dispatchers, token_file):
    crm = CrmServer(token=TOKEN, update_status=204).start()
    try:
        kill_switch(conn, True)
        eid, key = crm_effect(conn, {"Subject": "x"})
        crm.put("Task", "Outbox_Key__c", key)
        crm.fault("GET", key, ("status", 500))
        start_worker(dispatchers, crm, token_file)
        e = wait_state(conn, eid, "completed")
        assert e["provider_id"] == f"sf:Task/Outbox_Key__c/{key}"
        assert crm.count(key, "PATCH") == 1
    finally:
        crm.stop()


def test_several_matches_is_terminal(conn, dispatchers, crm, token_file):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.ambiguous[key] = ["00T000000000000AAA", "00T000000000000BBB"]
    start_worker(dispatchers, crm, token_file)
    e = wait_state(conn, eid, "failed")
    assert e["last_status"] == 300 and "several records" in e["last_error"]
    assert classes(conn, eid) == [("terminal", 300)]
    assert crm.count(key, "PATCH") == 1
    assert run_state(conn, eid) == "failed_terminal"


def test_invalid_field_is_terminal_with_salesforce_message(conn, dispatchers, crm, token_file):
    kill_switch(conn, True)
    crm.invalid_fields.add("Bogus__c")
    eid, key = crm_effect(conn, {"Bogus__c": 1})
    start_worker(dispatchers, crm, token_file)
    e = wait_state(conn, eid, "failed")
    assert e["last_status"] == 400
    assert "INVALID_FIELD" in e["last_error"] and "No such column 'Bogus__c'" in e["last_error"]
    assert classes(conn, eid) == [("terminal", 400)]


def test_rejected_token_retries_until_fixed_by_reload(conn, dispatchers, crm, token_file):
    """401: the token expired.  Nothing was written and only an operator can
    fix it, so the effect waits and retries (auth_retry_ms) instead of
    failing; a new token and SIGHUP let it through."""
    kill_switch(conn, True)
    token_file.write_text("00Dxx-expired-token\n")
    w = start_worker(dispatchers, crm, token_file, auth_retry_ms=200, max_attempts=100)
    eid, key = crm_effect(conn, {"Subject": "x"})
    wait_for(lambda: crm.count(key, "PATCH") >= 2, what="two attempts answered 401")
    e = effect(conn, eid)
    assert e["state"] in ("pending", "sending") and e["last_status"] == 401
    assert e["last_error_class"] == "retry" and "INVALID_SESSION_ID" in e["last_error"]
    assert crm.record("Task", "Outbox_Key__c", key) is None
    assert any(ev.get("level") == "warn" and "access token" in json.dumps(ev) for ev in w.events())

    token_file.write_text(TOKEN + "\n")
    w.signal(signal.SIGHUP)
    e = wait_state(conn, eid, "completed")
    assert e["provider_id"] == crm.record("Task", "Outbox_Key__c", key)["Id"]
    cls = classes(conn, eid)
    assert cls[-1] == ("accepted", 201) and set(cls[:-1]) == {("retry", 401)}
    log = w.log()
    assert "expired-token" not in log
    no_secret_in(w)


def test_rejected_token_fails_once_attempts_run_out(conn, dispatchers, crm, token_file):
    kill_switch(conn, True)
    token_file.write_text("wrong\n")
    start_worker(dispatchers, crm, token_file, auth_retry_ms=0, max_attempts=2)
    eid, key = crm_effect(conn, {"Subject": "x"})
    e = wait_state(conn, eid, "failed")
    assert e["attempts"] == 2 and e["last_status"] == 401
    assert classes(conn, eid) == [("retry", 401), ("retry", 401)]


@pytest.mark.parametrize("code,error_code", [(503, None), (429, None), (409, None),
                                             (403, "REQUEST_LIMIT_EXCEEDED"),
                                             (400, "UNABLE_TO_LOCK_ROW")])
def test_retryable_answers_honour_retry_after(conn, dispatchers, crm, token_file, code, error_code):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("status", code, 1, error_code) if error_code else ("status", code, 1))
    start_worker(dispatchers, crm, token_file)
    e = wait_state(conn, eid, "completed")
    first, second = [r for r in crm.requests if r.ext == key]
    assert second.at - first.at >= 0.9, "Retry-After: 1 was not honoured"
    assert classes(conn, eid) == [("retry", code), ("accepted", 201)]
    assert e["attempts"] == 2 and len(crm.records_for(key)) == 1


@pytest.mark.parametrize("seconds", ["9223372036854776", "99999999999999999999"])
def test_huge_retry_after_is_clamped(conn, dispatchers, crm, token_file, seconds):
    """Seconds whose milliseconds overflow a 64-bit long, or beyond long
    itself: the longest wait (retry_after_max_ms), the worker unharmed."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("status", 503, seconds))
    w = start_worker(dispatchers, crm, token_file, retry_after_max_ms=60000)
    wait_for(lambda: classes(conn, eid) == [("retry", 503)], what="the 503 recorded")
    e = wait_state(conn, eid, "pending")
    assert e["attempts"] == 1
    assert scalar(conn, "SELECT available_at > now() + interval '30 s' FROM outbox_effects "
                        "WHERE effect_id = %s", (eid,))
    assert w.proc.poll() is None, w.log()


@pytest.mark.parametrize("code", [500, 502, 504])
def test_server_errors_are_ambiguous_and_retried_with_the_same_key(conn, dispatchers, crm,
                                                                   token_file, code):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("status", code))
    start_worker(dispatchers, crm, token_file)
    wait_state(conn, eid, "completed")
    assert classes(conn, eid) == [("ambiguous", code), ("accepted", 201)]
    paths = {r.path for r in crm.requests if r.ext == key}
    assert len(paths) == 1, "the retry used another external id"


def test_hang_after_storing_is_retried_and_ends_with_one_record(conn, dispatchers, crm, token_file):
    """The server stores the record, then never answers: a timeout after
    the request was sent is ambiguous; the retry with the same key finds
    the record and updates it."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("hang",))
    start_worker(dispatchers, crm, token_file, timeout_ms=1500)
    e = wait_state(conn, eid, "completed")
    cls = classes(conn, eid)
    # On a loaded machine a later attempt may time out too: still the same key.
    assert cls[0] == ("ambiguous", None) and cls[-1] == ("accepted", 200)
    assert set(cls[1:-1]) <= {("ambiguous", None)}
    assert "timed out" in attempts(conn, eid)[0]["error_text"].lower()
    assert crm.count(key, "PATCH") == len(cls)
    assert len({r.path for r in crm.requests if r.ext == key}) == 1
    assert len(crm.records_for(key)) == 1
    assert e["provider_id"] == crm.record("Task", "Outbox_Key__c", key)["Id"]


def test_close_after_body_is_retried_with_the_same_key(conn, dispatchers, crm, token_file):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("close",))
    start_worker(dispatchers, crm, token_file)
    wait_state(conn, eid, "completed")
    assert classes(conn, eid) == [("ambiguous", None), ("accepted", 200)]
    assert len(crm.records_for(key)) == 1


def test_ambiguous_with_attempts_exhausted_goes_unknown_then_reconciles(conn, dispatchers, crm,
                                                                       token_file, db):
    """max_attempts 1 and a hang: unknown (no re-send); the lookup then
    finds the record the hung call stored."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("hang",))
    start_worker(dispatchers, crm, token_file, timeout_ms=500, max_attempts=1)
    wait_state(conn, eid, "unknown")
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stderr
    e = wait_state(conn, eid, "completed")
    assert e["provider_id"] == crm.record("Task", "Outbox_Key__c", key)["Id"]
    assert crm.count(key, "PATCH") == 1
    assert classes(conn, eid) == [("ambiguous", None), ("reconciled_sent", 200)]


def test_stop_with_a_call_in_flight_abandons_it_cleanly(conn, dispatchers, crm, token_file):
    """SIGTERM while the CRM has not answered: after the grace period the
    provider drops the transfer (no done call, nothing leaked) and the
    worker exits 0; the effect stays `sending` for the reaper."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("hang",))
    cfg = crm_config(crm.url, token_file, timeout_ms=60000)
    cfg["dispatcher"]["shutdown_grace_ms"] = 200
    w = dispatchers(cfg)
    wait_for(lambda: crm.count(key, "PATCH") == 1, what="the call in flight")
    assert w.stop() == 0, w.log()
    assert "Sanitizer" not in w.log()
    assert effect(conn, eid)["state"] == "sending"


def test_a_host_pause_lists_a_call_in_flight_under_the_instance_host(conn, dispatchers, crm,
                                                                      token_file):
    """The worker records the instance's host with the CRM call it starts
    (the target, Object/Field, names none): a pause of that host lists the
    call in flight, a pause of another host does not."""
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"})
    crm.fault("PATCH", key, ("hang",))
    cfg = crm_config(crm.url, token_file, timeout_ms=60000)
    cfg["dispatcher"]["shutdown_grace_ms"] = 200
    w = dispatchers(cfg)
    wait_for(lambda: crm.count(key, "PATCH") == 1, what="the call in flight")
    assert query(conn, "SELECT c.hosts FROM effect_calls c WHERE %s::uuid = ANY (c.ids)",
                 (eid,)) == [(["127.0.0.1"],)]
    for host, listed in [("elsewhere.example", []), ("127.0.0.1", [eid])]:
        got = query(conn, "SELECT effect_id::text FROM outbox_scope_pause('host', %s, true, "
                          "'op', 'a test')", (host,))
        assert [r[0] for r in got] == listed, (host, got)
        query(conn, "SELECT outbox_scope_pause('host', %s, false, 'op', 'a test')", (host,))
    assert w.stop() == 0, w.log()


def test_connection_refused_is_not_sent(conn, dispatchers, token_file):
    kill_switch(conn, True)
    # A port nothing listens on: bind, learn it, close.
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dispatchers(crm_config(f"http://127.0.0.1:{port}", token_file, max_attempts=2))
    eid, _ = crm_effect(conn, {"Subject": "x"})
    e = wait_state(conn, eid, "failed")
    assert [c for c, _ in classes(conn, eid)] == ["not_sent", "not_sent"]
    assert e["attempts"] == 2


@pytest.fixture
def tls_cert(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


def test_tls_is_verified(conn, dispatchers, token_file, tls_cert):
    """https to a server whose certificate nobody vouches for: refused
    before any request byte (not_sent); with its CA in ca_file: delivered."""
    crm = CrmServer(token=TOKEN, tls=tls_cert).start()
    try:
        kill_switch(conn, True)
        assert crm.url.startswith("https://")
        # Generous connect timeout: loading the CA store and the handshake
        # can be slow on a loaded machine, and a timeout would hide the
        # verification failure this test is about.
        w = dispatchers(crm_config(crm.url, token_file, max_attempts=1, connect_timeout_ms=15000,
                                   timeout_ms=20000), name="untrusting")
        eid, key = crm_effect(conn, {"Subject": "x"})
        e = wait_state(conn, eid, "failed")
        assert [c for c, _ in classes(conn, eid)] == ["not_sent"]
        assert "certificate" in attempts(conn, eid)[0]["error_text"].lower()
        assert crm.count(key) == 0
        w.stop()

        dispatchers(crm_config(crm.url, token_file, ca_file=tls_cert[0], connect_timeout_ms=15000,
                               timeout_ms=20000), name="trusting")
        eid2, key2 = crm_effect(conn, {"Subject": "y"})
        e = wait_state(conn, eid2, "completed")
        assert e["provider_id"] == crm.record("Task", "Outbox_Key__c", key2)["Id"]
    finally:
        crm.stop()


@pytest.mark.parametrize("target,payload,words", [
    ("Task", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("Task/Outbox_Key__c/x", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("Ta sk/Outbox_Key__c", {"Subject": "x"}, "not an object API name"),
    ("Task/Key;DROP", {"Subject": "x"}, "not a field API name"),
    (TARGET, {"Id": "00T000000000001"}, 'must not set "Id"'),
    (TARGET, {"outbox_key__c": "mine"}, "must not set the external id field"),
    (TARGET, {"Subject": {"nested": 1}}, "must be a string, number, boolean or null"),
    (TARGET, {"Sub ject": "x"}, "not a field API name"),
    (TARGET, [1, 2], "must be a JSON object"),
])
def test_invalid_effects_fail_without_a_call(conn, dispatchers, crm, token_file, target, payload, words):
    kill_switch(conn, True)
    start_worker(dispatchers, crm, token_file)
    eid, key = crm_effect(conn, payload, target=target)
    e = wait_state(conn, eid, "failed")
    assert words in e["last_error"], e
    assert e["attempts"] == 0 and attempts(conn, eid) == []
    assert crm.requests == []


@pytest.mark.parametrize("section,words", [
    ({"instance_url": ""}, "instance_url: required"),
    ({"instance_url": "http://crm.example.com"}, "must be https://"),
    ({"instance_url": "http://127.0.0.1.nip.io"}, "must be https://"),
    ({"instance_url": "ftp://127.0.0.1"}, "must be https://"),
    ({"instance_url": "https://x.my.salesforce.com/services"}, "no path"),
    ({"api_version": "59"}, "api_version: must look like v59.0"),
    ({"access_token": ""}, "access_token: required"),
    ({"access_token": "env:CRM_TOKEN_NOT_SET_ANYWHERE"}, "CRM_TOKEN_NOT_SET_ANYWHERE is not set"),
    ({"ca_file": "/nonexistent/ca.pem"}, "ca_file: cannot read"),
    ({"auth_retry_ms": "soon"}, "auth_retry_ms: must be an integer"),
    ({"no_such_key": "1"}, "no_such_key: unknown key"),
])
def test_bad_config_refuses_to_start(db, tmp_path, token_file, section, words):
    from outbox_test import Dispatcher
    cfg = crm_config("https://example.my.salesforce.com", token_file)
    cfg["provider.crm"].update(section)
    d = Dispatcher(db, tmp_path, cfg)
    d.start(wait_ready=False)
    try:
        rc = d.wait(timeout=30)
    finally:
        d.stop()
    assert rc != 0
    log = d.log()
    assert words in log, log
    assert ".ini:" in log, "the error names the file and line"


# -- reconciliation, end to end ---------------------------------------------

def test_reconcile_finds_the_record(conn, dispatchers, crm, token_file, db):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    rec_id = crm.put("Task", "Outbox_Key__c", key, {"Subject": "x"})
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert eid in r.stdout and "sent: completed" in r.stdout and rec_id in r.stdout
    assert "1 sent (completed), 0 not sent" in r.stdout

    e = effect(conn, eid)
    assert e["state"] == "completed" and e["provider_id"] == rec_id
    assert run_state(conn, eid) == "completed"
    (a,) = attempts(conn, eid)
    assert (a["outcome_class"], a["provider_status"], a["provider_id"], a["attempt"]) == \
        ("reconciled_sent", 200, rec_id, 1)
    assert a["cas_applied"] and a["worker"] == "w1"
    assert crm.count(key, "PATCH") == 0, "reconciliation must never re-send"
    # Finished: out of the live queue (whose row carried the lease and the
    # reconciliation stamp); the verdict's history row finished it.
    assert scalar(conn, "SELECT lease_owner IS NULL FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = %s", (eid,)) == 0


def test_reconcile_not_found_requeues_and_delivers_once(conn, dispatchers, crm, token_file, db):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not sent: pending again with the same key" in r.stdout
    e = wait_state(conn, eid, "completed")
    rec = crm.record("Task", "Outbox_Key__c", key)
    assert e["provider_id"] == rec["Id"]
    assert crm.count(key, "PATCH") == 1 and len(crm.records_for(key)) == 1
    assert classes(conn, eid) == [("reconciled_not_sent", 404), ("accepted", 201)]
    assert [a["attempt"] for a in attempts(conn, eid)] == [1, 2]


def test_reconcile_cannot_tell_leaves_it_unknown(conn, dispatchers, crm, token_file, db):
    kill_switch(conn, True)
    eid, key = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    crm.fault("GET", key, ("status", 500))
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cannot tell: stays unknown" in r.stdout and "UNKNOWN_EXCEPTION" in r.stdout
    e = effect(conn, eid)
    assert e["state"] == "unknown" and e["last_error"] == "arranged by the test"
    assert classes(conn, eid) == [("reconcile_unknown", 500)]
    assert crm.count(key, "PATCH") == 0
    # Asked again on the next request: the answer is now found.
    crm.put("Task", "Outbox_Key__c", key)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_state(conn, eid, "completed")
    assert classes(conn, eid) == [("reconcile_unknown", 500), ("reconciled_sent", 200)]


def test_reconcile_with_a_rejected_token_cannot_tell(conn, dispatchers, crm, token_file, db):
    kill_switch(conn, True)
    token_file.write_text("wrong\n")
    eid, key = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert effect(conn, eid)["state"] == "unknown"
    assert classes(conn, eid) == [("reconcile_unknown", 401)]


def test_reconcile_runs_with_the_kill_switch_off(conn, dispatchers, crm, token_file, db):
    """A lookup is not a send: reconciliation still answers while sends are
    stopped, and a requeued effect then waits for the switch."""
    eid, key = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert effect(conn, eid)["state"] == "pending"
    assert crm.count(key, "PATCH") == 0
    kill_switch(conn, True)
    wait_state(conn, eid, "completed")
    assert crm.count(key, "PATCH") == 1


def test_reconcile_asks_about_more_than_one_batch(conn, dispatchers, crm, token_file, db):
    """An operator's request covers every unknown effect, not just the
    first lease batch (the worker leases 50 at a time)."""
    kill_switch(conn, True)
    ids = [crm_effect(conn, {"Subject": str(i)}, state="unknown", attempts_=1)[0]
           for i in range(120)]
    start_worker(dispatchers, crm, token_file)
    wait_registered(conn)
    r = ctl(db, "reconcile", "--wait", "20")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "0 sent (completed), 120 not sent (pending again)" in r.stdout
    wait_for(lambda: all(effect(conn, i)["state"] == "completed" for i in ids),
             what="every requeued effect delivered")


def test_reconcile_without_a_worker_times_out(conn, db):
    eid, _ = crm_effect(conn, {"Subject": "x"}, state="unknown", attempts_=1)
    query(conn, "INSERT INTO outbox_providers (name, can_reconcile) VALUES ('crm', true), "
                "('email', false)")
    crm_effect(conn, {"Subject": "y"}, state="unknown", attempts_=1)
    set_type(conn, "effect_id <> %s", (eid,))
    r = ctl(db, "reconcile", "--wait", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 unknown effect was not asked" in r.stderr and "worker" in r.stderr
    assert "asked the fleet to reconcile 1 unknown effect" in r.stdout
    assert "1 unknown effect of types that cannot reconcile" in r.stdout
    assert effect(conn, eid)["state"] == "unknown"


def test_reconcile_with_nothing_unknown_returns_at_once(conn, db):
    r = ctl(db, "reconcile", "--wait", "30", timeout=10)
    assert r.returncode == 0, r.stderr
    assert "reconcile 0 unknown effects" in r.stdout


def test_reconcile_sends_the_notification(conn, db):
    listener = connect(db)
    with listener.cursor() as cur:
        cur.execute("LISTEN effect_outbox")
    r = ctl(db, "reconcile", "--wait", "0")
    assert r.returncode == 0, r.stderr

    def got():
        listener.poll()
        return [n.payload for n in listener.notifies]
    assert "reconcile" in wait_for(got, what="NOTIFY effect_outbox 'reconcile'")
    listener.close()


@pytest.mark.parametrize("args", [["--wait", "soon"], ["--wait", "-1"], ["--wait"], ["--now"]])
def test_reconcile_usage_errors(db, args):
    r = ctl(db, "reconcile", *args)
    assert r.returncode == 2, r.stdout + r.stderr


def test_reconcile_database_error(tmp_path):
    r = run_ctl(["--db", "host=127.0.0.1 port=1 connect_timeout=2", "reconcile", "--wait", "1"])
    assert r.returncode == 3 and "cannot connect" in r.stderr


def test_reconcile_help():
    r = run_ctl(["reconcile", "--help"])
    assert r.returncode == 0 and "--wait SECONDS" in r.stdout


# -- reconciliation SQL -----------------------------------------------------

def lease(conn, owner, types=("crm",), limit=10, interval=0, worker="w"):
    return query(conn, "SELECT effect_id::text, effect_key, attempts "
                       "FROM outbox_reconcile_lease(%s, %s, %s, %s, %s)",
                 (owner, worker, list(types), limit, interval))


def record(conn, owner, results, worker="w"):
    return query(conn, "SELECT effect_id::text, applied, state FROM outbox_reconcile_record(%s, %s, %s)",
                 (owner, worker, json.dumps(results)))


def test_sql_lease_only_unknown_of_the_types_once(conn):
    u1, k1 = crm_effect(conn, {}, state="unknown", attempts_=2)
    u2, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    crm_effect(conn, {})                                  # pending: not leased
    crm_effect(conn, {}, state="completed", attempts_=1)  # finished: not leased
    other, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    set_type(conn, "effect_id = %s", (other,))

    got = lease(conn, OWNER)
    assert {r[0] for r in got} == {u1, u2}
    assert (u1, k1, 2) in got
    assert lease(conn, OTHER) == [], "a leased effect is not leased twice"
    row = query(conn, "SELECT lease_owner::text, lease_worker, lease_expires_at > now(), "
                      "lease_expires_at < now() + interval '5 minutes' "
                      "FROM outbox_effects WHERE effect_id = %s", (u1,))[0]
    assert row == (OWNER, "w", True, True)
    # An expired reconcile lease (worker died) can be taken over.
    query(conn, "UPDATE effect_live SET lease_expires_at = now() - interval '1 second' "
                "WHERE effect_id = %s", (u2,))
    assert [r[0] for r in lease(conn, OTHER)] == [u2]


def test_sql_lease_skips_locked_rows(conn, db):
    u1, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    u2, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    other = psycopg2.connect(db)
    try:
        cur = other.cursor()
        cur.execute("SELECT 1 FROM effect_live WHERE effect_id = %s FOR UPDATE", (u1,))
        assert [r[0] for r in lease(conn, OWNER)] == [u2]
    finally:
        other.rollback()
        other.close()


def test_sql_lease_respects_the_interval(conn):
    u1, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    u2, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    query(conn, "UPDATE effect_live SET last_reconciled_at = now() - interval '30 seconds' "
                "WHERE effect_id = %s", (u1,))
    assert [r[0] for r in lease(conn, OWNER, interval=60)] == [u2]
    query(conn, "UPDATE effect_live SET lease_owner = NULL, lease_expires_at = NULL")
    # An interval shorter than the floor (60 s) is the floor: an effect
    # asked 30 s ago is asked again sooner only after an operator's request.
    assert [r[0] for r in lease(conn, OWNER, interval=0)] == [u2]
    query(conn, "UPDATE effect_live SET lease_owner = NULL, lease_expires_at = NULL, "
                "last_reconciled_at = now() - interval '30 seconds'")
    query(conn, "UPDATE effect_live SET last_reconciled_at = now() - interval '20 seconds' "
                "WHERE effect_id = %s", (u2,))
    assert lease(conn, OWNER, interval=0) == []
    query(conn, "SELECT outbox_request_reconcile()")
    # Least recently asked first; limit honoured.
    assert [r[0] for r in lease(conn, OWNER, interval=0, limit=1)] == [u1]
    assert [r[0] for r in lease(conn, OWNER, interval=0, limit=1)] == [u2]
    assert lease(conn, OTHER, limit=0) == []


def test_sql_record_every_verdict(conn):
    sent, _ = crm_effect(conn, {}, state="unknown", attempts_=3)
    not_sent, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    cannot, _ = crm_effect(conn, {}, state="unknown", attempts_=2)
    lease(conn, OWNER)
    listener = connect(conn.dsn)
    with listener.cursor() as cur:
        cur.execute("LISTEN effect_outbox")
    out = record(conn, OWNER, [
        {"effect_id": sent, "verdict": "sent", "provider_id": "00T000000000042", "status": 200},
        {"effect_id": not_sent, "verdict": "not_sent", "status": 404, "error": "HTTP 404 NOT_FOUND"},
        {"effect_id": cannot, "verdict": "unknown", "error": "timeout"},
    ])
    assert out == [(sent, True, "completed"), (not_sent, True, "pending"), (cannot, True, "unknown")]

    e = effect(conn, sent)
    assert (e["state"], e["provider_id"], e["attempts"]) == ("completed", "00T000000000042", 3)
    assert run_state(conn, sent) == "completed"
    e = effect(conn, not_sent)
    assert (e["state"], e["attempts"]) == ("pending", 1)
    assert scalar(conn, "SELECT available_at <= now() FROM outbox_effects WHERE effect_id = %s",
                  (not_sent,))
    assert run_state(conn, not_sent) == "approved"
    e = effect(conn, cannot)
    assert e["state"] == "unknown" and e["last_error"] == "arranged by the test"
    for eid in (not_sent, cannot):
        assert scalar(conn, "SELECT lease_owner IS NULL AND lease_expires_at IS NULL "
                            "AND last_reconciled_at IS NOT NULL FROM outbox_effects "
                            "WHERE effect_id = %s", (eid,))
    # The sent one is finished: its live row (lease, stamp) is gone.
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = %s", (sent,)) == 0
    assert [(a["attempt"], a["outcome_class"], a["provider_status"], a["provider_id"],
             a["error_text"], a["cas_applied"]) for a in
            attempts(conn, sent) + attempts(conn, not_sent) + attempts(conn, cannot)] == [
        (3, "reconciled_sent", 200, "00T000000000042", None, True),
        (1, "reconciled_not_sent", 404, None, "HTTP 404 NOT_FOUND", True),
        (2, "reconcile_unknown", None, None, "timeout", True),
    ]
    wait_for(lambda: (listener.poll(), listener.notifies)[1], what="workers woken for the requeue")
    listener.close()


def test_sql_record_needs_the_lease(conn):
    """CAS on (unknown, owner): an answer from a worker that does not hold
    the lease changes nothing and is not logged (evidence comes only from
    the lease holder); the holder's answer about an effect whose state
    moved meanwhile changes nothing but is logged."""
    eid, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    lease(conn, OWNER)
    assert record(conn, OTHER, [{"effect_id": eid, "verdict": "sent", "provider_id": "X"}]) == \
        [(eid, False, None)]
    assert effect(conn, eid)["state"] == "unknown"
    set_state(conn, eid, "pending")
    assert record(conn, OWNER, [{"effect_id": eid, "verdict": "not_sent"}]) == [(eid, False, None)]
    assert effect(conn, eid)["state"] == "pending"
    assert [(a["outcome_class"], a["cas_applied"]) for a in attempts(conn, eid)] == \
        [("reconciled_not_sent", False)]
    # Same worker asking twice about one attempt: two evidence rows.
    set_state(conn, eid, "unknown")
    for _ in range(2):
        query(conn, "SELECT outbox_request_reconcile()")   # asked again at once
        lease(conn, OWNER)
        assert record(conn, OWNER, [{"effect_id": eid, "verdict": "unknown"}]) == \
            [(eid, True, "unknown")]
    assert len(attempts(conn, eid)) == 3


def test_sql_record_refuses_bad_input(conn):
    eid, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    lease(conn, OWNER)
    for bad in ([{"effect_id": eid, "verdict": "maybe"}], [{"effect_id": eid}],
                [{"verdict": "sent"}], {"effect_id": eid}):
        with pytest.raises(psycopg2.Error) as ei:
            record(conn, OWNER, bad)
        assert ei.value.pgcode == "22023"
    assert attempts(conn, eid) == [] and effect(conn, eid)["state"] == "unknown"


def test_sql_roles(conn):
    eid, _ = crm_effect(conn, {}, state="unknown", attempts_=1)
    with conn.cursor() as cur:
        cur.execute("SET ROLE outbox_dispatcher")
        cur.execute("SELECT count(*) FROM outbox_reconcile_lease(%s, 'w', '{crm}', 5, 0)", (OWNER,))
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT applied FROM outbox_reconcile_record(%s, 'w', %s)",
                    (OWNER, json.dumps([{"effect_id": eid, "verdict": "unknown"}])))
        assert cur.fetchone()[0] is True
        cur.execute("RESET ROLE")
        cur.execute("SET ROLE outbox_producer")
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            cur.execute("SELECT * FROM outbox_reconcile_lease(%s, 'w', '{crm}', 5, 0)", (OWNER,))
    with conn.cursor() as cur:
        cur.execute("RESET ROLE")
        cur.execute("SET ROLE outbox_producer")
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            cur.execute("SELECT * FROM outbox_reconcile_record(%s, 'w', '[]')", (OWNER,))
    with conn.cursor() as cur:
        cur.execute("RESET ROLE")
        for fn in ("outbox_reconcile_lease(uuid, text, text[], integer, integer)",
                   "outbox_reconcile_record(uuid, text, jsonb)"):
            cur.execute("SELECT has_function_privilege('outbox_operator', %s, 'EXECUTE'), "
                        "EXISTS (SELECT 1 FROM pg_proc p, aclexplode(p.proacl) a "
                        "         WHERE p.oid = %s::regprocedure AND a.grantee = 0), "
                        "(SELECT prosecdef FROM pg_proc WHERE oid = %s::regprocedure)",
                        (fn, fn, fn))
            assert cur.fetchone() == (True, False, True), fn
