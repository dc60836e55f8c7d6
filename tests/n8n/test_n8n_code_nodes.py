# SPDX-License-Identifier: ISC
"""The n8n kit's Code nodes (examples/n8n/*.json) without n8n, run with node
when it is installed: event checks, validation of the model's draft, the
pages, the approver check, the automatic-approval rules, and the query
parameters and request bodies they build, fed to the workflows' own
statements as the producer role.  Structure and statements:
tests/test_n8n_examples.py.
"""
import json
import shutil
import subprocess

import pytest

from outbox_test import query, scalar
from test_n8n_examples import (claim, event, load, node, producer, step, token)  # noqa: F401

# --- the Code nodes' JavaScript ---------------------------------------------------------------

NODE = shutil.which("node") or shutil.which("nodejs")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")

HARNESS = r"""
const fs = require('fs');
const { code, nodes, input, prev } = JSON.parse(fs.readFileSync(0, 'utf8'));
const wrap = (arr) => ({ first: () => ({ json: arr[0] }), all: () => arr.map((json) => ({ json })),
                         item: { json: arr[0] } });
const $ = (name) => { if (!(name in nodes)) throw new Error('no node ' + name); return wrap(nodes[name]); };
const $input = wrap(input);
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('$', '$input', '$prevNode', code)($, $input, prev ? { name: prev } : undefined)
  .then((r) => process.stdout.write(JSON.stringify(r.map((i) => i.json))))
  .catch((e) => { process.stderr.write(String(e && e.stack || e)); process.exit(1); });
"""


def run_js(js, nodes=None, input=None, prev=None):
    return subprocess.run([NODE, "-e", HARNESS], input=json.dumps(
        {"code": js, "nodes": nodes or {}, "input": input or [{}], "prev": prev}, default=str),
        capture_output=True, text=True, timeout=30)


def run_code(workflow, name, nodes=None, input=None, prev=None):
    r = run_js(node(load(workflow), name)["parameters"]["jsCode"], nodes, input, prev)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 1
    return out[0]


CFG = {"max_subject_chars": 120, "max_reply_chars": 2000, "llm_model": "local-model"}


def config_of(workflow, name="Config"):
    """The Config node's values as the workflow file ships them."""
    return {a["name"]: a["value"]
            for a in node(load(workflow), name)["parameters"]["assignments"]["assignments"]}


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
@pytest.mark.parametrize("answer", [
    {"data": "<html><body>502 Bad Gateway</body></html>"},   # a 200 text page, as n8n hands it on
    {"error": "x"},
    {"choices": "none"},
])
def test_validate_draft_fails_the_call_when_the_answer_is_no_chat_completion(answer):
    """A 200 whose body is not the model's JSON (a proxy's HTML page) is a
    failed call, like a 500 or a truncated body: the node fails (its error
    output releases the run as failed_retryable), it is not bad output to
    repair and close as failed_terminal."""
    for name in ("Validate draft", "Validate repaired draft"):
        r = run_js(node(load("approve-before-act"), name)["parameters"]["jsCode"],
                   {"Config": [CFG]}, [answer])
        assert r.returncode != 0 and "not a chat completion" in r.stderr, (name, r.stdout, r.stderr)


@needs_node
def test_validate_draft_without_content_is_bad_output():
    out = run_code("approve-before-act", "Validate draft", {"Config": [CFG]},
                   [{"model": "m", "choices": [{"message": {"refusal": "no"}}]}])
    assert out["valid"] is False and out["errors"] == ["output is not JSON"]


@needs_node
@pytest.mark.parametrize("workflow,hook", [("approve-before-act", "Lead webhook"),
                                           ("act-with-window", "Schedule webhook")])
def test_check_event(workflow, hook):
    cfg = {"Config": [config_of(workflow)]}
    ok = run_code(workflow, "Check event", dict(cfg, **{hook: [{"body": event()}]}))
    assert ok["ok"] and ok["key"] == "crm:lead-1"
    assert ok["params"] == ["crm:lead-1", json.dumps(event(), separators=(",", ":")), 300]
    bad = run_code(workflow, "Check event", dict(cfg, **{hook: [{"body": {"source": "crm x", "email": "nope"}}]}))
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
    # Where each goes: signed in and well-formed on, not signed in 401, a
    # bad form (decision=delete) 400.
    wf = load("approval")
    router = node(wf, "Signed in and well-formed?")
    expr = router["parameters"]["output"]
    assert expr.startswith("={{") and expr.endswith("}}")
    outs = wf["connections"][router["name"]]["main"]
    codes = []
    for item in (good, anon, odd):
        js = "return [{ json: { k: (" + expr[3:-2].replace("$json", "$input.first().json") + ") } }];"
        r = run_js(js, input=[item])
        assert r.returncode == 0, r.stderr
        target = node(wf, outs[json.loads(r.stdout)[0]["k"]][0]["node"])
        codes.append(target["parameters"]["options"].get("responseCode")
                     if target["type"] == "n8n-nodes-base.respondToWebhook" else target["name"])
    assert codes == ["Hash token (decision)", 401, 400]


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


