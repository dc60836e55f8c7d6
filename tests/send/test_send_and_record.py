# SPDX-License-Identifier: ISC
"""Send and record, through the http provider against a real HTTP server
with fault injection: the failure-class matrix (each outcome's final state,
attempts and requests), Retry-After, the provider's id and headers, bodies
as the producer wrote them, two workers never sending the same effect,
per-host limits and the circuit breaker, a run moving on, requeue.

The other behaviours this suite once held live by behaviour: tests/lease/
(renewal, expiry, wake-up), tests/kill_switch/, tests/lifecycle/ (signals,
logs, config and plugins), tests/resilience/ (reconnects, bad rows) and
tests/housekeeping/.
"""
import base64
import hashlib
import hmac
import json
import math
import time

import pytest

from outbox_test import (attempts, effect, enqueue, final, free_port, http_cfg, kill_switch,
                         make_run, query, run_ctl, run_state, scalar, states, wait_for)


MATRIX = [
    # path, provider config, final state, attempts, sink requests, error class
    ("/ok", {}, "completed", 1, 1, None),
    ("/delay/200", {}, "completed", 1, 1, None),
    ("/status/201", {}, "completed", 1, 1, None),
    ("/status/429?retry_after=0", {}, "failed", 3, 3, "retry"),
    ("/status/409", {}, "failed", 3, 3, "retry"),
    ("/status/503", {}, "failed", 3, 3, "retry"),
    ("/status/422", {}, "failed", 1, 1, "terminal"),
    ("/status/404", {}, "failed", 1, 1, "terminal"),
    ("/status/400", {}, "failed", 1, 1, "terminal"),
    ("/status/302", {}, "failed", 1, 1, "terminal"),
    ("/status/500", {}, "unknown", 1, 1, "ambiguous"),
    ("/status/502", {}, "unknown", 1, 1, "ambiguous"),
    ("/status/504", {}, "unknown", 1, 1, "ambiguous"),
    ("/close", {}, "unknown", 1, 1, "ambiguous"),
    ("/hang", {"timeout_ms": 600}, "unknown", 1, 1, "ambiguous"),
    ("/trickle", {"timeout_ms": 800}, "unknown", 1, 1, "ambiguous"),
    # A provider that honours keys gets the ambiguous outcome retried with
    # the same key; the idempotent endpoint sees the key twice and answers
    # the first result again.
    ("/flaky/1/500", {"honours_idempotency_keys": True}, "completed", 2, 2, None),
    ("/status/502", {"honours_idempotency_keys": True}, "unknown", 3, 3, "ambiguous"),
]


@pytest.mark.parametrize("path,pcfg,state,n_attempts,n_requests,err_class", MATRIX,
                         ids=[m[0] + ("+keys" if m[1].get("honours_idempotency_keys") else "")
                              for m in MATRIX])
def test_failure_class_matrix(conn, dispatchers, sink, path, pcfg, state, n_attempts,
                              n_requests, err_class):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + path, {"body": {"n": 1}})
    dispatchers(http_cfg(**pcfg))
    e = final(conn, eid)
    key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert e["state"] == state, e
    assert e["attempts"] == n_attempts, e
    assert sink.count(key=key) == n_requests
    log = attempts(conn, eid)
    assert len(log) == n_attempts, log
    assert [a["attempt"] for a in log] == list(range(1, n_attempts + 1))
    assert all(a["cas_applied"] for a in log)
    if state == "completed":
        assert e["provider_id"] and e["provider_id"].startswith("sink-"), e
        assert log[-1]["outcome_class"] == "accepted"
        assert log[-1]["provider_id"] == e["provider_id"]
    else:
        assert e["last_error_class"] == err_class, e
        assert log[-1]["outcome_class"] == err_class
    # Every request carried the effect's key.
    assert all(r["key"] == key for r in sink.received())


def test_connection_refused_is_not_sent_and_retried(conn, dispatchers):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", f"http://127.0.0.1:{free_port()}/x", {})
    dispatchers(http_cfg(breaker_failures=100))
    e = final(conn, eid)
    assert e["state"] == "failed" and e["attempts"] == 3
    assert e["last_error_class"] == "not_sent"
    assert {a["outcome_class"] for a in attempts(conn, eid)} == {"not_sent"}


