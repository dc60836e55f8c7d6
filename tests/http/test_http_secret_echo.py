# SPDX-License-Identifier: ISC
"""A peer that echoes the credential it was sent cannot hand it back to
the producer: nothing the worker stores (provider_id, last_error, the
attempts, effect_history) or logs carries a secret's value, whatever the
provider answers.

- A payload header may name a secret ({"secret": NAME}) only where no
  answer is read from (X-Request-Id, Location, the configured
  provider_id_header) and never in a hop-by-hop or framing header: such a
  row fails before any attempt, with its reason, and nothing is sent.
- An API that echoes every header (as many routers do), its JSON id, a
  401 body quoting the Authorization line, a Basic credential quoted
  decoded ("user:pass"): every spelling is replaced by "[secret]".
- The same for the config's own secrets: a Salesforce 401 that quotes the
  crm access token it refused.

The peers are real loopback servers (tests/servers/http_sink.py's /echo,
crm_server.py with quote_auth).
"""
import base64

import pytest

from outbox_test import enqueue, final, kill_switch, query, scalar, wait_for

SECRET = "tok-5e1c2b-echoed-back"
BASIC_PASS = "hunter2-basic-pass"
BASIC = base64.b64encode(f"svc-user:{BASIC_PASS}".encode()).decode()


@pytest.fixture
def creds(tmp_path):
    d = tmp_path / "creds"
    d.mkdir()
    (d / "api_token").write_text(SECRET + "\n")
    (d / "basic").write_text(BASIC + "\n")
    return d


def config(creds, sink, **http):
    sec = {"secrets_dir": str(creds),
           "secrets": f"api_token={sink.url}/; basic={sink.url}/",
           "max_attempts": 1}
    sec.update(http)
    return {"provider.http": sec}


def stored(conn, eid):
    """Everything the database keeps of the effect, as text."""
    parts = [scalar(conn, "SELECT coalesce(row_to_json(o)::text, '') FROM outbox_effects o "
                          "WHERE effect_id = %s", (eid,)),
             scalar(conn, "SELECT coalesce(string_agg(row_to_json(a)::text, ''), '') "
                          "FROM effect_attempts a WHERE effect_id = %s", (eid,)),
             scalar(conn, "SELECT coalesce(string_agg(row_to_json(h)::text, ''), '') "
                          "FROM effect_history h WHERE effect_id = %s", (eid,))]
    return "".join(p or "" for p in parts)


def assert_clean(conn, eid, worker, *values):
    text = stored(conn, eid)
    log = worker.log()
    for v in values:
        assert v not in text, (v, text)
        assert v not in log, (v, log)


@pytest.mark.parametrize("header", ["X-Request-Id", "x-request-id", "Location", "Content-Location",
                                    "X-My-Id", "Content-Type", "Connection", "Keep-Alive",
                                    "TE", "Upgrade", "Trailer", "Proxy-Authorization",
                                    "Transfer-Encoding", "Traceparent", "X-Forwarded-For"])
