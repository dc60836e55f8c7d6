"""The n8n kit (examples/n8n/*.json) without n8n: every workflow file has
the structure n8n 1.x imports, every Postgres node's statement runs against
the migrated schema as the producer role with sample parameters and does
what its step claims, and the Code nodes' JavaScript (validation, pages)
behaves, run with node when it is installed.

Parameters are substituted the way n8n's Postgres node (v2.5, pg-promise)
does it: each $n becomes an escaped literal, never spliced by hand.
"""
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import ROOT, query, scalar

EXAMPLES = os.path.join(ROOT, "examples", "n8n")
FILES = sorted(glob.glob(os.path.join(EXAMPLES, "*.json")))
PRODUCER_CREDENTIAL = "outbox producer"


def load(name):
    with open(os.path.join(EXAMPLES, name + ".json")) as f:
        return json.load(f)


def node(wf, name):
    for n in wf["nodes"]:
        if n["name"] == name:
            return n
    raise KeyError(f"{wf['name']}: no node {name!r}")


# --- structure -------------------------------------------------------------------------

def test_the_four_workflows_are_there():
    names = {os.path.basename(f) for f in FILES}
    assert {"approve-before-act.json", "approval.json", "approve-by-exception.json",
            "act-with-window.json"} <= names


def outputs_of(n):
    """How many main outputs a node has, as n8n wires them."""
    t = n["type"]
    if t == "n8n-nodes-base.switch" and n["parameters"].get("mode") == "expression":
        return n["parameters"]["numberOutputs"]
    if t == "n8n-nodes-base.if":
        return 2
    k = 1
    if n.get("onError") == "continueErrorOutput":
        k += 1
    return k


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_workflow_structure(path):
    with open(path) as f:
        wf = json.load(f)
    assert isinstance(wf.get("name"), str) and wf["name"]
    assert isinstance(wf.get("nodes"), list) and wf["nodes"]
    assert isinstance(wf.get("connections"), dict)
    assert isinstance(wf.get("settings"), dict)
    names = [n["name"] for n in wf["nodes"]]
    assert len(names) == len(set(names)), "node names must be unique"
    ids = [n.get("id") for n in wf["nodes"]]
    assert len(ids) == len(set(ids))
    for n in wf["nodes"]:
        assert isinstance(n.get("parameters"), dict), n["name"]
        assert isinstance(n.get("type"), str) and n["type"].startswith("n8n-nodes-base."), n["name"]
        assert isinstance(n.get("typeVersion"), (int, float)), n["name"]
        pos = n.get("position")
        assert isinstance(pos, list) and len(pos) == 2 and all(isinstance(x, (int, float)) for x in pos)
    by_name = {n["name"]: n for n in wf["nodes"]}
    for src, kinds in wf["connections"].items():
        assert src in by_name, f"connection from unknown node {src!r}"
        outs = kinds["main"]
        assert len(outs) <= outputs_of(by_name[src]), src
        for out in outs:
            for c in out:
                assert c["node"] in by_name, f"{src} -> unknown {c['node']!r}"
                assert c["type"] == "main" and c["index"] == 0
    # Every output of a router is wired: no item is dropped silently (a
    # webhook waiting for its Respond node would hang).
    for n in wf["nodes"]:
        k = outputs_of(n)
        if k > 1:
            outs = wf["connections"].get(n["name"], {"main": []})["main"]
            assert len(outs) == k and all(outs), f"{n['name']}: every output must be connected"


