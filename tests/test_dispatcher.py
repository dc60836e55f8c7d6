"""The dispatcher against real PostgreSQL and a real HTTP server with fault
injection: the failure-class matrix, kill switch, crashes, restarts,
signals, lease renewal, bad input and config errors (issue 3).

Where a test asserts that something does NOT happen (no send while the
kill switch is off), it observes a bounded window in which the worker
provably polled several times (poll_interval_ms=200), then proves the
worker is alive by letting the effects through.
"""
import base64
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from outbox_test import (BUILD_DIR, attempts, effect, enqueue, kill_switch, make_run,
                         pg_restart, query, run_ctl, scalar, states, wait_for, write_config)

FAST = {"backoff_base_ms": 10, "backoff_cap_ms": 50, "max_attempts": 3}


def http_cfg(**kw):
    c = dict(FAST)
    c.update(kw)
    return {"provider.http": c}


def final(conn, eid, timeout=20):
    return wait_for(lambda: (lambda e: e if e["state"] not in ("pending", "sending") else None)(
        effect(conn, eid)), timeout=timeout, what=f"effect {eid} to settle")


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- the failure-class matrix ---------------------------------------------

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
    key = scalar(conn, "SELECT effect_key FROM effect_outbox WHERE effect_id = %s", (eid,))
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
    eid = enqueue(conn, "http", f"http://127.0.0.1:{closed_port()}/x", {})
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
    key = scalar(conn, "SELECT effect_key FROM effect_outbox WHERE effect_id = %s", (eid,))
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


# -- bad input -------------------------------------------------------------

BAD_ROWS = [
    ("http", "not a url", {}, "not a valid URL"),
    ("http", "ftp://127.0.0.1/x", {}, "scheme"),
    ("http", "http://10.1.2.3/x", {}, "allow-list"),
    ("http", "http://169.254.169.254/latest/meta-data", {}, "allow-list"),
    ("http", "{sink}/ok", {"method": 5}, "method"),
    ("http", "{sink}/ok", {"method": "CONNECT"}, "method"),
    ("http", "{sink}/ok", {"headers": {"X-A": "1\r\nX-Injected: 1"}}, "CR/LF"),
    ("http", "{sink}/ok", {"headers": {"Bad Name": "1"}}, "invalid characters"),
    ("http", "{sink}/ok", {"headers": {"Idempotency-Key": "mine"}}, "set by the dispatcher"),
    ("http", "{sink}/ok", {"headers": "x"}, "object of strings"),
    ("http", "{sink}/ok", {"headers": {"X-A": 1}}, "must be a string"),
]


@pytest.mark.parametrize("etype,target,payload,reason", BAD_ROWS,
                         ids=[f"{b[1][:20]}-{b[3]}" for b in BAD_ROWS])
def test_malformed_rows_fail_with_reason(conn, dispatchers, sink, etype, target, payload, reason):
    kill_switch(conn, True)
    bad = enqueue(conn, etype, target.replace("{sink}", sink.url), payload)
    good = enqueue(conn, "http", sink.url + "/ok", {})
    w = dispatchers(http_cfg())
    assert final(conn, good)["state"] == "completed"
    e = final(conn, bad)
    assert e["state"] == "failed", e
    assert e["last_error_class"] == "invalid"
    assert reason in e["last_error"], e["last_error"]
    assert e["attempts"] == 0 and attempts(conn, bad) == []
    assert sink.count() == 1
    assert w.proc.poll() is None


def test_payload_shape_and_size_limits(conn, dispatchers, sink):
    kill_switch(conn, True)
    arr = enqueue(conn, "http", sink.url + "/ok", [1, 2])
    big = enqueue(conn, "http", sink.url + "/ok", {"body": "x" * 5000})
    dispatchers({"dispatcher": {"max_payload_bytes": 1024}, **http_cfg()})
    assert "JSON object" in final(conn, arr)["last_error"]
    assert "over the limit of 1024" in final(conn, big)["last_error"]
    assert sink.count() == 0


