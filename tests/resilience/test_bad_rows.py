# SPDX-License-Identifier: ISC
"""Malformed effect rows through the http provider: each fails with its
specific reason, payloads over the shape and size limits are refused, and
an effect type no worker serves is failed after its grace period.
"""
import pytest

from outbox_test import attempts, enqueue, final, http_cfg, kill_switch


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
