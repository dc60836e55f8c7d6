# SPDX-License-Identifier: ISC
"""Bad input from an outside security review, on top of
test_bad_input.py's table and through the same one-worker fleet: SSRF
literal forms, URL control characters, header overrides, IDN and
full-width hosts, CRM path traversal, SMTP smuggling, plus what needs its
own worker (a long header, deep nesting) and the database-side classes
(role escalation, pg_temp hijacks of SECURITY DEFINER functions).

Each row must end `failed` / `invalid` with its specific reason, no
attempt and no request to any server; the worker goes on.
"""
import json
import re
import uuid

import psycopg2
import psycopg2.errors
import pytest

from outbox_test import Dispatcher, attempts, effect, make_run, query, scalar, wait_for
from test_bad_input import CRM, GOOD_EMAIL, HAVE, fleet, need  # noqa: F401 (fixture)

META = "169.254.169.254"
ROWS = [
    # -- SSRF: literal forms of a blocked address (allow-list: 127.0.0.1) ----------------
    ("ssrf-octal", "http", "http://0251.0376.0251.0376/latest", {}, "allow-list"),
    ("ssrf-hex", "http", "http://0xA9FEA9FE/latest", {}, "allow-list"),
    ("ssrf-decimal", "http", "http://2852039166/latest", {}, "allow-list"),
    ("ssrf-short", "http", "http://10.1/x", {}, "allow-list"),
    ("ssrf-mapped", "http", "http://[::ffff:a9fe:a9fe]/latest", {}, "allow-list"),
    ("ssrf-nat64", "http", "http://[64:ff9b::a9fe:a9fe]/latest", {}, "allow-list"),
    ("ssrf-zone-id", "http", "http://[fe80::1%25lo]/x", {}, "allow-list"),
    ("ssrf-trailing-dot", "http", f"http://{META}./latest", {}, "host ends with a dot"),
    ("ssrf-name-dot", "http", "http://localhost./x", {}, "host ends with a dot"),
    ("ssrf-pct-literal", "http", "http://%31%36%39.254.169.254/latest", {}, "allow-list"),
    ("ssrf-userinfo", "http", f"http://127.0.0.1@{META}/latest", {}, "allow-list"),
    ("ssrf-scheme-file", "http", "file:///etc/passwd", {}, "scheme must be http or https"),
    ("ssrf-scheme-gopher", "http", "gopher://127.0.0.1:25/x", {}, "scheme must be http or https"),
    # -- IDN, full-width and percent-encoded hosts ----------------------------------------
    ("idn", "http", "http://b\u00fccher.example/x", {}, "not plain ASCII"),
    ("full-width", "http", "http://\uff11\uff12\uff17.0.0.1/x", {}, "not plain ASCII"),
    ("full-width-dot", "http", "http://127\u30020.0.1/x", {}, "not plain ASCII"),
    ("pct-idn", "http", "http://b%C3%BCcher.example/x", {}, "not plain ASCII"),
    # -- URL control characters ----------------------------------------------------------
    ("url-tab", "http", "{sink}/ok\tx", {}, "control characters"),
    ("url-del", "http", "{sink}/ok\x7f", {}, "control characters"),
    ("url-esc", "http", "{sink}/\x1b[2J", {}, "control characters"),
    ("url-bare-cr", "http", "{sink}/ok\rX: 1", {}, "control characters"),
    # -- header overrides ---------------------------------------------------------------
    ("hdr-host", "http", "{sink}/ok", {"headers": {"Host": "evil.example"}}, "set by the dispatcher"),
    ("hdr-content-length", "http", "{sink}/ok", {"headers": {"Content-Length": "0"}},
     "set by the dispatcher"),
    ("hdr-transfer-encoding", "http", "{sink}/ok", {"headers": {"transfer-encoding": "chunked"}},
     "set by the dispatcher"),
    ("hdr-idempotency-key", "http", "{sink}/ok", {"headers": {"Idempotency-Key": "mine"}},
     "set by the dispatcher"),
    ("hdr-webhook-signature", "http", "{sink}/ok", {"headers": {"webhook-signature": "v1,x"}},
     "set by the dispatcher"),
    ("hdr-webhook-id", "http", "{sink}/ok", {"headers": {"Webhook-Id": "x"}}, "set by the dispatcher"),
    ("hdr-name-colon", "http", "{sink}/ok", {"headers": {"X-A: 1\r\nX-B": "1"}}, "invalid characters"),
    ("hdr-obs-fold", "http", "{sink}/ok", {"headers": {"X-A": "a\r\n b"}}, "CR/LF"),
    # -- CRM path traversal ---------------------------------------------------------------
    ("crm-dotdot", "crm", "../Task/Outbox_Key__c", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("crm-dotdot-field", "crm", "Task/../Outbox_Key__c", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("crm-pct2f", "crm", "Task%2F..%2FUser/Outbox_Key__c", {"Subject": "x"}, "is not an object API name"),
    ("crm-query", "crm", "Task/Outbox_Key__c?x=1", {"Subject": "x"}, "is not a field API name"),
    ("crm-fragment", "crm", "Task/Outbox_Key__c#x", {"Subject": "x"}, "is not a field API name"),
    ("crm-field-slash", "crm", CRM, {"Sub/ject": "x"}, "is not a field API name"),
    # -- SMTP smuggling in the envelope and headers ----------------------------------------
    ("smtp-target-crlf-dot", "email", "bob@example.com\r\n.\r\nMAIL FROM:<x@y>", GOOD_EMAIL,
     "target: contains CR or LF"),
    ("smtp-target-bare-lf", "email", "bob@example.com\nRCPT TO:<eve@example.com>", GOOD_EMAIL,
     "target: contains CR or LF"),
    ("smtp-subject-bare-cr", "email", "bob@example.com",
     dict(GOOD_EMAIL, subject="Hi\rBcc: eve@example.com"), "payload.subject: contains CR or LF"),
    ("smtp-from-crlf", "email", "bob@example.com",
     dict(GOOD_EMAIL, **{"from": "a@example.com\r\nRCPT TO:<eve@example.com>"}), "payload.from"),
]


@pytest.mark.parametrize("name,kind,target,payload,words",
                         [pytest.param(*r, marks=[need(r[1])], id=r[0]) for r in ROWS])
def test_review_input_fails_with_its_reason(fleet, name, kind, target, payload, words):
    before = fleet.traffic()
    bad = fleet.insert(kind, target, payload)
    e = fleet.settled(bad)
    assert e["state"] == "failed" and e["last_error_class"] == "invalid", e
    assert words in e["last_error"], e["last_error"]
    assert e["attempts"] == 0 and attempts(fleet.conn, bad) == []
    assert fleet.traffic() == before, "no server saw the bad row"
    good = fleet.good(kind)
    assert fleet.settled(good)["state"] == "completed"


SMUGGLE_BODIES = {
    "crlf-dot-crlf": "Hi.\r\n.\r\nMAIL FROM:<eve@example.com>\r\nRCPT TO:<eve@example.com>\r\nDATA\r\nx\r\n",
    "bare-lf-dot": "Hi.\n.\nMAIL FROM:<eve@example.com>\n",
    "bare-cr-dot": "Hi.\r.\rMAIL FROM:<eve@example.com>\r",
    "lf-dot-crlf": "Hi.\n.\r\nMAIL FROM:<eve@example.com>\r\n",
}


@need("email")
@pytest.mark.parametrize("name", sorted(SMUGGLE_BODIES))
def test_smtp_smuggling_in_the_body_is_one_message(fleet, name):
    """An end-of-data sequence inside the text is data: the relay gets one
    message (dot-stuffed on the wire), never a second, smuggled one, or the
    row is refused.  Either way nothing reaches eve."""
    before = len(fleet.smtp.messages)
    rcpt = f"smuggle-{uuid.uuid4().hex[:6]}@example.com"
    eid = fleet.insert("email", rcpt, dict(GOOD_EMAIL, text=SMUGGLE_BODIES[name]))
    e = fleet.settled(eid)
    assert e["state"] in ("completed", "failed"), e
    new = fleet.smtp.messages[before:]
    assert all("eve@example.com" not in m["rcpt_tos"] for m in new)
    assert len(new) == (1 if e["state"] == "completed" else 0), new
    if new:
        assert new[0]["rcpt_tos"] == [rcpt]


# -- a worker of its own: limits that need a bigger payload --------------------------------

@need("http")
def test_long_header_and_deep_nesting_fail_clearly_and_nothing_is_cut(db, conn, tmp_path):
    """A 20,000-byte header value was cut to 8,183 bytes
    and sent.  Now it is refused before any attempt; one just under the
    limit arrives whole.  And nesting past jansson's depth says so."""
    from http_sink import Sink
    sink = Sink().start()
    w = Dispatcher(db, tmp_path, {"dispatcher": {"providers": "http", "max_payload_bytes": 100000},
                                  "provider.http": {"allow_hosts": "127.0.0.1"}}, name="long").start()
    try:
        query(conn, "SELECT outbox_kill_switch_set(true, 'test', 'long header')")

        def put(target, text):
            key = make_run(conn)
            return scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                                "payload) VALUES (%s, 'http', %s, %s) RETURNING effect_id",
                          (key, target, text))

        def settled(eid):
            return wait_for(lambda: (lambda e: e if e["state"] not in ("pending", "sending") else None)(
                effect(conn, eid)), what="settled")

        long_ = put(sink.url + "/ok", json.dumps({"headers": {"X-Long": "b" * 20000}}))
        e = settled(long_)
        assert e["state"] == "failed" and e["last_error_class"] == "invalid", e
        assert "header line is longer than 8000 bytes" in e["last_error"], e
        assert e["attempts"] == 0 and sink.count() == 0
        fits = "\u00e9" * ((8000 - len("X-Long: ")) // 2)
        ok = put(sink.url + "/ok", json.dumps({"headers": {"X-Long": fits}}))
        assert settled(ok)["state"] == "completed"
        got = sink.received()[-1]
        sent = got["headers"].get("X-Long", got["headers"].get("x-long"))
        assert sent.encode("latin-1").decode("utf-8") == fits   # whole, not cut
        deep = put(sink.url + "/ok", '{"a": ' + "[" * 3000 + "]" * 3000 + "}")
        e = settled(deep)
        assert e["state"] == "failed" and e["last_error"] == "payload is nested too deeply (limit 2048)", e
        assert w.proc.poll() is None
    finally:
        w.stop()
        sink.stop()


# -- database roles ------------------------------------------------------------------------

ESCALATIONS = [
    "SET ROLE outbox_operator",
    "SET ROLE postgres",
    "ALTER FUNCTION outbox_enqueue(text, text, text, jsonb, jsonb, integer) SECURITY INVOKER",
    "CREATE FUNCTION public.outbox_sha256_hex(t text, u text) RETURNS text LANGUAGE sql AS 'select t'",
    "ALTER TABLE effect_outbox DISABLE TRIGGER effect_outbox_gate",
    "DROP TRIGGER effect_outbox_gate ON effect_outbox",
    "DROP TRIGGER effect_outbox_queue ON effect_outbox",
    "GRANT outbox_operator TO CURRENT_USER",
    "UPDATE workflow_runs SET state = 'processing'",
    "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, expires_at) "
    "VALUES ('x', '\\x00', '{approve}', now())",
    "INSERT INTO effect_history (effect_id, created_at, attempt, started_at, outcome_class, state) "
    "VALUES (gen_random_uuid(), now(), 1, now(), 'accepted', 'completed')",
    "UPDATE effect_live SET state = 'pending', attempts = 0",
    "DELETE FROM effect_live",
    "UPDATE effect_outbox SET target = 'http://127.0.0.1:9/elsewhere'",
    "SELECT outbox_kill_switch_set(true, 'me', 'x')",
    "SELECT * FROM outbox_requeue(gen_random_uuid(), 'me', 'x')",
    "SELECT outbox_replace_ungated(gen_random_uuid(), 'k', 'me', 'x', NULL, NULL)",
    "SELECT outbox_cancel_as(gen_random_uuid(), NULL, 'x', 'me')",
]


@pytest.mark.parametrize("group", ["outbox_producer", "outbox_dispatcher"])
@pytest.mark.parametrize("sql", ESCALATIONS, ids=[s.split("(")[0][:40] for s in ESCALATIONS])
def test_role_escalation_is_refused(login_as, group, sql):
    c = login_as(group)
    with pytest.raises(psycopg2.Error) as e:
        query(c, sql)
    assert e.value.pgcode in ("42501", "42704", "0LP01"), e.value


def test_pg_temp_cannot_hijack_security_definer_functions(conn, login_as):
    """search_path = public, pg_temp on every SECURITY DEFINER function: a
    producer's temporary table or function of the same name is never used."""
    p = login_as("outbox_producer")
    key = make_run(conn)
    query(p, "CREATE TEMP TABLE workflow_runs (idempotency_key text, state text, payload_hash text, "
             "lease_owner uuid, lease_expires_at timestamptz, version bigint, result jsonb, "
             "replaces_key text, failure_reason text, created_at timestamptz, updated_at timestamptz)")
    query(p, "INSERT INTO pg_temp.workflow_runs (idempotency_key, state) VALUES (%s, 'processing')",
          ("fake-run",))
    query(p, "CREATE FUNCTION pg_temp.outbox_sha256_hex(t text) RETURNS text LANGUAGE sql "
             "AS $$ SELECT 'hijacked' $$")
    query(p, "CREATE FUNCTION pg_temp.now() RETURNS timestamptz LANGUAGE sql "
             "AS $$ SELECT 'infinity'::timestamptz $$")
    # The real run is found; the temporary one is not.
    query(p, "SELECT * FROM outbox_enqueue(%s, 'http', 'https://x.example/', '{}')", (key,))
    with pytest.raises(psycopg2.errors.ForeignKeyViolation):
        query(p, "SELECT * FROM outbox_enqueue('fake-run', 'http', 'https://x.example/', '{}')")
    assert scalar(conn, "SELECT effect_key <> 'hijacked' FROM outbox_effects "
                        "WHERE idempotency_key = %s", (key,))
    unpinned = {r[0]: r[1] for r in query(
        conn, "SELECT p.proname, p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
              "WHERE n.nspname = 'public' AND p.prosecdef AND NOT EXISTS ("
              "SELECT 1 FROM unnest(p.proconfig) c WHERE c = 'search_path=public, pg_temp')")}
    # Every SECURITY DEFINER function pins its search_path, but the insert's
    # queue trigger (10_triggers.sql: pinning cost a one-row INSERT ~5 %):
    # it names every table and function with its schema, and no operator.
    assert set(unpinned) <= {"effect_outbox_queue"}, "unpinned search_path: %s" % sorted(unpinned)
    for name, src in unpinned.items():
        body = re.sub(r"--[^\n]*", "", src)
        tables = re.findall(r"\b(?:FROM|INTO|JOIN|UPDATE)\s+([A-Za-z_][\w.]*)", body, re.I)
        assert tables and all(t.startswith("public.") or t == "new_effects" for t in tables), tables
        calls = re.findall(r"([A-Za-z_][\w.]*)\s*\(", body)
        assert all(c.startswith("pg_catalog.") or c.startswith("public.") or c.upper() in
                   ("INSERT", "VALUES", "NULL") or c in ("effect_live",) for c in calls), calls
        assert not re.search(r"[=<>+*/|]", re.sub(r"'[^']*'", "", body)), "an operator in " + name


def test_pg_temp_cannot_hijack_the_insert_trigger(conn, login_as):
    """The one SECURITY DEFINER function without a pinned search_path (the
    plain INSERT's queue trigger) is not reached by a producer's temporary
    tables of the names it uses: the row goes to the real live table."""
    p = login_as("outbox_producer")
    key = make_run(conn)
    query(p, "CREATE TEMP TABLE effect_live (effect_id uuid, effect_type text, created_at timestamptz,"
             " available_at timestamptz)")
    query(p, "CREATE TEMP TABLE new_effects (effect_id uuid, effect_type text, created_at timestamptz,"
             " available_at timestamptz)")
    query(p, "INSERT INTO pg_temp.new_effects VALUES (gen_random_uuid(), 'http', now(), now())")
    query(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
             "VALUES (%s, 'http', 'https://x.example/', '{}')", (key,))
    assert scalar(p, "SELECT count(*) FROM pg_temp.effect_live") == 0
    assert scalar(conn, "SELECT count(*) FROM effect_live l JOIN effect_outbox b USING (effect_id) "
                        "WHERE b.idempotency_key = %s", (key,)) == 1
    assert scalar(conn, "SELECT count(*) FROM effect_live") == 1