def test_secret_under_an_answer_or_framing_header_is_refused(conn, dispatchers, sink, creds,
                                                             header):
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink, provider_id_header="X-My-Id"))
    eid = str(enqueue(conn, "http", f"{sink.url}/echo/200",
                      {"headers": {header: {"secret": "api_token"}}, "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed", e
    assert header in e["last_error"], e
    assert ("may not name a secret" in e["last_error"]
            or "is set by the dispatcher" in e["last_error"]), e
    assert sink.count() == 0
    assert_clean(conn, eid, w, SECRET)


def test_echoed_secret_in_the_json_id_is_scrubbed(conn, dispatchers, sink, creds):
    """The provider id comes from the JSON "id" the API echoed (the value of
    X-Api-Key); the echoed headers carry it too."""
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink))
    eid = str(enqueue(conn, "http", f"{sink.url}/echo/200?id=X-Api-Key",
                      {"headers": {"X-Api-Key": {"secret": "api_token"},
                                   "Authorization": {"secret": "api_token", "prefix": "Bearer "}},
                       "body": {"n": 1}}))
    e = final(conn, eid)
    assert e["state"] == "completed", e
    got = sink.received()[0]["headers"]
    assert got["x-api-key"] == SECRET and got["authorization"] == f"Bearer {SECRET}"
    assert e["provider_id"] == "[secret]", e
    assert_clean(conn, eid, w, SECRET)


def test_401_quoting_the_bearer_credential_is_scrubbed(conn, dispatchers, sink, creds):
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink))
    eid = str(enqueue(conn, "http", f"{sink.url}/echo/401?quote=Authorization",
                      {"headers": {"Authorization": {"secret": "api_token", "prefix": "Bearer "}},
                       "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed", e
    assert "HTTP 401" in e["last_error"] and "rejected credential Bearer [secret]" in e["last_error"], e
    assert_clean(conn, eid, w, SECRET)


def test_401_quoting_a_basic_credential_decoded_is_scrubbed(conn, dispatchers, sink, creds):
    """A Basic credential (base64 of user:pass) quoted as sent, and decoded."""
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink))
    eid = str(enqueue(conn, "http", f"{sink.url}/echo/403?decode=Authorization",
                      {"headers": {"Authorization": {"secret": "basic", "prefix": "Basic "}},
                       "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed", e
    assert "HTTP 403" in e["last_error"] and "rejected user [secret]" in e["last_error"], e
    assert_clean(conn, eid, w, BASIC, BASIC_PASS)


def test_a_secret_cut_by_the_error_excerpt_leaves_no_part(conn, dispatchers, sink, creds):
    """The error keeps 200 bytes of the body: padding puts the secret across
    that edge, and the part before the cut is not kept either."""
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink))
    # The body starts {"headers": {"Idempotency-Key"...: padding the first
    # header moves the quoted credential over the 200th byte in one of the
    # lengths tried.
    eids = []
    for pad in range(60, 130, 3):
        eids.append(str(enqueue(conn, "http", f"{sink.url}/echo/400",
                                {"headers": {"A": "x" * pad,
                                             "B": {"secret": "api_token"}}, "body": {}})))
    for eid in eids:
        e = final(conn, eid)
        assert e["state"] == "failed", e
        assert SECRET[:6] not in e["last_error"], e
        assert_clean(conn, eid, w, SECRET[:6])


def test_a_secret_cut_by_max_response_bytes_leaves_no_part(conn, dispatchers, sink, creds):
    """The body kept is cut at max_response_bytes (150 here) with the secret
    across the cut at 20 offsets: the part before the cut is not kept."""
    kill_switch(conn, True)
    w = dispatchers(config(creds, sink, max_response_bytes=150))
    eids = [str(enqueue(conn, "http", f"{sink.url}/echo/400",
                        {"headers": {"A": "x" * pad, "B": {"secret": "api_token"}}, "body": {}}))
            for pad in range(10, 70, 3)]
    for eid in eids:
        e = final(conn, eid)
        assert e["state"] == "failed" and "HTTP 400" in e["last_error"], e
        assert_clean(conn, eid, w, SECRET[:4])


def test_crm_401_quoting_the_access_token_is_scrubbed(conn, dispatchers, tmp_path):
    from crm_server import CrmServer
    token = "00Dcrm-access-token-quoted-back"
    srv = CrmServer(token="the-right-one").start()
    srv.quote_auth = True
    try:
        tf = tmp_path / "crm_token"
        tf.write_text(token + "\n")
        tf.chmod(0o600)
        kill_switch(conn, True)
        w = dispatchers({"provider.crm": {"instance_url": srv.url, "access_token": f"file:{tf}",
                                          "timeout_ms": 3000, "auth_retry_ms": 60000,
                                          "backoff_base_ms": 10, "max_attempts": 5},
                         "provider.http": None, "dispatcher": {"providers": "crm"}})
        eid = str(enqueue(conn, "crm", "Task/Outbox_Key__c",
                          {"Subject": "x"}))
        e = wait_for(lambda: (lambda r: r if r["attempts"] >= 1 and r["last_error"] else None)(
            query_effect(conn, eid)), what="the 401 recorded")
        assert "INVALID_SESSION_ID" in e["last_error"] and "[secret]" in e["last_error"], e
        wait_for(lambda: "rejected the access token" in w.log(), what="the warning logged")
        assert_clean(conn, eid, w, token)
    finally:
        srv.stop()


def query_effect(conn, eid):
    rows = query(conn, "SELECT attempts, last_error FROM outbox_effects WHERE effect_id = %s",
                 (eid,))
    return {"attempts": rows[0][0], "last_error": rows[0][1]} if rows else None