def test_unknown_effect_type_is_failed_after_grace(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "fax", "+123", {})
    dispatchers({"dispatcher": {"unknown_type_grace_seconds": 0, "maintenance_interval_ms": 200},
                 **http_cfg()})
    e = final(conn, eid)
    assert e["state"] == "failed" and "unknown effect type" in e["last_error"]


# -- kill switch ------------------------------------------------------------

def observe_nothing_sent(conn, sink, ids, seconds=1.5):
    """A bounded window (several poll intervals): nothing may be sent."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert sink.count() == 0
        rows = query(conn, "SELECT state, attempts, lease_owner FROM effect_outbox "
                           "WHERE effect_id = ANY(%s::uuid[])", ([str(i) for i in ids],))
        assert all(r[0] == "pending" and r[1] == 0 for r in rows), rows
        time.sleep(0.1)


def test_kill_switch_control_row_off_then_on(conn, dispatchers, sink):
    ids = [enqueue(conn, "http", sink.url + "/ok", {"i": i}) for i in range(20)]
    # New database: the switch is off (deny by default).
    assert scalar(conn, "SELECT enabled FROM outbox_control") is False
    w = dispatchers(http_cfg())
    observe_nothing_sent(conn, sink, ids)
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE lease_owner IS NOT NULL") == 0
    r = run_ctl(["--db", w.dsn, "kill-switch", "on", "--operator", "ops", "--reason", "test"])
    assert r.returncode == 0, r.stderr
    wait_for(lambda: states(conn).get("completed") == 20, what="all delivered")
    assert all(v == 1 for v in sink.keys().values()) and len(sink.keys()) == 20
    assert all(effect(conn, i)["attempts"] == 1 for i in ids)


@pytest.mark.parametrize("value", [None, "false", "TRUE", "1", "true "])
def test_kill_switch_environment(conn, dispatchers, sink, value):
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + "/ok", {"i": i}) for i in range(5)]
    w = dispatchers(http_cfg(), env={"AI_ACTIONS_ENABLED": value})
    assert any(e.get("event") == "kill_switch_env" for e in w.events())
    observe_nothing_sent(conn, sink, ids)
    w.stop()
    dispatchers(http_cfg(), name="w-on")
    wait_for(lambda: states(conn).get("completed") == 5, what="delivered once enabled")
    assert sink.count() == 5 and all(effect(conn, i)["attempts"] == 1 for i in ids)


def test_kill_switch_off_releases_leases_without_spending_attempts(conn, dispatchers, sink):
    """Rows leased while the switch was on and blocked at the sending
    transition go back unleased, attempts unchanged."""
    kill_switch(conn, True)
    key = make_run(conn)
    # Lease rows as a worker would, then turn the switch off before marking.
    ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}, key=key) for i in range(3)]
    owner = "11111111-1111-4111-8111-111111111111"
    leased = query(conn, "SELECT effect_id FROM outbox_lease(%s, 'manual', 10, 30, '{http}', true)",
                   (owner,))
    assert len(leased) == 3
    kill_switch(conn, False)
    rows = query(conn, "SELECT effect_id, attempts, blocked FROM outbox_mark_sending(%s, %s::uuid[], "
                       "true, '{}', 30)", (owner, [str(i) for i in ids]))
    assert len(rows) == 3 and all(r[2] for r in rows) and all(r[1] == 0 for r in rows)
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE lease_owner IS NOT NULL "
                        "OR state <> 'pending' OR attempts <> 0") == 0


# -- crashes, restarts, concurrency -----------------------------------------

def test_sigkill_during_hanging_send_becomes_unknown_and_is_never_resent(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/hang", {})
    cfg = {"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
           **http_cfg(timeout_ms=30000)}
    w1 = dispatchers(cfg, name="victim")
    wait_for(lambda: sink.count() == 1, what="the send to start")
    w1.kill()
    t0 = time.monotonic()
    dispatchers(cfg, name="survivor")
    e = wait_for(lambda: (lambda x: x if x["state"] == "unknown" else None)(effect(conn, eid)),
                 timeout=10, what="unknown")
    assert time.monotonic() - t0 < 2 + 2, "noticed within one lease period (+ a reaper pass)"
    log = attempts(conn, eid)
    assert [a["outcome_class"] for a in log] == ["ambiguous"]
    assert "lost" in log[0]["error_text"]
    # The survivor keeps working and never re-sends the unknown effect.
    canary = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, canary)["state"] == "completed"
    assert effect(conn, eid)["state"] == "unknown"
    key = scalar(conn, "SELECT effect_key FROM effect_outbox WHERE effect_id = %s", (eid,))
    assert sink.count(key=key) == 1


def test_expired_sending_row_of_key_honouring_provider_returns_to_pending(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/hang", {})
    cfg = {"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
           **http_cfg(timeout_ms=30000, honours_idempotency_keys=True)}
    w1 = dispatchers(cfg, name="victim")
    wait_for(lambda: sink.count() == 1, what="the send to start")
    w1.kill()
    query(conn, "UPDATE effect_outbox SET target = %s WHERE effect_id = %s", (sink.url + "/idem", eid))
    dispatchers(cfg, name="survivor")
    e = final(conn, eid)
    assert e["state"] == "completed" and e["attempts"] == 2
    classes = [a["outcome_class"] for a in attempts(conn, eid)]
    assert classes == ["ambiguous", "accepted"]


@pytest.mark.exclusive
def test_postgres_restart_during_a_run(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    n = 300
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/delay/5?' || g, '{}' FROM generate_series(1, %s) g",
          (key, sink.url, n))
    cfg = {"database": {"reconnect_min_ms": 50, "reconnect_max_ms": 500},
           "dispatcher": {"batch_size": 16}, **http_cfg()}
    dispatchers(cfg, name="a")
    dispatchers(cfg, name="b")
    wait_for(lambda: sink.count() >= 30, what="some progress")
    conn.close()
    pg_restart()
    c = wait_for(lambda: _try_connect(), timeout=30, what="database back")
    wait_for(lambda: scalar(c, "SELECT count(*) FROM effect_outbox WHERE state = 'completed'") == n,
             timeout=60, what="all delivered after the restart")
    assert sink.count() == n
    assert all(v == 1 for v in sink.keys().values()), "no effect sent twice"
    assert scalar(c, "SELECT count(*) FROM effect_attempts") == n
    assert scalar(c, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,)) == "completed"
    c.close()


_DSN = {}


def _try_connect():
    import psycopg2
    try:
        c = psycopg2.connect(_DSN["dsn"])
        c.autocommit = True
        return c
    except psycopg2.OperationalError:
        return None


@pytest.fixture(autouse=True)
def _remember_dsn(db):
    _DSN["dsn"] = db


def test_terminated_backends_reconnect(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/ok?' || g, '{}' FROM generate_series(1, 100) g",
          (key, sink.url))
    cfg = {"database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()}
    w = dispatchers(cfg)
    wait_for(lambda: sink.count() >= 10, what="some progress")
    for _ in range(3):
        query(conn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        time.sleep(0.05)
    wait_for(lambda: states(conn).get("completed") == 100, timeout=30, what="all delivered")
    assert sink.count() == 100 and all(v == 1 for v in sink.keys().values())
    assert any(e.get("event") == "db_disconnected" for e in w.events())


def test_connection_lost_under_a_query_without_callback(db, conn, dispatchers, sink):
    """A statement whose answer nobody waits for (provider registration)
    is on the wire when its backend is terminated: the worker reconnects
    and carries on (it used to call a NULL callback: found by the chaos
    run once registration moved to the second connection)."""
    import psycopg2
    kill_switch(conn, True)
    locker = psycopg2.connect(db)
    try:
        cur = locker.cursor()
        cur.execute("LOCK TABLE outbox_providers IN EXCLUSIVE MODE")
        cfg = {"database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()}
        w = dispatchers(cfg)
        pid = wait_for(lambda: scalar(conn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                            "AND query LIKE 'SELECT outbox_register_providers%%' "
                                            "AND wait_event_type = 'Lock'"),
                       what="registration blocked on the lock")
        query(conn, "SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: any(e.get("event") == "db_disconnected" for e in w.events()),
                 what="the worker saw the connection go")
    finally:
        locker.rollback()
        locker.close()
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert w.proc.poll() is None


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
    port = closed_port()
    ids = [enqueue(conn, "http", f"http://127.0.0.1:{port}/x?{i}", {}) for i in range(10)]
    w = dispatchers(http_cfg(breaker_failures=2, breaker_open_ms=60000, max_per_host=1,
                             max_attempts=50))
    wait_for(lambda: any(e.get("event") == "breaker_open" for e in w.events()), what="breaker open")
    spent = wait_for(lambda: scalar(conn, "SELECT sum(attempts) FROM effect_outbox") or None)
    # Effects behind the open breaker wait: the total spent stays at the
    # failures that opened it (plus at most one in flight).
    assert spent <= 3, spent
    # The rest are given back, due when the breaker half-opens.
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM effect_outbox WHERE attempts = 0 "
                                  "AND lease_owner IS NULL AND available_at > now() + interval '30 s'")
             >= len(ids) - 3, what="effects held behind the open breaker")
    assert scalar(conn, "SELECT sum(attempts) FROM effect_outbox") <= 3


# -- lease renewal and the cap ------------------------------------------------

def test_lease_is_renewed_during_a_long_send(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/delay/4500", {})
    dispatchers({"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
                 **http_cfg(timeout_ms=10000)})
    e = final(conn, eid)
    assert e["state"] == "completed" and e["attempts"] == 1


def test_total_lease_cap_makes_an_overlong_send_unknown(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/delay/6000", {})
    w = dispatchers({"dispatcher": {"lease_seconds": 2, "max_lease_seconds": 3,
                                    "maintenance_interval_ms": 200},
                     **http_cfg(timeout_ms=10000)})
    assert final(conn, eid)["state"] == "unknown"
    # The send still finishes; its late acceptance is evidence from the
    # attempt the reaper gave up on: it completes the effect (outbox_complete).
    log = wait_for(lambda: (lambda a: a if len(a) == 2 else None)(attempts(conn, eid)),
                   what="the late outcome in the attempts log")
    assert log[0]["outcome_class"] == "ambiguous" and log[0]["worker"].startswith("reaper:")
    assert log[1]["outcome_class"] == "accepted" and log[1]["cas_applied"] is True
    assert effect(conn, eid)["state"] == "completed"
    assert effect(conn, eid)["provider_id"] == log[1]["provider_id"]
    assert scalar(conn, "SELECT resolution FROM effect_attempts WHERE effect_id = %s "
                        "AND outcome_class = 'accepted'", (eid,)) == "late_accepted"
    # The worker logs the attempt once outbox_complete has answered, a
    # moment after the row above is visible.
    wait_for(lambda: any(e.get("event") == "attempt" and e.get("lease_held") is False
                         and e.get("resolved") == "late_accepted"
                         for e in w.events()), what="the attempt line with lease_held false")


# -- signals -------------------------------------------------------------------

def test_sigterm_finishes_in_flight_and_releases_unstarted(conn, dispatchers, sink):
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + f"/delay/800?{i}", {}) for i in range(5)]
    w = dispatchers(http_cfg(max_per_host=1))
    wait_for(lambda: sink.count() == 1, what="first send in flight")
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=15) == 0
    st = [effect(conn, i) for i in ids]
    done = [s for s in st if s["state"] == "completed"]
    assert len(done) >= 1
    for s in st:
        assert s["state"] in ("completed", "pending"), s
        if s["state"] == "pending":
            assert s["attempts"] == 0
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE lease_owner IS NOT NULL") == 0
    assert sink.count() == len(done)


def test_second_sigterm_exits_at_once(conn, dispatchers, sink):
    kill_switch(conn, True)
    enqueue(conn, "http", sink.url + "/hang", {})
    w = dispatchers({"dispatcher": {"shutdown_grace_ms": 60000}, **http_cfg(timeout_ms=60000)})
    wait_for(lambda: sink.count() == 1, what="send in flight")
    w.signal(signal.SIGTERM)
    wait_for(lambda: any(e.get("event") == "stopping" for e in w.events()), what="stopping")
    assert w.proc.poll() is None, "still waiting for the in-flight send"
    t0 = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=5) == 0
    assert time.monotonic() - t0 < 3


def test_sighup_with_broken_config_keeps_the_old_one(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers(http_cfg())
    with open(w.config_path, "a") as f:
        f.write("[dispatcher]\nlease_seconds = many\n")
    w.signal(signal.SIGHUP)
    ev = wait_for(lambda: [e for e in w.events() if e.get("event") == "reload_failed"],
                  what="reload_failed")
    assert "lease_seconds" in ev[0]["msg"] and w.config_path in ev[0]["msg"]
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert w.proc.poll() is None


def test_sighup_applies_a_good_config(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers(http_cfg())
    sections = dict(w.sections)
    sections["log"] = {"level": "debug"}
    write_config(w.config_path, sections)
    w.signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == "reloaded" for e in w.events()), what="reloaded")


# -- logs ---------------------------------------------------------------------

def test_attempt_logs_have_the_fields_and_no_payload_or_secret(conn, dispatchers, sink):
    kill_switch(conn, True)
    secret = base64.b64encode(b"supersecretsigningkey-0123456789").decode()
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata, "
                "approved_by) VALUES (%s, 'http', %s, %s, %s, 'alice@example.com')",
          (key, sink.url + "/ok", json.dumps({"body": {"ssn": "PAYLOAD-CANARY-123"}}),
           json.dumps({"workflow_version": "v7", "model": "m-2"})))
    w = dispatchers(http_cfg(signing_secret="whsec_" + secret))
    wait_for(lambda: states(conn).get("completed") == 1, what="delivered")
    w.stop()
    text = w.log()
    assert "PAYLOAD-CANARY-123" not in text
    assert secret not in text and "supersecretsigningkey" not in text
    (a,) = [e for e in w.events() if e.get("event") == "attempt"]
    for field in ("ts", "worker", "run_key", "effect_id", "type", "target_class", "payload_hash",
                  "metadata", "approver", "attempt", "outcome", "provider_status", "provider_id",
                  "duration_ms", "retry_count"):
        assert field in a, field
    assert a["metadata"] == {"workflow_version": "v7", "model": "m-2"}
    assert a["approver"] == "alice@example.com"
    assert a["payload_hash"] == scalar(conn, "SELECT payload_hash FROM effect_outbox")


def test_password_in_conninfo_is_not_logged(conn, dispatchers, tmp_path):
    w = dispatchers({"database": {"conninfo": _DSN["dsn"] + " password=hunter2-CANARY"}})
    w.stop()
    assert "hunter2-CANARY" not in w.log()
    assert "********" in w.log()


# -- config and plugin errors ----------------------------------------------------

def start_expect_failure(tmp_path, text, env=None):
    p = tmp_path / "bad.ini"
    p.write_text(text)
    e = dict(os.environ, AI_ACTIONS_ENABLED="true")
    e.update(env or {})
    r = subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p)],
                       capture_output=True, text=True, timeout=20, env=e)
    return r, str(p)


CONFIG_ERRORS = [
    ("[dispatcher]\nlease_seconds = abc\n", 2, "lease_seconds", "integer"),
    ("[dispatcher]\nlease_seconds = 0\n", 2, "lease_seconds", "from 2 to"),
    ("[dispatcher]\nno_such_key = 1\n", 2, "no_such_key", "unknown key"),
    ("[nonsense]\na = 1\n", 2, "nonsense", "unknown section"),
    ("[database]\npoll_only = maybe\n", 2, "poll_only", "true or false"),
    ("[metrics]\nlisten =\n[dispatcher]\nbatch_size = 5\nbatch_size = 6\n", 5, "batch_size", "set twice"),
    ("[provider.http]\ntimeout_ms = -1\n", 2, "timeout_ms", "integer"),
    ("[provider.http]\nallow_hosts = 10.0.0.0/99\n", 2, "allow_hosts", "CIDR"),
    ("[provider.http]\nbogus = 1\n", 2, "bogus", "unknown key"),
    ("[provider.http]\nsigning_secret = env:NO_SUCH_ENV_VAR_X\n", 2, "signing_secret", "not set"),
    ("this is not ini\n", 1, "", "syntax"),
]


@pytest.mark.parametrize("text,line,key,words", CONFIG_ERRORS, ids=[c[3] + "-" + c[2] for c in CONFIG_ERRORS])
def test_config_errors_name_file_line_and_key(tmp_path, text, line, key, words):
    r, path = start_expect_failure(tmp_path, "[metrics]\nlisten =\n" + text if not text.startswith("[metrics]") else text)
    assert r.returncode == 1
    shift = 0 if text.startswith("[metrics]") else 2
    assert f"{path}:{line + shift}" in r.stderr, r.stderr
    assert key in r.stderr and words in r.stderr, r.stderr


def test_missing_plugin(tmp_path):
    r, _ = start_expect_failure(tmp_path, "[metrics]\nlisten =\n[dispatcher]\nproviders = sms\n")
    assert r.returncode == 1
    assert "provider \\\"sms\\\": cannot load" in r.stderr or 'provider "sms": cannot load' in r.stderr
    assert r.stderr.count("provider_error") == 1


PLUGIN_SRC = r'''
#include "provider.h"
#include <stdio.h>
static void *init(const struct outbox_host *h, const struct outbox_conf *c, char *err, size_t n)
{ (void)h; (void)c; snprintf(err, n, "the relay password file is unreadable"); return NULL; }
static bool validate(void *s, const struct outbox_effect *e, char *k, size_t kl, char *err, size_t n)
{ (void)s; (void)e; (void)k; (void)kl; (void)err; (void)n; return true; }
static bool send(void *s, const struct outbox_effect *e, outbox_done_fn d, void *t, char *err, size_t n)
{ (void)s; (void)e; (void)d; (void)t; (void)err; (void)n; return false; }
static void shut(void *s) { (void)s; }
static const struct outbox_provider p = { ABI, "fake", 0, NULL, init, validate, send, NULL, shut };
const struct outbox_provider *outbox_provider_entry(void) { return &p; }
'''


def provider_abi():
    """OUTBOX_PROVIDER_ABI as providers/provider.h defines it."""
    with open(os.path.join(os.path.dirname(BUILD_DIR), "providers", "provider.h")) as f:
        return int(re.search(r"#define OUTBOX_PROVIDER_ABI (\d+)", f.read()).group(1))


def build_plugin(tmp_path, abi):
    src = tmp_path / "fake.c"
    src.write_text(PLUGIN_SRC.replace("ABI", str(abi)))
    d = tmp_path / "plugins"
    d.mkdir(exist_ok=True)
    inc = os.path.join(os.path.dirname(BUILD_DIR), "providers")
    jansson = subprocess.run(["pkg-config", "--cflags", "jansson"], capture_output=True, text=True).stdout.split()
    subprocess.run(["cc", "-shared", "-fPIC", "-I", inc, *jansson, "-o", str(d / "outbox_fake.so"), str(src)],
                   check=True)
    return d


def test_plugin_with_wrong_interface_version(tmp_path):
    d = build_plugin(tmp_path, 99)
    r, _ = start_expect_failure(tmp_path, f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\n"
                                          f"provider_dir = {d}\n")
    assert r.returncode == 1
    assert "built for provider interface 99" in r.stderr, r.stderr
    assert f"speaks {provider_abi()}" in r.stderr, r.stderr


def test_plugin_whose_init_fails(tmp_path):
    d = build_plugin(tmp_path, provider_abi())
    r, _ = start_expect_failure(tmp_path, f"[metrics]\nlisten =\n[dispatcher]\nproviders = fake\n"
                                          f"provider_dir = {d}\n")
    assert r.returncode == 1
    assert "init failed: the relay password file is unreadable" in r.stderr, r.stderr
    assert r.stderr.count("provider_error") == 1


def test_minimal_config_of_the_stable_keys_runs(tmp_path, db, conn, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    p = tmp_path / "min.ini"
    p.write_text(f"[database]\nconninfo = {db}\n[provider.http]\nallow_hosts = 127.0.0.1\n"
                 f"timeout_ms = 2000\n[metrics]\nlisten =\n[dispatcher]\nlease_seconds = 30\n"
                 f"[provider.email]\nserver = 127.0.0.1:2525\ntimeout_ms = 5000\n")
    e = dict(os.environ, AI_ACTIONS_ENABLED="true")
    proc = subprocess.Popen([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--config", str(p)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=e)
    try:
        assert final(conn, eid)["state"] == "completed"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=20)[1].decode()
    assert proc.returncode == 0, out


def test_poll_only_mode_delivers_without_listen(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers({"database": {"poll_only": True}, **http_cfg()})
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert scalar(conn, "SELECT count(*) FROM pg_listening_channels()") == 0
    assert w.proc.poll() is None


def test_notify_wakes_an_idle_worker_quickly(conn, dispatchers, sink):
    kill_switch(conn, True)
    dispatchers({"dispatcher": {"poll_interval_ms": 600000}, **http_cfg()})
    # Let the worker go idle (its first lease found nothing).
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_providers") >= 1, what="registered")
    t0 = time.monotonic()
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid, timeout=5)["state"] == "completed"
    assert time.monotonic() - t0 < 2, "NOTIFY, not the (10 minute) poll"


def test_run_moves_on_when_its_last_effect_completes(conn, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    a = enqueue(conn, "http", sink.url + "/ok?a", {}, key=key)
    b = enqueue(conn, "http", sink.url + "/ok?b", {}, key=key)
    dispatchers(http_cfg())
    final(conn, a)
    final(conn, b)
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,)) == "completed"
    key2 = make_run(conn)
    # Both effects in one statement, as an approval enqueues them: two
    # separate commits let a fast worker complete the run after the first.
    bad = scalar(conn, "WITH e AS (INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                       "VALUES (%s, 'http', %s, '{}'), (%s, 'http', %s, '{}') RETURNING effect_id, target) "
                       "SELECT effect_id FROM e WHERE target LIKE '%%/status/400'",
                 (key2, sink.url + "/ok?c", key2, sink.url + "/status/400"))
    final(conn, bad)
    wait_for(lambda: scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                            (key2,)) == "failed_terminal", what="run failed_terminal")


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


def test_weekly_figures_are_exported_as_metrics(conn, dispatchers, sink):
    import urllib.request
    kill_switch(conn, True)
    for i in range(3):
        enqueue(conn, "http", sink.url + f"/ok?{i}", {})
    port = closed_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"}, **http_cfg()})
    wait_for(lambda: states(conn).get("completed") == 3, what="delivered")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r"^outbox_week_automatic_share (\S+)$", text, re.M)
        return m and float(m.group(1)) == 1.0 and text
    text = wait_for(scrape, what="weekly gauges")
    for name in ("outbox_week_duplicate_delivery_share", "outbox_week_approval_wait_p95_seconds",
                 "outbox_week_validation_failure_share", "outbox_week_retries_exhausted"):
        assert re.search(rf"^{name} ", text, re.M), name


def hold_the_sweep(conn, db):
    """Make the fleet-wide sweep due and hold its row, so that the next
    housekeeping pass waits there until the returned connection lets go."""
    import psycopg2
    query(conn, "UPDATE outbox_sweeps SET last_run = '2000-01-01'")
    holder = psycopg2.connect(db)
    holder.cursor().execute("SELECT 1 FROM outbox_sweeps WHERE id = 1 FOR UPDATE")
    return holder


def sweep_waiting(conn):
    """The pid of the worker backend whose sweep waits on the held row (in
    this test's database: tests run in parallel on one server)."""
    return scalar(conn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE '%%outbox_sweep%%'")


def scrape_metric(port, name):
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_a_slow_housekeeping_pass_spaces_the_next_ones(conn, db, dispatchers):
    """While vacuum is held back the reaper's and the lag gauge's index scans
    walk dead entries; a pass every maintenance_interval_ms would then spend
    a large share of the records connection and of the database's CPU on
    them.  The next pass starts no sooner than ten times the last one's
    duration after it, and it does start."""
    kill_switch(conn, True)
    # The first pass waits at the sweep.
    holder = hold_the_sweep(conn, db)
    port = closed_port()
    # lease_seconds 30: the backoff is capped at half of it.
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"},
                 "dispatcher": {"maintenance_interval_ms": 100, "lease_seconds": 30}, **http_cfg()})

    def metric(name):
        return scrape_metric(port, name)

    wait_for(lambda: sweep_waiting(conn), what="the sweep waiting")
    time.sleep(1.0)   # the pass is slow for this long: the scenario, not a wait
    holder.rollback()
    holder.close()
    wait_for(lambda: (metric("outbox_maintenance_pass_seconds") or 0) >= 1.0, what="the slow pass to end")
    ended = time.monotonic()
    passes = metric("outbox_maintenance_passes_total")
    # At maintenance_interval_ms = 100 there would be some 40 passes in the
    # next four seconds; the backoff allows none before ten seconds.
    time.sleep(4.0)
    assert metric("outbox_maintenance_passes_total") == passes
    wait_for(lambda: metric("outbox_maintenance_passes_total") > passes, timeout=30,
             what="the next pass")
    assert time.monotonic() - ended >= 9.5
    # A fast pass brings the period back to the interval.
    fast = metric("outbox_maintenance_passes_total")
    wait_for(lambda: metric("outbox_maintenance_passes_total") >= fast + 5, timeout=10,
             what="passes at the configured interval again")


def test_a_pass_cut_by_a_lost_connection_does_not_pause_housekeeping(conn, db, dispatchers):
    """The rest of a pass whose connection broke runs after the reconnect;
    timing that pass would charge the outage to housekeeping and pause the
    reaper for ten times as long.  It is not timed: passes resume at the
    configured interval."""
    kill_switch(conn, True)
    holder = hold_the_sweep(conn, db)
    port = closed_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"},
                 "dispatcher": {"maintenance_interval_ms": 500, "lease_seconds": 60},
                 "database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()})

    def passes():
        return scrape_metric(port, "outbox_maintenance_passes_total") or 0.0

    pid = wait_for(lambda: sweep_waiting(conn), what="the sweep waiting")
    time.sleep(2.0)   # the pass has been running this long when its connection breaks
    query(conn, "SELECT pg_terminate_backend(%s)", (pid,))
    holder.rollback()
    holder.close()
    # Timed, the cut pass would allow no pass for some 20 s (and a pass
    # started before its rest answered would hide that: hence 500 ms).
    wait_for(lambda: passes() >= 4, timeout=8, what="passes at the configured interval after the reconnect")
