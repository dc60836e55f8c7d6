# SPDX-License-Identifier: ISC
"""Bad input across every kind: a table of malformed rows for the
http, email and crm providers, run through one real worker that serves all
three.  Each row must end `failed` with a specific reason, without an
attempt and without reaching its server, and the worker must keep working:
after every bad row a good effect of the same kind is delivered.

Also: what PostgreSQL itself refuses at insert.  jsonb holds only valid
UTF-8 and refuses \\u0000 and lone surrogates, a text column refuses
invalid bytes, and even a SQL_ASCII database (which would store any byte)
refuses them here, because the generated effect_key and payload_hash
columns convert to UTF-8.  So non-UTF-8 text can never reach a worker
through the table; control characters written as JSON escapes can, and are
in the table below.

tests/resilience/test_bad_rows.py has the http provider's own cases; test_email.py
and test_crm.py have each provider's full validation lists.  This file is
the cross-kind view: the same kind of mistake made for every provider.
"""
import json
import os
import uuid

import psycopg2
import pytest

from outbox_test import (BUILD_DIR, ROOT, Dispatcher, admin_dsn, attempts, connect, dsn_for, effect,
                         make_run, query, run_ctl, run_state, scalar, wait_for)

SERVERS = os.path.join(ROOT, "tests", "servers")

TOKEN = "00Dbad!AQ4AQBadInputTestToken"
LIMIT = 2048


def _have(kind, server):
    return (os.path.exists(os.path.join(BUILD_DIR, "providers", f"outbox_{kind}.so")) and
            os.path.exists(os.path.join(SERVERS, server)))


HAVE = {"http": _have("http", "http_sink.py"), "email": _have("email", "smtp_server.py"),
        "crm": _have("crm", "crm_server.py")}


def need(kind):
    return pytest.mark.skipif(not HAVE[kind], reason=f"the {kind} provider or its test server is "
                                                     f"not committed yet (no outbox_{kind}.so or "
                                                     f"tests/servers file)")


GOOD_EMAIL = {"from": "Outbox <noreply@example.com>", "subject": "Hello", "text": "Hi.\n"}


def email(**kw):
    p = dict(GOOD_EMAIL)
    p.update(kw)
    return {k: v for k, v in p.items() if v is not DROP}


DROP = object()
BIG = "x" * (LIMIT + 100)
CRM = "Task/Outbox_Key__c"

# kind, target ({sink} is the HTTP sink's URL), payload (a JSON value, or
# RAW(text) for JSON written by hand), words the stored reason must contain.


class RAW(str):
    pass