def triggers(wf):
    return [n for n in wf["nodes"] if n["type"] == "n8n-nodes-base.webhook"]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_webhook_path_responds(path):
    """Webhooks answer through a Respond node; every path from a webhook
    reaches one before it ends, and every node is reachable."""
    with open(path) as f:
        wf = json.load(f)
    by_name = {n["name"]: n for n in wf["nodes"]}
    succ = {name: [c["node"] for out in wf["connections"].get(name, {"main": []})["main"] for c in out]
            for name in by_name}
    hooks = triggers(wf)
    assert hooks
    seen = set()
    paths = set()
    for h in hooks:
        p = h["parameters"]
        assert p["responseMode"] == "responseNode"
        assert p["httpMethod"] in ("GET", "POST")
        assert p["path"] and not p["path"].startswith("/")
        assert isinstance(h.get("webhookId"), str)
        assert (p["httpMethod"], p["path"]) not in paths
        paths.add((p["httpMethod"], p["path"]))

        def walk(name, responded, trail):
            seen.add(name)
            assert name not in trail, f"loop through {name}: repairs must be bounded"
            responded = responded or by_name[name]["type"] == "n8n-nodes-base.respondToWebhook"
            if not succ[name]:
                assert responded, f"{' -> '.join(trail + [name])} ends without responding"
            for s in succ[name]:
                walk(s, responded, trail + [name])
        walk(h["name"], False, [])
    assert seen == set(by_name), f"unreachable nodes: {set(by_name) - seen}"


def test_webhook_paths_are_unique_across_workflows():
    seen = {}
    for path in FILES:
        with open(path) as f:
            wf = json.load(f)
        for h in triggers(wf):
            k = (h["parameters"]["httpMethod"], h["parameters"]["path"])
            assert k not in seen, f"{k} in {seen.get(k)} and {path}"
            seen[k] = path


PLACEHOLDER = re.compile(r"\$([1-9][0-9]{0,16})(?![0-9])(\^|~|#|:raw|:alias|:name|:json|:csv|:list|:value)?")


def split_array_expression(expr):
    """'={{ [ a, f(b, c), 'x,y' ] }}' -> ['a', 'f(b, c)', "'x,y'"]."""
    m = re.fullmatch(r"=\{\{\s*\[(.*)\]\s*\}\}", expr, re.S)
    assert m, f"queryReplacement must be an array expression: {expr!r}"
    body, parts, depth, cur, quote = m.group(1), [], 0, "", None
    i = 0
    while i < len(body):
        ch = body[i]
        if quote:
            cur += ch
            if ch == "\\":
                cur += body[i + 1]
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
            cur += ch
        elif ch in "([{":
            depth += 1
            cur += ch
        elif ch in ")]}":
            depth -= 1
            cur += ch
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    if cur.strip():
        parts.append(cur.strip())
    return parts


def postgres_nodes():
    out = []
    for path in FILES:
        with open(path) as f:
            wf = json.load(f)
        for n in wf["nodes"]:
            if n["type"] == "n8n-nodes-base.postgres":
                out.append(pytest.param(wf, n, id=f"{os.path.basename(path)}:{n['name']}"))
    return out


@pytest.mark.parametrize("wf,n", postgres_nodes())
def test_postgres_nodes_use_query_parameters(wf, n):
    p = n["parameters"]
    assert n["typeVersion"] == 2.5
    assert p["operation"] == "executeQuery"
    sql = p["query"]
    assert "{{" not in sql, "no value may be spliced into the SQL text"
    assert ";" not in sql.rstrip().rstrip(";"), "one statement per step"
    assert re.match(r"\s*SELECT\b", sql, re.I)
    used = {int(m.group(1)) for m in PLACEHOLDER.finditer(sql)}
    assert all(m.group(2) is None for m in PLACEHOLDER.finditer(sql)), "no pg-promise filters"
    assert used == set(range(1, max(used) + 1)), f"placeholders {sorted(used)} must be $1..$n"
    args = split_array_expression(p["options"]["queryReplacement"])
    assert len(args) == max(used), f"{len(args)} parameters for {max(used)} placeholders"
    # Every placeholder is cast: the statement does not depend on how a
    # value's type was guessed.
    for m in re.finditer(r"\$[0-9]+(?![0-9])(.{0,2})", sql):
        assert m.group(1) == "::", f"uncast placeholder in {sql!r}"
    cred = n.get("credentials", {}).get("postgres", {})
    assert cred.get("name") == PRODUCER_CREDENTIAL and cred.get("id")


# --- running the statements ----------------------------------------------------------------

