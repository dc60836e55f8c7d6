# SPDX-License-Identifier: ISC
"""No libcurl transfer of the project honours the proxy environment
variables: with http_proxy, HTTPS_PROXY, ALL_PROXY (every spelling) set to
a loopback listener this test owns and no no_proxy, the http provider's
sends and lookups and the crm provider's upserts and lookups all go
straight to their servers, Authorization headers included, and the
listener is never connected to.

Real workers, real PostgreSQL, the real sink and the local CRM server.
"""
import json
import socket
import threading

import pytest

from crm_server import CrmServer
from outbox_test import effect, enqueue, kill_switch, make_run, query, run_ctl, scalar, wait_for

TOKEN = "00Dxx0000001gPL!AQ4AQProxyTestToken.77"
LOOKUP_AUTH = "Bearer proxy-test-lookup-secret"


class Listener:
    """A loopback TCP listener that counts connections and closes them."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            c.close()

    def stop(self):
        self.sock.close()


@pytest.fixture
def proxy():
    p = Listener()
    yield p
    p.stop()


def proxy_env(port):
    url = f"http://127.0.0.1:{port}"
    env = {name: url for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY",
                                  "ALL_PROXY", "all_proxy")}
    env.update({"no_proxy": None, "NO_PROXY": None})
    return env


def reconcile(db):
    r = run_ctl(["--db", db, "reconcile", "--wait", "30"])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_http_sends_and_lookups_ignore_proxy_variables(conn, dispatchers, db, sink, proxy):
    kill_switch(conn, True)
    dispatchers({"provider.http": {
        "timeout_ms": 800, "reconcile_url": "{origin}/lookup?key={key}",
        "reconcile_targets": sink.url + "/", "reconcile_header": f"Authorization: {LOOKUP_AUTH}",
        "reconcile_min_age_seconds": 3, "reconcile_timeout_ms": 1000}},
        env=proxy_env(proxy.port))
    ok = str(enqueue(conn, "http", f"{sink.url}/ok", {"body": {"n": 1}}))
    wait_for(lambda: effect(conn, ok)["state"] == "completed", what="the send to complete")
    hung = str(enqueue(conn, "http", f"{sink.url}/hang", {"body": {"n": 2}}))
    wait_for(lambda: effect(conn, hung)["state"] == "unknown", what="the hung send to be unknown")
    wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'http'"),
             what="http registered as able to reconcile")
    out = reconcile(db)
    assert "sent: completed" in out, out
    lookups = [r for r in sink.received() if r["path"] == "/lookup"]
    assert len(lookups) == 1 and lookups[0]["headers"]["authorization"] == LOOKUP_AUTH
    assert proxy.connections == 0


def test_crm_upserts_and_lookups_ignore_proxy_variables(conn, dispatchers, db, tmp_path, proxy):
    crm = CrmServer(token=TOKEN).start()
    try:
        token_file = tmp_path / "crm_token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        kill_switch(conn, True)
        # One effect found by the lookup (its record is already there)...
        run = make_run(conn)
        (found_id, found_key), = query(
            conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                  "VALUES (%s, 'crm', 'Task/Outbox_Key__c', %s) "
                  "RETURNING effect_id::text, effect_key", (run, json.dumps({"Subject": "a"})))
        # Unknown after one attempt, as the test arranges it (never due).
        query(conn, "UPDATE effect_live SET state = 'unknown', available_at = 'infinity', "
                    "attempts = 1, last_error_class = 'ambiguous', "
                    "last_error = 'arranged by the test' WHERE effect_id = %s", (found_id,))
        rec = crm.put("Task", "Outbox_Key__c", found_key, {"Subject": "a"})
        # ...and one sent, on another run.
        run2 = make_run(conn)
        (sent_id,), = query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                                  "payload) VALUES (%s, 'crm', 'Task/Outbox_Key__c', %s) "
                                  "RETURNING effect_id::text", (run2, json.dumps({"Subject": "b"})))
        query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key IN (%s, %s)",
              (run, run2))
        dispatchers({"provider.crm": {"instance_url": crm.url, "access_token": f"file:{token_file}",
                                      "timeout_ms": 3000, "connect_timeout_ms": 1000},
                     "provider.http": None, "dispatcher": {"providers": "crm"}},
                    env=proxy_env(proxy.port))
        wait_for(lambda: effect(conn, sent_id)["state"] in ("completed", "failed", "unknown"),
                 what="the upsert to settle")
        assert effect(conn, sent_id)["state"] == "completed", effect(conn, sent_id)
        wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers "
                                      "WHERE name = 'crm'"), what="crm registered")
        out = reconcile(db)
        assert "sent: completed" in out and rec in out, out
        assert proxy.connections == 0
    finally:
        crm.stop()