BAD = [
    # -- wrong JSON types: the payload itself -----------------------------------
    ("http", "{sink}/ok", "just a string", "payload must be a JSON object"),
    ("http", "{sink}/ok", None, "payload must be a JSON object"),
    ("email", "bob@example.com", [GOOD_EMAIL], "payload must be a JSON object"),
    ("email", "bob@example.com", 42, "payload must be a JSON object"),
    ("crm", CRM, [1, 2], "payload must be a JSON object"),
    ("crm", CRM, True, "payload must be a JSON object"),
    # -- wrong JSON types: a field -----------------------------------------------
    ("http", "{sink}/ok", {"method": ["POST"]}, "payload.method must be one of"),
    ("http", "{sink}/ok", {"method": "post"}, "payload.method must be one of"),
    ("http", "{sink}/ok", {"headers": ["X-A", "1"]}, "payload.headers must be an object of strings"),
    ("http", "{sink}/ok", {"headers": {"X-A": None}}, "payload.headers.X-A must be a string"),
    ("email", "bob@example.com", email(**{"from": ["a@example.com"]}),
     "payload.from: must be a string"),
    ("email", "bob@example.com", email(text={"plain": "x"}), "payload.text: must be a string"),
    ("email", "bob@example.com", email(headers="X-A: 1"), "payload.headers: must be an object"),
    ("crm", CRM, {"Subject": ["a", "b"]}, "must be a string, number, boolean or null"),
    ("crm", CRM, {"Subject": {"text": "a"}}, "must be a string, number, boolean or null"),
    # -- missing fields -----------------------------------------------------------
    ("email", "bob@example.com", email(**{"from": DROP}), "payload.from: required"),
    ("email", "bob@example.com", email(subject=DROP), "payload.subject: required"),
    ("email", "bob@example.com", {}, "payload.from: required"),
    ("crm", "Task", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("crm", "Task/", {"Subject": "x"}, "is not a field API name"),
    # -- unknown fields / effect types ------------------------------------------------
    ("email", "bob@example.com", email(bcc="eve@example.com"), "payload.bcc: unknown key"),
    ("sms", "+15555550100", {"text": "hi"}, 'unknown effect type "sms"'),
    ("HTTP", "{sink}/ok", {}, 'unknown effect type "HTTP"'),
    ("", "{sink}/ok", {}, 'unknown effect type ""'),
    # -- over the size limit (max_payload_bytes = 2048) ---------------------------------
    ("http", "{sink}/ok", {"body": BIG}, f"over the limit of {LIMIT}"),
    ("email", "bob@example.com", email(text=BIG), f"over the limit of {LIMIT}"),
    ("crm", CRM, {"Description": BIG}, f"over the limit of {LIMIT}"),
    # -- invalid URL or address --------------------------------------------------------
    ("http", "http://", {}, "not a valid URL"),
    ("http", "javascript:alert(1)", {}, "not a valid URL"),
    ("http", "http://127.0.0.1:99999/x", {}, "not a valid URL"),
    ("http", "https://exa mple.com/", {}, "not a valid URL"),
    ("http", "", {}, "not a valid URL"),
    ("email", "bob@@example.com", GOOD_EMAIL, "target: the recipient address"),
    ("email", "", GOOD_EMAIL, "target: the recipient address"),
    ("email", "bob@example..com", GOOD_EMAIL, "target: the recipient address has an invalid domain"),
    ("email", "bob@example.com", email(**{"from": "nobody"}), "payload.from: the address"),
    ("crm", "", {"Subject": "x"}, "must be Object/ExternalIdField"),
    ("crm", "1Task/Outbox_Key__c", {"Subject": "x"}, "is not an object API name"),
    ("crm", "Task/Outbox-Key", {"Subject": "x"}, "is not a field API name"),
    # -- CR/LF: headers, subjects, targets ------------------------------------------------
    ("http", "{sink}/ok\r\nX-Injected: 1", {}, "control characters"),
    ("http", "{sink}/ok", {"headers": {"X-Trace": "a\nSet-Cookie: x=1"}}, "contains CR/LF"),
    ("http", "{sink}/ok", {"headers": {"X-A\r\nX-B": "1"}}, "has invalid characters"),
    ("email", "bob@example.com", email(subject="Hi\r\nBcc: eve@example.com"),
     "payload.subject: contains CR or LF"),
    ("email", "bob@example.com\r\nRCPT TO:<eve@example.com>", GOOD_EMAIL, "target: contains CR or LF"),
    ("email", "bob@example.com", email(headers={"X-Tag": "v\rBcc: eve@example.com"}),
     "payload.headers.X-Tag: contains CR, LF or NUL"),
    ("crm", "Task/Outbox_Key__c\r\nX-A: 1", {"Subject": "x"}, "is not a field API name"),
    ("crm", CRM, {"Sub\r\nject": "x"}, "is not a field API name"),
    # -- control characters written as JSON escapes (valid UTF-8, so jsonb keeps them)
    ("http", "{sink}/ok", RAW('{"headers": {"X-A": "bell\\u0007"}}'), "control characters"),
    ("email", "bob@example.com", RAW('{"from": "a@example.com", "subject": "esc\\u001b[31m", "text": "t"}'),
     "payload.subject: contains control characters"),
    ("email", "bob@example.com", RAW('{"from": "a@example.com", "subject": "s", "text": "t", '
                                     '"headers": {"X-A": "del\\u007f"}}'),
     "payload.headers.X-A: contains control characters"),
    # -- targets outside the allow-list (only 127.0.0.1 is listed) ------------------------
    ("http", "http://[::1]:9/x", {}, "allow-list"),
    ("http", "http://192.168.1.10/x", {}, "allow-list"),
    ("http", "http://[::ffff:169.254.169.254]/latest/meta-data", {}, "allow-list"),
    ("http", "http://0.0.0.0:9/x", {}, "allow-list"),
]


def _id(row):
    kind, target, payload, words = row
    t = target.replace("{sink}", "").replace("\r", "\\r").replace("\n", "\\n")[:24]
    return f"{kind or 'empty-type'}:{t}:{words[:40]}"


def _param(row):
    kind, _, payload, _ = row
    marks = [need(kind)] if kind in HAVE else [need("http")]
    return pytest.param(*row, marks=marks, id=_id(row))


# -- one fleet of one worker for the module: servers, database, worker --------------

class Fleet:
    def __init__(self, dsn, tmp):
        self.dsn = dsn
        self.conn = connect(dsn)
        self.sink = self.smtp = self.crm = None
        cfg = {"dispatcher": {"max_payload_bytes": LIMIT, "unknown_type_grace_seconds": 0,
                              "maintenance_interval_ms": 200, "poll_interval_ms": 200},
               "provider.http": None}
        fast = {"backoff_base_ms": 10, "backoff_cap_ms": 50, "max_attempts": 3, "timeout_ms": 3000,
                "connect_timeout_ms": 1000}
        kinds = []
        if HAVE["http"]:
            from http_sink import Sink
            self.sink = Sink().start()
            cfg["provider.http"] = dict(fast, allow_hosts="127.0.0.1")
            kinds.append("http")
        if HAVE["email"]:
            from smtp_server import SmtpServer
            self.smtp = SmtpServer()
            self.smtp.start()
            cfg["provider.email"] = dict(fast, server=f"127.0.0.1:{self.smtp.port}", starttls="off")
            kinds.append("email")
        if HAVE["crm"]:
            from crm_server import CrmServer
            self.crm = CrmServer(token=TOKEN).start()
            tok = tmp / "crm_token"
            tok.write_text(TOKEN + "\n")
            tok.chmod(0o600)
            cfg["provider.crm"] = dict(fast, instance_url=self.crm.url, access_token=f"file:{tok}")
            kinds.append("crm")
        cfg["dispatcher"]["providers"] = ",".join(kinds)
        self.kinds = kinds
        query(self.conn, "SELECT outbox_kill_switch_set(true, 'test', 'bad input')")
        self.worker = Dispatcher(dsn, tmp, cfg, name="bad-input").start()

    def url(self):
        return self.sink.url if self.sink else "http://127.0.0.1:9"

    def insert(self, kind, target, payload):
        key = make_run(self.conn)
        text = payload if isinstance(payload, RAW) else json.dumps(payload)
        return str(scalar(self.conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                                     "payload) VALUES (%s, %s, %s, %s) RETURNING effect_id",
                          (key, kind, target.replace("{sink}", self.url()), text)))

    def settled(self, eid, timeout=20):
        return wait_for(lambda: (lambda e: e if e["state"] not in ("pending", "sending") else None)(
            effect(self.conn, eid)), timeout=timeout, what=f"effect {eid} to settle")

    def traffic(self):
        return ((self.sink.count() if self.sink else 0) +
                (len(self.smtp.transactions) if self.smtp else 0) +
                (len(self.crm.requests) if self.crm else 0))

    def good(self, kind):
        n = uuid.uuid4().hex[:8]
        if kind == "email":
            return self.insert("email", f"good-{n}@example.com", GOOD_EMAIL)
        if kind == "crm":
            return self.insert("crm", CRM, {"Subject": f"good {n}"})
        return self.insert("http", "{sink}/ok?" + n, {"body": {"n": n}})

    def stop(self):
        self.worker.stop()
        self.conn.close()
        for s in (self.sink, self.crm):
            if s:
                s.stop()
        if self.smtp:
            self.smtp.stop()


@pytest.fixture(scope="module")
def fleet(template_db, tmp_path_factory):
    name = "bad_" + uuid.uuid4().hex[:12]
    c = psycopg2.connect(admin_dsn())
    c.autocommit = True
    with c.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    f = Fleet(dsn_for(name), tmp_path_factory.mktemp("bad_input"))
    yield f
    f.stop()
    with c.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    c.close()


@pytest.mark.parametrize("kind,target,payload,words", [_param(r) for r in BAD])
def test_malformed_row_fails_with_its_reason_and_the_worker_goes_on(fleet, kind, target, payload,
                                                                    words):
    before = fleet.traffic()
    bad = fleet.insert(kind, target, payload)
    e = fleet.settled(bad)
    assert e["state"] == "failed", e
    assert e["last_error_class"] == "invalid", e
    assert words in e["last_error"], e["last_error"]
    assert e["attempts"] == 0 and attempts(fleet.conn, bad) == [], "nothing was sent"
    assert fleet.traffic() == before, "no server saw the bad row"
    # The run it belonged to is over.
    assert run_state(fleet.conn, scalar(fleet.conn, "SELECT idempotency_key FROM effect_outbox "
                                                    "WHERE effect_id = %s", (bad,))) == "failed_terminal"
    # The worker keeps working: a good effect of the same kind goes through.
    good = fleet.good(kind if kind in fleet.kinds else fleet.kinds[0])
    assert fleet.settled(good)["state"] == "completed"
    assert fleet.worker.proc.poll() is None


@need("crm")
def test_crlf_in_a_crm_field_value_is_data_not_an_injection(fleet):
    """The crm provider sends JSON: CR/LF inside a value is escaped by the
    encoder, so it is delivered as written (unlike a header or a subject)."""
    eid = fleet.insert("crm", CRM, {"Description": "line 1\r\nX-Injected: 1"})
    e = fleet.settled(eid)
    assert e["state"] == "completed", e
    key = scalar(fleet.conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert fleet.crm.record("Task", "Outbox_Key__c", key)["Description"] == "line 1\r\nX-Injected: 1"


def test_the_whole_table_at_once_in_one_lease_batch(fleet):
    """Every bad row of the kinds available, plus a good effect of each kind,
    enqueued together so they share lease batches: each bad row fails with
    its own reason, every good one is delivered once."""
    before = fleet.traffic()
    kinds = set(fleet.kinds)
    rows = [r for r in BAD if r[0] in kinds or r[0] not in HAVE]
    bad = [(fleet.insert(*r[:3]), r[3]) for r in rows]
    good = [fleet.good(k) for k in fleet.kinds for _ in range(3)]
    for eid, words in bad:
        e = fleet.settled(eid)
        assert e["state"] == "failed" and words in e["last_error"], (words, e)
        assert e["attempts"] == 0
    for eid in good:
        assert fleet.settled(eid)["state"] == "completed"
    assert fleet.traffic() - before == len(good)
    assert fleet.worker.proc.poll() is None
    # A row of a type no worker serves is failed by the sweep, and logged
    # once the sweep's answer is back: after the state seen above.
    wait_for(lambda: {e["effect_id"] for e in fleet.worker.events()
                      if e.get("event") == "effect_invalid"} >= {eid for eid, _ in bad},
             what="an effect_invalid line for every bad row")
    invalid = [e for e in fleet.worker.events() if e.get("event") == "effect_invalid"]
    assert {e["effect_id"] for e in invalid} >= {eid for eid, _ in bad}, "every refusal is logged"


# -- what PostgreSQL refuses before a worker could see it ------------------------------

REFUSED = [
    # (target SQL, payload SQL, SQLSTATE)
    ("'bob@example.com'", r"""'{"subject": "a\u0000b"}'""", "22P05"),        # NUL escape
    ("'bob@example.com'", r"""'{"subject": "\ud800"}'""", "22P02"),          # lone high surrogate
    ("'bob@example.com'", r"""'{"subject": "\udc00x"}'""", "22P02"),         # lone low surrogate
    ("'bob@example.com'", r"""'{"subject": "\ud800\u0041"}'""", "22P02"),    # high + non-low
    (r"E'bob\xff@example.com'", "'{}'", "22021"),                            # invalid byte in target
    (r"E'bob\xc3\x28@example.com'", "'{}'", "22021"),                        # invalid 2-byte sequence
    ("'bob@example.com'", r"""E'{"subject": "\xed\xa0\x80"}'""", "22021"),   # CESU surrogate bytes
    ("'bob@example.com'", r"""E'{"subject": "\xc0\xaf"}'""", "22021"),       # overlong '/'
    ("'bob@example.com'", "'{\"subject\": '", "22P02"),                      # not JSON at all
    ("'bob@example.com'", "NULL", "23502"),                                   # no payload
    ("NULL", "'{}'", "23502"),                                                # no target
]


@pytest.mark.parametrize("target,payload,state", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_postgresql_refuses_at_insert(conn, target, payload, state):
    key = make_run(conn)
    with pytest.raises(psycopg2.Error) as ei:
        query(conn, f"INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    f"VALUES (%s, 'email', {target}, {payload})", (key,))
    assert ei.value.pgcode == state, ei.value
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0


def test_unknown_run_and_duplicate_effect_are_refused(conn):
    with pytest.raises(psycopg2.Error) as ei:
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "VALUES ('no-such-run', 'http', 'http://127.0.0.1/x', '{}')")
    assert ei.value.pgcode == "23503"
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "VALUES (%s, 'http', 'http://127.0.0.1/x', '{}')", (key,))
    with pytest.raises(psycopg2.Error) as ei:
        query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "VALUES (%s, 'http', 'http://127.0.0.1/x', '{\"other\": 1}')", (key,))
    assert ei.value.pgcode == "23505"


@pytest.fixture
def sql_ascii_db():
    name = "asc_" + uuid.uuid4().hex[:12]
    c = psycopg2.connect(admin_dsn())
    c.autocommit = True
    with c.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
                    f"TEMPLATE template0")
    r = run_ctl(["--db", dsn_for(name), "migrate"])
    assert r.returncode == 0, r.stderr
    yield dsn_for(name)
    with c.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    c.close()


@pytest.mark.parametrize("target,payload,state", [
    (r"E'bob\xff@example.com'", "'{}'", "22021"),
    ("'bob@example.com'", r"""E'{"subject": "s\xff"}'""", "22021"),
    ("'bob@example.com'", r"""'{"subject": "\u00e9"}'""", "0A000"),
], ids=["raw-byte-target", "raw-byte-payload", "non-ascii-escape"])
def test_a_sql_ascii_database_refuses_non_utf8_too(sql_ascii_db, target, payload, state):
    """SQL_ASCII stores any byte, but the generated effect_key and
    payload_hash columns convert to UTF-8 and refuse what is not."""
    c = connect(sql_ascii_db)
    try:
        key = make_run(c)
        with pytest.raises(psycopg2.Error) as ei:
            query(c, f"INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                     f"VALUES (%s, 'email', {target}, {payload})", (key,))
        assert ei.value.pgcode == state, ei.value
        assert scalar(c, "SELECT count(*) FROM outbox_effects") == 0
    finally:
        c.close()