def pgp_literal(v):
    """pg-promise's formatting of one value (n8n's Postgres node)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, list):
        return "array[" + ",".join(pgp_literal(x) for x in v) + "]" if v else "'{}'"
    return "'" + json.dumps(v).replace("'", "''") + "'"


def pgp_format(sql, values):
    def sub(m):
        i = int(m.group(1)) - 1
        return pgp_literal(values[i]) if i < len(values) else m.group(0)
    return PLACEHOLDER.sub(sub, sql)


class Step:
    """Runs a workflow's Postgres nodes as n8n would, on one connection."""

    def __init__(self, conn):
        self.conn = conn
        self.wfs = {}

    def __call__(self, workflow, name, *values):
        wf = self.wfs.setdefault(workflow, load(workflow))
        n = node(wf, name)
        sql = n["parameters"]["query"]
        args = split_array_expression(n["parameters"]["options"]["queryReplacement"])
        assert len(values) == len(args), f"{name}: {len(args)} parameters expected"
        with self.conn.cursor() as cur:
            cur.execute(pgp_format(sql, list(values)).replace("%", "%%"))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]


@pytest.fixture
def producer(db, conn):
    """A connection as a LOGIN member of outbox_producer: the role n8n's
    credential uses."""
    name = f"t_n8n_{uuid.uuid4().hex[:8]}"
    query(conn, f'CREATE ROLE "{name}" LOGIN IN ROLE outbox_producer')
    c = psycopg2.connect(db, user=name)
    c.autocommit = True
    yield c
    c.close()
    query(conn, f'DROP ROLE IF EXISTS "{name}"')


@pytest.fixture
def step(producer):
    return Step(producer)


def event(n=1, **kw):
    e = {"source": "crm", "event_id": f"lead-{n}", "email": "lead@example.com",
         "message": "Hello, I would like a quote."}
    e.update(kw)
    return e


def claim(step, wf, ev, lease=300):
    rows = step(wf, "Claim run", f"{ev['source']}:{ev['event_id']}", json.dumps(ev), lease)
    assert len(rows) == 1
    return rows[0]


def lease_of(c):
    return [c["idempotency_key"], c["lease_owner"], str(c["version"])]


def token():
    t = secrets.token_hex(32)
    return t, hashlib.sha256(t.encode()).hexdigest()


EFFECTS = [{"effect_type": "http", "target": "https://helpdesk.example.com/api/replies",
            "payload": {"method": "POST", "body": {"to": "lead@example.com", "text": "Hi"}},
            "metadata": {"workflow": "approve-before-act", "model": "m-1"}}]


@pytest.mark.parametrize("wf", ["approve-before-act", "approve-by-exception", "act-with-window"])
def test_claim_returns_a_lease_once(step, conn, wf):
    ev = event(category="opening_hours")
    first = claim(step, wf, ev)
    assert first["status"] == "claimed" and first["lease_owner"] and first["version"] == 0
    # A duplicate delivery while the first execution works: busy, no lease.
    again = claim(step, wf, ev)
    assert again["status"] == "busy" and again["lease_owner"] is None
    # The payload hash is of the canonical JSON: key order does not matter...
    reordered = json.dumps(dict(reversed(list(ev.items()))))
    assert step(wf, "Claim run", "crm:lead-1", reordered, 300)[0]["status"] == "busy"
    # ...but a changed payload under the same key is refused.
    changed = dict(ev, message="something else")
    assert claim(step, wf, changed)["status"] == "payload_mismatch"
    assert scalar(conn, "SELECT count(*) FROM workflow_runs") == 1
    assert scalar(conn, "SELECT lease_owner::text FROM workflow_runs") == first["lease_owner"]


