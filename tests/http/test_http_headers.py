# SPDX-License-Identifier: ISC
"""What the http provider makes of payload headers and of the answer's
Retry-After, against the real sink:

- a header with an empty value arrives, empty (libcurl drops "Name:" lines
  unless written "Name;");
- a header naming a secret ({"secret": NAME}) arrives with the secret
  read from secrets_dir at send time, only when NAME is declared in
  [provider.http] secrets for a URL prefix the target is under; the secret
  never reaches the worker's log, the effect's row, its attempts or its
  payload hash; an undeclared or unavailable name, another host, port or
  path, an ambiguous path (%2e%2e, %2f, %5c), a FIFO or a symlink fails
  the effect with a clear reason and nothing is sent; the worker's own
  conninfo can never be named (secrets_dir is never its directory);
- Retry-After: 9223372036854776 (seconds; times 1000 overflows a 64-bit
  long) is clamped: the worker (sanitizer build) keeps running and the
  effect waits retry_after_max_ms.
"""
import hashlib
import os

import pytest

from outbox_test import effect, enqueue, final, kill_switch, query, scalar, wait_for

SECRET = "tok-7f3a9c-never-logged"


def only_request(sink, eid_key):
    got = [r for r in sink.received() if r["key"] == eid_key]
    assert len(got) == 1, got
    return got[0]


def key_of(conn, eid):
    return scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))


def test_empty_header_value_arrives_empty(conn, dispatchers, sink):
    kill_switch(conn, True)
    dispatchers()
    eid = str(enqueue(conn, "http", f"{sink.url}/ok",
                      {"headers": {"X-Empty": "", "X-Full": "v"}, "body": {}}))
    assert final(conn, eid)["state"] == "completed"
    h = only_request(sink, key_of(conn, eid))["headers"]
    assert h.get("x-full") == "v"
    assert "x-empty" in h and h["x-empty"] == "", h


@pytest.fixture
def creds(tmp_path):
    """The http provider's secrets directory (never the credentials one)."""
    d = tmp_path / "creds"
    d.mkdir()
    (d / "api_token").write_text(SECRET + "\n")
    (d / "api_token").chmod(0o600)
    (d / "bad_token").write_text("x\x01y\n")
    return d


def secrets_config(creds, sink, **declared):
    """[provider.http] with secrets_dir = creds and, by default, api_token
    (and bad_token, missing_one) declared for the sink's /ok path."""
    decl = declared or {"api_token": f"{sink.url}/ok", "bad_token": f"{sink.url}/ok",
                        "missing_one": f"{sink.url}/ok", "a_fifo": f"{sink.url}/ok",
                        "a_link": f"{sink.url}/ok"}
    return {"provider.http": {"secrets_dir": str(creds),
                              "secrets": "; ".join(f"{k}={v}" for k, v in decl.items())}}


def test_secret_header_is_sent_but_never_stored_or_logged(conn, dispatchers, sink, creds):
    kill_switch(conn, True)
    w = dispatchers(secrets_config(creds, sink))
    eid = str(enqueue(conn, "http", f"{sink.url}/ok", {
        "headers": {"Authorization": {"secret": "api_token", "prefix": "Bearer "},
                    "X-Api-Key": {"secret": "api_token"}},
        "body": {"n": 1}}))
    assert final(conn, eid)["state"] == "completed"
    h = only_request(sink, key_of(conn, eid))["headers"]
    assert h["authorization"] == f"Bearer {SECRET}"
    assert h["x-api-key"] == SECRET
    assert SECRET not in w.log()
    row = scalar(conn, "SELECT row_to_json(o)::text FROM outbox_effects o WHERE effect_id = %s", (eid,))
    assert SECRET not in row and "api_token" in row
    atts = scalar(conn, "SELECT coalesce(string_agg(row_to_json(a)::text, ''), '') "
                        "FROM effect_attempts a WHERE effect_id = %s", (eid,))
    assert atts and SECRET not in atts
    payload, digest = query(conn, "SELECT payload::text, payload_hash FROM outbox_effects "
                                  "WHERE effect_id = %s", (eid,))[0]
    assert digest == hashlib.sha256(payload.encode()).hexdigest() and SECRET not in payload


