# SPDX-License-Identifier: ISC
"""What a worker logs: every attempt with its fields, never a payload or a
secret, and no password from the conninfo.
"""
import base64
import json

from outbox_test import http_cfg, kill_switch, make_run, query, scalar, states, wait_for


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
    assert a["payload_hash"] == scalar(conn, "SELECT payload_hash FROM outbox_effects")


def test_password_in_conninfo_is_not_logged(db, dispatchers):
    w = dispatchers({"database": {"conninfo": db + " password=hunter2-CANARY"}})
    w.stop()
    assert "hunter2-CANARY" not in w.log()
    assert "********" in w.log()
