# SPDX-License-Identifier: ISC
"""What the http provider makes of payload headers and of the answer's
Retry-After, against the real sink:

- a header with an empty value arrives, empty (libcurl drops "Name:" lines
  unless written "Name;");
- a header naming a secret ({"secret": NAME}) arrives with the secret
  read from the worker's credentials directory at send time; the secret
  never reaches the worker's log, the effect's row, its attempts or its
  payload hash; an unknown name fails the effect with a clear reason and
  nothing is sent; a name that is not a plain file name is refused;
- Retry-After: 9223372036854776 (seconds; times 1000 overflows a 64-bit
  long) is clamped: the worker (sanitizer build) keeps running and the
  effect waits retry_after_max_ms.
"""
import hashlib

import pytest

from outbox_test import effect, enqueue, final, kill_switch, query, scalar, wait_for

SECRET = "tok-7f3a9c-never-logged"


def only_request(sink, eid_key):
    got = [r for r in sink.received() if r["key"] == eid_key]
    assert len(got) == 1, got
    return got[0]


def key_of(conn, eid):
    return scalar(conn, "SELECT effect_key FROM effect_outbox WHERE effect_id = %s", (eid,))


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
    d = tmp_path / "creds"
    d.mkdir()
    (d / "api_token").write_text(SECRET + "\n")
    (d / "api_token").chmod(0o600)
    (d / "bad_token").write_text("x\x01y\n")
    return d


def test_secret_header_is_sent_but_never_stored_or_logged(conn, dispatchers, sink, creds):
    kill_switch(conn, True)
    w = dispatchers(env={"CREDENTIALS_DIRECTORY": str(creds)})
    eid = str(enqueue(conn, "http", f"{sink.url}/ok", {
        "headers": {"Authorization": {"secret": "api_token", "prefix": "Bearer "},
                    "X-Api-Key": {"secret": "api_token"}},
        "body": {"n": 1}}))
    assert final(conn, eid)["state"] == "completed"
    h = only_request(sink, key_of(conn, eid))["headers"]
    assert h["authorization"] == f"Bearer {SECRET}"
    assert h["x-api-key"] == SECRET
    assert SECRET not in w.log()
    row = scalar(conn, "SELECT row_to_json(o)::text FROM effect_outbox o WHERE effect_id = %s", (eid,))
    assert SECRET not in row and "api_token" in row
    atts = scalar(conn, "SELECT coalesce(string_agg(row_to_json(a)::text, ''), '') "
                        "FROM effect_attempts a WHERE effect_id = %s", (eid,))
    assert atts and SECRET not in atts
    payload, digest = query(conn, "SELECT payload::text, payload_hash FROM effect_outbox "
                                  "WHERE effect_id = %s", (eid,))[0]
    assert digest == hashlib.sha256(payload.encode()).hexdigest() and SECRET not in payload


@pytest.mark.parametrize("ref,words", [
    ({"secret": "missing_one"}, 'secret "missing_one" is not in the credentials directory'),
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
    w = dispatchers(env={"CREDENTIALS_DIRECTORY": str(creds)})
    eid = str(enqueue(conn, "http", f"{sink.url}/ok", {"headers": {"Authorization": ref},
                                                       "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed" and words in e["last_error"], e
    assert sink.count() == 0
    assert SECRET not in w.log()


def test_secret_reference_without_credentials_directory_fails_clearly(conn, dispatchers, sink):
    kill_switch(conn, True)
    dispatchers(env={"CREDENTIALS_DIRECTORY": None})
    eid = str(enqueue(conn, "http", f"{sink.url}/ok",
                      {"headers": {"Authorization": {"secret": "api_token"}}, "body": {}}))
    e = final(conn, eid)
    assert e["state"] == "failed" and "secrets_dir" in e["last_error"], e
    assert sink.count() == 0


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
    assert scalar(conn, "SELECT available_at > now() + interval '30 s' FROM effect_outbox "
                        "WHERE effect_id = %s", (eid,))
    assert w.proc.poll() is None, w.log()