def test_retry_after_is_honoured(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/flaky/1/503?retry_after=1", {})
    dispatchers(http_cfg())
    e = final(conn, eid)
    assert e["state"] == "completed" and e["attempts"] == 2
    t = [r["t"] for r in sink.received()]
    assert len(t) == 2 and t[1] - t[0] >= 0.95, t


def test_retry_after_is_capped(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/flaky/1/429?retry_after=3600", {})
    dispatchers(http_cfg(retry_after_max_ms=300))
    e = final(conn, eid, timeout=10)
    assert e["state"] == "completed" and e["attempts"] == 2


def test_provider_id_and_headers(conn, dispatchers, sink):
    kill_switch(conn, True)
    secret = base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    eid = enqueue(conn, "http", sink.url + "/ok",
                  {"method": "PUT", "headers": {"X-Trace": "t-1"}, "body": {"hello": "world"}})
    dispatchers(http_cfg(signing_secret="whsec_" + secret))
    e = final(conn, eid)
    assert e["state"] == "completed"
    (r,) = sink.received()
    key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert r["method"] == "PUT"
    assert r["headers"]["x-trace"] == "t-1"
    assert r["headers"]["idempotency-key"] == key
    assert json.loads(r["body"]) == {"hello": "world"}
    # Standard Webhooks: v1,base64(HMAC-SHA256(secret, id.ts.body))
    h = r["headers"]
    assert h["webhook-id"] == key
    signed = f"{h['webhook-id']}.{h['webhook-timestamp']}.".encode() + r["body"]
    want = base64.b64encode(hmac.new(base64.b64decode(secret), signed, hashlib.sha256).digest())
    assert h["webhook-signature"] == "v1," + want.decode()


def test_body_numbers_leave_as_the_producer_wrote_them(conn, dispatchers, sink):
    """A JSON body is sent as stored, compacted, not re-encoded by jansson
    (which printed 19.99 as 19.989999999999998 and 1.50 as 1.5, and failed
    an integer beyond 64 bits as invalid JSON); the signature covers those
    bytes."""
    kill_switch(conn, True)
    secret = base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    key = make_run(conn)
    eid = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                       "VALUES (%s, 'http', %s, %s) RETURNING effect_id",
                 (key, sink.url + "/ok",
                  '{"body": {"amount": 19.99, "qty": [1.50, 2], "note": "a, b: {c}", '
                  '"ledger": 123456789012345678901234567890}}'))
    dispatchers(http_cfg(signing_secret="whsec_" + secret))
    e = final(conn, eid)
    assert e["state"] == "completed", e
    (r,) = sink.received()
    assert json.loads(r["body"], parse_float=str, parse_int=str) == {
        "amount": "19.99", "qty": ["1.50", "2"], "note": "a, b: {c}",
        "ledger": "123456789012345678901234567890"}
    assert r["body"].replace(b'"a, b: {c}"', b"").count(b" ") == 0
    assert r["headers"]["content-type"] == "application/json"
    h = r["headers"]
    signed = f"{h['webhook-id']}.{h['webhook-timestamp']}.".encode() + r["body"]
    want = base64.b64encode(hmac.new(base64.b64decode(secret), signed, hashlib.sha256).digest())
    assert h["webhook-signature"] == "v1," + want.decode()


def test_string_and_null_bodies(conn, dispatchers, sink):
    """A string body is sent as its characters (escapes decoded, as text);
    a null or missing body as an empty JSON request."""
    kill_switch(conn, True)
    text = 'line 1\nline "2" \u00e9 {not json}'
    s = enqueue(conn, "http", sink.url + "/ok/s", {"body": text})
    n = enqueue(conn, "http", sink.url + "/ok/n", {"body": None, "method": "PATCH"})
    m = enqueue(conn, "http", sink.url + "/ok/m", {"method": "DELETE"})
    dispatchers(http_cfg())
    for eid in (s, n, m):
        assert final(conn, eid)["state"] == "completed"
    got = {r["path"].rsplit("/", 1)[1]: r for r in sink.received()}
    assert got["s"]["body"] == text.encode()
    assert got["s"]["headers"]["content-type"] == "text/plain; charset=utf-8"
    assert got["n"]["body"] == b"" and got["n"]["method"] == "PATCH"
    assert got["n"]["headers"]["content-type"] == "application/json"
    assert got["m"]["body"] == b"" and got["m"]["method"] == "DELETE"


# -- concurrency and per-host limits ---------------------------------------


def test_two_workers_never_send_the_same_effect(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    n = 600
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/ok?' || g, '{}' FROM generate_series(1, %s) g",
          (key, sink.url, n))
    cfg = {"dispatcher": {"batch_size": 8}, **http_cfg()}
    a = dispatchers(cfg, name="a")
    b = dispatchers(cfg, name="b")
    wait_for(lambda: states(conn).get("completed") == n, timeout=60, what="all delivered")
    assert sink.count() == n and len(sink.keys()) == n
    workers = dict(query(conn, "SELECT worker, count(*) FROM effect_attempts GROUP BY worker"))
    assert set(workers) == {"a", "b"}, "both workers took part"
    assert scalar(conn, "SELECT count(*) FROM effect_attempts") == n
    assert a.proc.poll() is None and b.proc.poll() is None


def test_per_host_concurrency_limit(conn, dispatchers, sink):
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + f"/delay/150?{i}", {}) for i in range(8)]
    dispatchers(http_cfg(max_per_host=2))
    wait_for(lambda: states(conn).get("completed") == 8, what="all delivered")
    assert sink.max_active == 2
    assert all(effect(conn, i)["attempts"] == 1 for i in ids)