def test_approve_before_act_to_delivery_queue(step, conn):
    ev = event()
    c = claim(step, "approve-before-act", ev)
    tok, tok_hash = token()
    result = {"draft": {"intent": "reply", "subject": "Quote", "reply": "Hi"}, "validation": "ok"}
    rows = step("approve-before-act", "Create approval", *lease_of(c), tok_hash, 86400,
                json.dumps(EFFECTS), "support-leads@example.com", json.dumps(result))
    assert len(rows) == 1 and rows[0]["approval_id"] and rows[0]["version"] == 1
    # Only the hash reached the database.
    assert bytes(scalar(conn, "SELECT token_hash FROM approvals")).hex() == tok_hash
    assert tok not in scalar(conn, "SELECT string_agg(a::text, '') FROM approvals a")
    # A duplicate delivery now reports the current state and the result.
    dup = claim(step, "approve-before-act", ev)
    assert (dup["status"], dup["state"], dup["result"]) == ("done", "awaiting_human", result)

    # The approval page: shows, changes nothing.
    before = query(conn, "SELECT * FROM approvals")
    peek = step("approval", "Peek approval", tok_hash)
    assert len(peek) == 1
    assert peek[0]["run_state"] == "awaiting_human" and peek[0]["proposed_effects"] == EFFECTS
    assert query(conn, "SELECT * FROM approvals") == before
    # The decision: consumes and enqueues once.
    got = step("approval", "Consume approval", tok_hash, "approve", "alice@example.com")
    assert [(r["decision"], r["effect_type"], r["target"]) for r in got] == \
        [("approve", "http", EFFECTS[0]["target"])]
    assert query(conn, "SELECT state, approved_by, metadata FROM effect_outbox") == \
        [("pending", "alice@example.com", EFFECTS[0]["metadata"])]
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    # A second POST (double click, replay) does nothing.
    assert step("approval", "Consume approval", tok_hash, "approve", "alice@example.com") == []
    assert step("approval", "Consume approval", tok_hash, "reject", "bob@example.com") == []
    assert step("approval", "Peek approval", tok_hash) == []
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 1
    assert claim(step, "approve-before-act", ev)["state"] == "approved"


def test_approval_reject_and_bad_tokens(step, conn):
    ev = event(2)
    c = claim(step, "approve-before-act", ev)
    tok, tok_hash = token()
    step("approve-before-act", "Create approval", *lease_of(c), tok_hash, 60, json.dumps(EFFECTS),
         None, None)
    assert step("approval", "Peek approval", hashlib.sha256(b"guess").hexdigest()) == []
    assert step("approval", "Consume approval", hashlib.sha256(b"guess").hexdigest(), "approve",
                "mallory@example.com") == []
    assert step("approval", "Consume approval", tok_hash, "delete", "alice@example.com") == []
    assert scalar(conn, "SELECT consumed_at FROM approvals") is None
    got = step("approval", "Consume approval", tok_hash, "reject", "alice@example.com")
    assert got == [{"idempotency_key": "crm:lead-2", "decision": "reject", "effect_id": None,
                    "effect_type": None, "target": None}]
    assert scalar(conn, "SELECT state FROM workflow_runs") == "failed_terminal"
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0
    # A re-run of the original execution is told, and does nothing.
    assert claim(step, "approve-before-act", ev)["status"] == "done"


def test_expired_approval_enqueues_nothing(step, conn):
    c = claim(step, "approve-before-act", event(3))
    _, tok_hash = token()
    step("approve-before-act", "Create approval", *lease_of(c), tok_hash, 60, json.dumps(EFFECTS),
         None, None)
    query(conn, "UPDATE approvals SET expires_at = now() - interval '1 second'")
    assert step("approval", "Peek approval", tok_hash) == []
    assert step("approval", "Consume approval", tok_hash, "approve", "alice@example.com") == []
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "awaiting_human"


def test_create_approval_after_losing_the_lease_does_nothing(step, conn):
    c = claim(step, "approve-before-act", event(4))
    _, tok_hash = token()
    stale = [c["idempotency_key"], str(uuid.uuid4()), str(c["version"])]
    assert step("approve-before-act", "Create approval", *stale, tok_hash, 60, json.dumps(EFFECTS),
                None, None) == []
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "processing"


def test_validation_failure_ends_failed_terminal(step, conn):
    ev = event(5)
    c = claim(step, "approve-before-act", ev)
    errs = {"validation_errors": ["intent: one of reply, escalate, ignore"], "model_output": "Sure!"}
    assert step("approve-before-act", "Mark failed_terminal", *lease_of(c), "failed_terminal",
                json.dumps(errs)) == [{"version": 1}]
    again = claim(step, "approve-before-act", ev)
    assert (again["status"], again["state"], again["result"]) == ("done", "failed_terminal", errs)
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0