@pytest.mark.parametrize("ref,words", [
    ({"secret": "missing_one"}, "secret missing_one is not available"),
    ({"secret": "undeclared"}, "secret undeclared is not declared"),
    ({"secret": "../creds/api_token"}, "not a plain file name"),
    ({"secret": ".hidden"}, "not a plain file name"),
    ({"secret": ""}, "not a plain file name"),
    ({"secret": "a/b"}, "not a plain file name"),
    ({"secret": 5}, "not a plain file name"),
    ({"secret": "api_token", "other": 1}, '"secret" and optionally "prefix"'),
    ({"secret": "api_token", "prefix": "a\r\nX-Evil: 1"}, "control characters"),
    ({"secret": "bad_token"}, "control characters"),
])
def test_bad_secret_references_fail_before_sending(conn, dispatchers, sink, creds, ref, words):
    kill_switch(conn, True)
    w = dispatchers(secrets_config(creds, sink))
    eid = str(enqueue(conn, "http", f"{sink.url}/ok", {"headers": {"Authorization": ref},
                                                       "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed" and words in e["last_error"], e
    assert str(creds) not in e["last_error"], "last_error never shows the directory"
    assert sink.count() == 0
    assert SECRET not in w.log()


def test_secret_reference_without_secrets_configured_fails_clearly(conn, dispatchers, sink, creds):
    """No implicit directory: with neither secrets nor secrets_dir set, even
    $CREDENTIALS_DIRECTORY holding the file is never read."""
    kill_switch(conn, True)
    dispatchers(env={"CREDENTIALS_DIRECTORY": str(creds)})
    eid = str(enqueue(conn, "http", f"{sink.url}/ok",
                      {"headers": {"Authorization": {"secret": "api_token"}}, "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed" and "secret api_token is not declared" in e["last_error"], e
    assert sink.count() == 0


DB_PASSWORD = "pw-db-9c1e5b-must-stay-home"


def test_producer_cannot_send_the_database_conninfo_anywhere(db, conn, dispatchers, sink, tmp_path):
    """The worker's own conninfo, read from $CREDENTIALS_DIRECTORY, named as
    a header secret to an arbitrary host: the effect fails, nothing is sent
    (the sink stands in for https://evil.example/)."""
    from outbox_test import worker_dsn
    cred = tmp_path / "credentials"
    cred.mkdir()
    # Trust authentication ignores the password: the worker still logs in.
    (cred / "outbox_db-conninfo").write_text(f"{worker_dsn(db)} password={DB_PASSWORD}\n")
    kill_switch(conn, True)
    w = dispatchers({"database": {"conninfo": "file:${CREDENTIALS_DIRECTORY}/outbox_db-conninfo"}},
                    env={"CREDENTIALS_DIRECTORY": str(cred)})
    eid = str(enqueue(conn, "http", f"{sink.url}/evil",
                      {"headers": {"X": {"secret": "outbox_db-conninfo"}}, "body": {}}))
    e = final(conn, eid)
    assert DB_PASSWORD not in repr(sink.received())
    assert sink.count() == 0
    assert e["state"] == "failed", e
    assert "outbox_db-conninfo" in e["last_error"] and DB_PASSWORD not in e["last_error"], e
    assert DB_PASSWORD not in w.log()


@pytest.mark.parametrize("where", ["credentials", "conninfo_dir", "passfile"])
def test_secrets_dir_holding_the_workers_credentials_refuses_to_start(db, tmp_path, where):
    from outbox_test import Dispatcher, worker_dsn
    cred = tmp_path / "credentials"
    cred.mkdir()
    (cred / "outbox_db-conninfo").write_text(worker_dsn(db) + "\n")
    env = {"CREDENTIALS_DIRECTORY": str(cred)} if where == "credentials" else \
        {"CREDENTIALS_DIRECTORY": None}
    conninfo = {"credentials": "file:${CREDENTIALS_DIRECTORY}/outbox_db-conninfo",
                "conninfo_dir": f"file:{cred}/outbox_db-conninfo",
                "passfile": f"{worker_dsn(db)} passfile={cred}/pgpass"}[where]
    # Spelled another way, so the comparison is of resolved paths.
    d = Dispatcher(db, tmp_path, {"database": {"conninfo": conninfo},
                                  "provider.http": {"secrets_dir": f"{cred}/../credentials/",
                                                    "secrets": "outbox_db-conninfo=https://x/"}},
                   env=env)
    d.start(wait_ready=False)
    try:
        rc = d.wait(timeout=30)
    finally:
        d.stop()
    log = d.log()
    assert rc != 0 and "secrets_dir" in log and ".ini:" in log, log


@pytest.mark.parametrize("target", [
    "{other}/ok",                       # another port of the same host
    "http://localhost:{port}/ok",       # another host name
    "{url}/okx",                        # not on a segment boundary
    "{url}/other",                      # another path
    "{url}/ok/%2e%2e/admin",            # decoded by servers into /admin
    "{url}/ok/..%2Fadmin",
    "{url}/ok/%5Cadmin",
])
def test_secret_goes_only_under_its_declared_prefixes(conn, dispatchers, sink, creds, target):
    from http_sink import Sink
    other = Sink().start()
    try:
        kill_switch(conn, True)
        dispatchers(secrets_config(creds, sink, api_token=f"{sink.url}/ok"))
        url = target.format(other=other.url, url=sink.url, port=sink.port)
        eid = str(enqueue(conn, "http", url,
                          {"headers": {"Authorization": {"secret": "api_token"}}, "body": {}}))
        e = final(conn, eid)
        assert e["state"] == "failed" and "secret api_token" in e["last_error"], e
        assert sink.count() == 0 and other.count() == 0
        ok = str(enqueue(conn, "http", f"{sink.url}/ok/sub",
                         {"headers": {"Authorization": {"secret": "api_token"}}, "body": {}}))
        assert final(conn, ok)["state"] == "completed"
        assert only_request(sink, key_of(conn, ok))["headers"]["authorization"] == SECRET
    finally:
        other.stop()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_fifo_or_symlink_secret_fails_without_blocking(conn, dispatchers, sink, creds, kind):
    if kind == "fifo":
        os.mkfifo(creds / "a_fifo")
        name = "a_fifo"
    else:
        os.symlink(creds / "api_token", creds / "a_link")
        name = "a_link"
    kill_switch(conn, True)
    dispatchers(secrets_config(creds, sink))
    bad = str(enqueue(conn, "http", f"{sink.url}/ok",
                      {"headers": {"Authorization": {"secret": name}}, "body": {}}))
    e = final(conn, bad)
    assert e["state"] == "failed" and f"secret {name} is not available" in e["last_error"], e
    good = str(enqueue(conn, "http", f"{sink.url}/ok",
                       {"headers": {"Authorization": {"secret": "api_token"}}, "body": {}}))
    assert final(conn, good)["state"] == "completed"
    assert sink.count() == 1 and only_request(sink, key_of(conn, good))
    assert sink.count(key=key_of(conn, bad)) == 0


def test_bad_secrets_declaration_refuses_to_start(db, tmp_path, creds):
    from outbox_test import Dispatcher
    d = Dispatcher(db, tmp_path, {"provider.http": {"secrets_dir": str(creds),
                                                    "secrets": "api_token=not-a-url"}})
    d.start(wait_ready=False)
    try:
        rc = d.wait(timeout=30)
    finally:
        d.stop()
    log = d.log()
    assert rc != 0 and "secrets" in log and "api_token" in log and ".ini:" in log, log


def test_huge_retry_after_is_clamped(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers({"provider.http": {"retry_after_max_ms": 60000, "max_attempts": 3}})
    eid = str(enqueue(conn, "http", f"{sink.url}/status/503?retry_after=9223372036854776",
                      {"body": {}}))
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM effect_attempts WHERE effect_id = %s",
                            (eid,)) == 1, what="the first attempt recorded")
    e = wait_for(lambda: (lambda x: x if x["state"] == "pending" else None)(effect(conn, eid)),
                 what="the effect back to pending")
    assert e["attempts"] == 1
    assert scalar(conn, "SELECT available_at > now() + interval '30 s' FROM outbox_effects "
                        "WHERE effect_id = %s", (eid,))
    assert w.proc.poll() is None, w.log()