# --- the Code nodes build what each statement and request takes -------------------------------

def pg_row(row):
    """A row as n8n's Postgres node hands it on (bigint as text, uuids as
    text, timestamps as ISO text)."""
    return {k: (str(v) if isinstance(v, (int,)) and k == "version" else v) for k, v in row.items()}


@needs_node
def test_approve_before_act_code_builds_every_parameter(step, conn):
    wf = "approve-before-act"
    cfg = config_of(wf)
    nodes = {"Config": [cfg], "Lead webhook": [{"body": event(30)}]}
    ev = run_code(wf, "Check event", nodes)
    c = pg_row(step(wf, "Claim run", *ev["params"])[0])
    assert c["status"] == "claimed"
    nodes.update({"Check event": [ev], "Claim run": [c]})
    # The model's request is an object, the user's message as it came.
    req = run_code(wf, "Model request", nodes)["body"]
    assert req["model"] == cfg["llm_model"] and req["messages"][1]["content"] == event(30)["message"]
    assert '{"intent": "reply" | "escalate" | "ignore"' in req["messages"][0]["content"]
    bad = run_code(wf, "Validate draft", {"Config": [cfg]}, model_says("Sure!"))
    nodes["Model request"] = [{"body": req}]
    rep = run_code(wf, "Repair request", nodes, [bad])["body"]
    assert [m["role"] for m in rep["messages"]] == ["system", "user", "assistant", "user"]
    assert rep["messages"][2]["content"] == "Sure!" and "not JSON" in rep["messages"][3]["content"]
    # Approval: parameters from the Code node, statement as the producer.
    v = run_code(wf, "Validate draft", {"Config": [cfg]},
                 model_says('{"intent": "reply", "subject": "Quote", "reply": "Hi"}'))
    b = run_code(wf, "Build approval", dict(nodes, Config=[dict(cfg, deliver_url="https://h.example.com/r")]), [v])
    nodes["Build approval"] = [b]
    tok, tok_hash = token()
    p = run_code(wf, "Approval parameters", nodes, [{"approval_token": tok, "token_sha256": tok_hash}])
    created = step(wf, "Create approval", *p["params"])
    assert len(created) == 1 and scalar(conn, "SELECT state FROM workflow_runs") == "awaiting_human"
    nodes.update({"Create approval": [pg_row(created[0])], "Generate token": [{"approval_token": tok}]})
    msg = run_code(wf, "Approval message", nodes, [pg_row(created[0])])["body"]
    assert msg["approval_url"] == cfg["approval_page_url"] + "?token=" + tok and msg["key"] == "crm:lead-30"


@needs_node
def test_a_failed_step_releases_the_run(step, conn):
    wf = "approve-before-act"
    c = pg_row(claim(step, wf, event(31)))
    p = run_code(wf, "Retryable parameters", {"Claim run": [c]},
                 [{"error": "permission denied for function outbox_create_approval"}], prev="Create approval")
    assert p["failed_step"] == "Create approval"
    assert step(wf, "Mark failed_retryable", *p["params"]) == \
        [{"version": 1, "idempotency_key": "crm:lead-31", "failed_step": "Create approval"}]
    st, result = query(conn, "SELECT state, result FROM workflow_runs")[0]
    assert st == "failed_retryable" and result["failed_step"] == "Create approval"
    assert "permission denied" in result["detail"]
    assert claim(step, wf, event(31))["status"] == "reclaimed"


@needs_node
@pytest.mark.parametrize("wf", ["approve-by-exception", "act-with-window"])
def test_direct_enqueue_code_builds_every_parameter(step, conn, wf):
    cfg = config_of(wf)
    hook = {"approve-by-exception": "Ticket webhook", "act-with-window": "Schedule webhook"}[wf]
    nodes = {"Config": [cfg], hook: [{"body": event(32, category="opening_hours")}]}
    ev = run_code(wf, "Check event", nodes)
    c = pg_row(step(wf, "Claim run", *ev["params"])[0])
    nodes.update({"Check event": [ev], "Claim run": [c]})
    if wf == "approve-by-exception":
        rules = run_code(wf, "Apply rules", nodes)
        assert rules["auto"]
        p = run_code(wf, "Enqueue parameters", nodes, [rules])["params"]
        rows = step(wf, "Approve and enqueue", *p)
    else:
        p = run_code(wf, "Build effect", nodes)["params"]
        rows = step(wf, "Approve and enqueue with window", *p)
    assert len(rows) == 1 and rows[0]["inserted"]
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    delay = scalar(conn, "SELECT extract(epoch FROM available_at - created_at)::int FROM outbox_effects")
    assert delay == (cfg["window_seconds"] if wf == "act-with-window" else 0)