def test_model_failure_is_retryable(step, conn):
    ev = event(6)
    c = claim(step, "approve-before-act", ev)
    assert step("approve-before-act", "Mark failed_retryable", *lease_of(c), "failed_retryable",
                json.dumps({"error": "model call failed", "detail": "timeout"})) == [{"version": 1}]
    # Re-delivery or a re-run from n8n's history takes it over at once.
    again = claim(step, "approve-before-act", ev)
    assert again["status"] == "reclaimed" and again["version"] == 2 and again["lease_owner"]
    # The old execution's lease is void.
    assert step("approve-before-act", "Mark failed_terminal", *lease_of(c), "failed_terminal",
                "{}") == []


def auto_effect():
    return ("http", "https://helpdesk.example.com/api/replies",
            json.dumps({"method": "POST", "body": {"text": "We are open 9-17."}}),
            json.dumps({"workflow": "approve-by-exception", "approval": "auto:template:opening_hours"}))


def test_approve_by_exception_enqueues_once(step, conn):
    ev = event(7, category="opening_hours")
    c = claim(step, "approve-by-exception", ev)
    rows = step("approve-by-exception", "Approve and enqueue", *lease_of(c),
                json.dumps({"decided": "auto"}), *auto_effect(), 0)
    assert len(rows) == 1 and rows[0]["inserted"] is True and rows[0]["state"] == "pending"
    assert rows[0]["version"] == 1
    st, approved_by, meta = query(conn, "SELECT state, approved_by, metadata FROM effect_outbox")[0]
    assert st == "pending" and approved_by is None
    assert meta["approval"] == "auto:template:opening_hours" and meta["run_version"] == 1
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    # The same statement again (a retried node) is refused by the CAS and
    # enqueues nothing more.
    assert step("approve-by-exception", "Approve and enqueue", *lease_of(c),
                json.dumps({"decided": "auto"}), *auto_effect(), 0) == []
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 1
    assert claim(step, "approve-by-exception", ev)["status"] == "done"


def test_approve_by_exception_without_the_lease_enqueues_nothing(step, conn):
    c = claim(step, "approve-by-exception", event(8, category="opening_hours"))
    stale = [c["idempotency_key"], str(uuid.uuid4()), "0"]
    assert step("approve-by-exception", "Approve and enqueue", *stale, "{}", *auto_effect(), 0) == []
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "processing"


def test_approve_by_exception_escalation_creates_an_approval(step, conn):
    c = claim(step, "approve-by-exception", event(9, category="refund"))
    _, tok_hash = token()
    rows = step("approve-by-exception", "Create approval", *lease_of(c), tok_hash, 3600,
                json.dumps(EFFECTS), "support-leads@example.com", json.dumps({"decided": "escalated"}))
    assert len(rows) == 1
    assert scalar(conn, "SELECT state FROM workflow_runs") == "awaiting_human"
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0


def test_act_with_window_enqueue_and_cancel(step, conn):
    ev = event(10)
    c = claim(step, "act-with-window", ev)
    rows = step("act-with-window", "Approve and enqueue with window", *lease_of(c),
                json.dumps({"decided": "window"}), *auto_effect(), 600)
    assert len(rows) == 1 and rows[0]["inserted"]
    eid = rows[0]["effect_id"]
    assert scalar(conn, "SELECT available_at > now() + interval '590 seconds' FROM effect_outbox")
    # Cancelled before the window closes: never sent.
    assert step("act-with-window", "Cancel effect", eid, "customer changed mind",
                "n8n:alice@example.com") == [{"cancelled": True}]
    st, err = query(conn, "SELECT state, last_error FROM effect_outbox WHERE effect_id = %s", (eid,))[0]
    assert st == "failed" and err.startswith("cancelled")
    assert scalar(conn, "SELECT state FROM workflow_runs") == "failed_terminal"
    assert step("act-with-window", "Cancel effect", eid, "again", "n8n:x") == [{"cancelled": False}]
    assert step("act-with-window", "Cancel effect", str(uuid.uuid4()), "none", "n8n:x") == \
        [{"cancelled": False}]