def test_circuit_breaker_holds_effects_without_spending_attempts(conn, dispatchers):
    kill_switch(conn, True)
    port = free_port()
    ids = [enqueue(conn, "http", f"http://127.0.0.1:{port}/x?{i}", {}) for i in range(10)]
    t0 = time.monotonic()
    w = dispatchers(http_cfg(breaker_failures=2, breaker_open_ms=60000, max_per_host=1,
                             max_attempts=50))

    def probes():   # one each 1, 3, 7, ... s after the opening (dispatcher/hosts.h)
        return int(math.log2(time.monotonic() - t0 + 1))

    wait_for(lambda: any(e.get("event") == "breaker_open" for e in w.events()), what="breaker open")
    spent = wait_for(lambda: scalar(conn, "SELECT sum(attempts) FROM outbox_effects") or None)
    # Effects behind the open breaker wait: the total spent stays at the
    # failures that opened it (plus at most one in flight) and the probes.
    assert spent <= 3 + probes(), spent
    # The rest are given back, due when the breaker half-opens.
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE attempts = 0 "
                                  "AND lease_owner IS NULL AND available_at > now()")
             >= len(ids) - 3 - probes(), what="effects held behind the open breaker")
    assert scalar(conn, "SELECT sum(attempts) FROM outbox_effects") <= 3 + probes()


def test_run_moves_on_when_its_last_effect_completes(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    a = enqueue(conn, "http", sink.url + "/ok?a", {}, key=key)
    b = enqueue(conn, "http", sink.url + "/ok?b", {}, key=key)
    dispatchers(http_cfg())
    final(conn, a)
    final(conn, b)
    assert run_state(conn, key) == "completed"
    key2 = make_run(conn)
    # Both effects in one statement, as an approval enqueues them: two
    # separate commits let a fast worker complete the run after the first.
    bad = scalar(conn, "WITH e AS (INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                       "VALUES (%s, 'http', %s, '{}'), (%s, 'http', %s, '{}') RETURNING effect_id, target) "
                       "SELECT effect_id FROM e WHERE target LIKE '%%/status/400'",
                 (key2, sink.url + "/ok?c", key2, sink.url + "/status/400"))
    final(conn, bad)
    wait_for(lambda: run_state(conn, key2) == "failed_terminal", what="run failed_terminal")


def test_requeue_gives_a_fresh_retry_budget(conn, db, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/flaky/3/503", {})
    dispatchers(http_cfg(max_attempts=2))
    e = final(conn, eid)
    assert e["state"] == "failed" and e["attempts"] == 2
    r = run_ctl(["--db", db, "requeue", str(eid), "--operator", "ops", "--reason", "provider fixed"])
    assert r.returncode == 0, r.stdout + r.stderr
    e = wait_for(lambda: (lambda x: x if x["state"] == "completed" else None)(effect(conn, eid)),
                 what="completed within the new budget")
    assert e["attempts"] == 4
    assert [a["attempt"] for a in attempts(conn, eid)] == [1, 2, 3, 4]