def test_act_with_window_cannot_cancel_a_sending_effect(step, conn):
    c = claim(step, "act-with-window", event(11))
    eid = step("act-with-window", "Approve and enqueue with window", *lease_of(c), "{}",
               *auto_effect(), 1)[0]["effect_id"]
    query(conn, "UPDATE effect_outbox SET state = 'sending' WHERE effect_id = %s", (eid,))
    assert step("act-with-window", "Cancel effect", eid, "too late", "n8n:x") == [{"cancelled": False}]
    assert scalar(conn, "SELECT state FROM effect_outbox") == "sending"


# --- the Code nodes' JavaScript ---------------------------------------------------------------

NODE = shutil.which("node") or shutil.which("nodejs")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")

HARNESS = r"""
const fs = require('fs');
const { code, nodes, input } = JSON.parse(fs.readFileSync(0, 'utf8'));
const wrap = (arr) => ({ first: () => ({ json: arr[0] }), all: () => arr.map((json) => ({ json })),
                         item: { json: arr[0] } });
const $ = (name) => { if (!(name in nodes)) throw new Error('no node ' + name); return wrap(nodes[name]); };
const $input = wrap(input);
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('$', '$input', code)($, $input)
  .then((r) => process.stdout.write(JSON.stringify(r.map((i) => i.json))))
  .catch((e) => { process.stderr.write(String(e && e.stack || e)); process.exit(1); });
"""


def run_code(workflow, name, nodes=None, input=None):
    wf = load(workflow)
    js = node(wf, name)["parameters"]["jsCode"]
    r = subprocess.run([NODE, "-e", HARNESS], input=json.dumps(
        {"code": js, "nodes": nodes or {}, "input": input or [{}]}), capture_output=True,
        text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 1
    return out[0]


CFG = {"max_subject_chars": 120, "max_reply_chars": 2000, "llm_model": "local-model"}


def model_says(content):
    return [{"model": "m-1", "choices": [{"message": {"content": content}}]}]


@needs_node
@pytest.mark.parametrize("content,valid", [
    ('{"intent": "reply", "subject": "Quote", "reply": "Hi there"}', True),
    ('```json\n{"intent": "escalate", "subject": "S", "reply": "R"}\n```', True),
    ("Sure! Here is a reply: Hi there", False),
    ('{"intent": "buy", "subject": "S", "reply": "R"}', False),
    ('{"intent": "reply", "subject": "S"}', False),
    ('{"intent": "reply", "subject": "S", "reply": "R", "send_now": true}', False),
    ('{"intent": "reply", "subject": "' + "x" * 121 + '", "reply": "R"}', False),
    ('{"intent": "reply", "subject": "S", "reply": "' + "x" * 2001 + '"}', False),
    ('["reply"]', False),
])
def test_validate_draft(content, valid):
    for name in ("Validate draft", "Validate repaired draft"):
        out = run_code("approve-before-act", name, {"Config": [CFG]}, model_says(content))
        assert out["valid"] is valid, (name, out)
        assert bool(out["errors"]) is not valid
        assert (out["draft"] is not None) is valid


@needs_node
def test_validate_draft_without_choices():
    out = run_code("approve-before-act", "Validate draft", {"Config": [CFG]}, [{"error": "x"}])
    assert out["valid"] is False


@needs_node
@pytest.mark.parametrize("workflow,hook", [("approve-before-act", "Lead webhook"),
                                           ("act-with-window", "Schedule webhook")])
def test_check_event(workflow, hook):
    ok = run_code(workflow, "Check event", {hook: [{"body": event()}]})
    assert ok["ok"] and ok["key"] == "crm:lead-1"
    bad = run_code(workflow, "Check event", {hook: [{"body": {"source": "crm x", "email": "nope"}}]})
    assert not bad["ok"] and len(bad["errors"]) == 4


@needs_node
def test_build_approval_effects():
    cfg = dict(CFG, workflow_version="v1", reply_effect_type="http",
               deliver_url="https://helpdesk.example.com/api/replies", reply_from="s@example.com")
    nodes = {"Config": [cfg], "Check event": [{"event": event()}]}
    v = {"draft": {"intent": "reply", "subject": "S", "reply": "R"}, "model": "m-2"}
    out = run_code("approve-before-act", "Build approval", nodes, [v])
    assert len(out["effects"]) == 1
    e = out["effects"][0]
    assert e["effect_type"] == "http" and e["target"] == cfg["deliver_url"]
    assert e["metadata"] == {"workflow": "approve-before-act", "workflow_version": "v1",
                             "model": "m-2", "trigger_source": "webhook:crm"}
    email = run_code("approve-before-act", "Build approval",
                     dict(nodes, Config=[dict(cfg, reply_effect_type="email")]), [v])
    assert email["effects"][0]["effect_type"] == "email"
    assert email["effects"][0]["target"] == "lead@example.com"
    assert set(email["effects"][0]["payload"]) == {"from", "subject", "text"}
    ignore = run_code("approve-before-act", "Build approval", nodes,
                      [dict(v, draft=dict(v["draft"], intent="ignore"))])
    assert ignore["effects"] == []


@needs_node
def test_approval_page_escapes_and_changes_nothing():
    evil = [{"effect_type": "http", "target": "https://x/<script>",
             "payload": {"text": "<img src=x onerror=alert(1)>"}}]
    nodes = {"Config": [{"decision_url": "https://n8n.example.com/webhook/outbox/approval/decide"}],
             "Approval page": [{"query": {"token": 'abc"><script>'}}]}
    row = {"idempotency_key": "crm:<b>1</b>", "allowed_decisions": ["approve", "reject"],
           "expires_at": "2030-01-01T00:00:00Z", "approver_audience": "leads",
           "proposed_effects": evil, "run_state": "awaiting_human"}
    out = run_code("approval", "Render page", nodes, [row])
    assert out["found"] is True
    html = out["html"]
    assert "<script>" not in html and "<img" not in html and "<b>1</b>" not in html
    assert 'method="post"' in html and 'value="approve"' in html and 'value="reject"' in html
    none = run_code("approval", "Render page", nodes, [{}])
    assert none["found"] is False and "Nothing was sent" in none["html"]


@needs_node
def test_identify_approver_needs_the_sso_header():
    cfg = {"Config (decision)": [{"approver_header": "X-Auth-Request-Email"}]}
    good = run_code("approval", "Identify approver", dict(cfg, **{"Approval decision": [
        {"headers": {"x-auth-request-email": "alice@example.com"},
         "body": {"token": "t", "decision": "approve"}}]}))
    assert good["ok"] and good["approver"] == "alice@example.com"
    anon = run_code("approval", "Identify approver", dict(cfg, **{"Approval decision": [
        {"headers": {}, "body": {"token": "t", "decision": "approve", "approver": "ceo@example.com"}}]}))
    assert not anon["ok"] and anon["approver"] == ""
    odd = run_code("approval", "Identify approver", dict(cfg, **{"Approval decision": [
        {"headers": {"x-auth-request-email": "a@example.com"}, "body": {"token": "t", "decision": "delete"}}]}))
    assert not odd["ok"]


@needs_node
def test_summarize_decision():
    rows = [{"idempotency_key": "k", "decision": "approve", "effect_id": "e1", "effect_type": "http",
             "target": "https://x"}]
    out = run_code("approval", "Summarize decision", {}, rows)
    assert out["consumed"] and out["decision"] == "approve" and len(out["effects"]) == 1
    # alwaysOutputData turns "no row" into one empty item.
    none = run_code("approval", "Summarize decision", {}, [{}])
    assert none["consumed"] is False and "Nothing was queued or sent" in none["html"]


@needs_node
def test_auto_rules():
    cfg = {"auto_categories": "opening_hours,password_reset", "auto_max_message_chars": 500,
           "workflow_version": "v1", "reply_effect_type": "http",
           "deliver_url": "https://helpdesk.example.com/api/replies", "reply_from": "s@example.com"}
    def rules(**kw):
        return run_code("approve-by-exception", "Apply rules",
                        {"Config": [cfg], "Check event": [{"event": event(**kw)}]})
    yes = rules(category="opening_hours")
    assert yes["auto"] and yes["effect"]["metadata"]["approval"] == "auto:template:opening_hours"
    assert not rules(category="refund")["auto"]
    assert not rules(category="opening_hours", customer_tier="enterprise")["auto"]
    assert not rules(category="opening_hours", message="x" * 501)["auto"]
    assert not rules(category="opening_hours", attachments=["a.pdf"])["auto"]
