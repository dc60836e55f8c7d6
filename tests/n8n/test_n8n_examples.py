# SPDX-License-Identifier: ISC
"""The n8n kit (examples/n8n/*.json) without n8n: every workflow file has
the structure n8n 1.x imports; it keeps to what both of n8n's expression
engines (the default `vm` and `legacy`) evaluate alike (values built in
Code nodes, node parameters only reference them); a step that fails leads
to an error answer; every Postgres node's statement runs against the
migrated schema as the producer role and does what its step claims; and
the Code nodes' JavaScript (parameters, validation, pages) behaves, run
with node when it is installed.

Parameters are substituted the way n8n's Postgres node (v2.5, pg-promise)
does it: each $n becomes an escaped literal, never spliced by hand.
"""
import glob
import hashlib
import json
import os
import re
import secrets
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import ROOT, query, scalar, wait_for

EXAMPLES = os.path.join(ROOT, "examples", "n8n")
FILES = sorted(f for f in glob.glob(os.path.join(EXAMPLES, "*.json"))
               if os.path.basename(f) != "settings.json")
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


def respond_nodes(wf):
    return [n for n in wf["nodes"] if n["type"] == "n8n-nodes-base.respondToWebhook"]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_answer_says_it_is_the_kits(path):
    """n8n itself answers while it starts (200 "n8n is starting up. Please
    wait", then 404) and when an execution breaks (500 with its stack): a
    caller tells the kit's answers from those by the X-Outbox-Kit header on
    every answer and, on JSON answers, `"outbox": true` in the body."""
    with open(path) as f:
        wf = json.load(f)
    builders = {n["name"]: n for n in wf["nodes"] if n["type"] == "n8n-nodes-base.code"}
    for n in respond_nodes(wf):
        p = n["parameters"]
        headers = {e["name"]: e["value"] for e in p["options"]["responseHeaders"]["entries"]}
        assert headers.get("X-Outbox-Kit") == "1", n["name"]
        if p["respondWith"] != "json":
            continue
        body = p["responseBody"]
        if body == "={{ $json.response }}":
            # Built in the Code node just before it.
            src = [m for m, c in wf["connections"].items()
                   if any(x["node"] == n["name"] for out in c["main"] for x in out)]
            assert src and all("response: { outbox: true," in builders[m]["parameters"]["jsCode"]
                               for m in src), n["name"]
        else:
            assert body.startswith("={{ { outbox: true, "), f"{n['name']}: {body}"


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_no_header_that_n8n_drops(path):
    """n8n 1.123 drops a Content-Security-Policy set by a workflow (it is
    one of its protected headers) and sends its own sandbox policy instead
    (docs/n8n.md, "One statement per step, and what each guarantees": what the page is sent with): the kit does not
    pretend to set one."""
    with open(path) as f:
        wf = json.load(f)
    for n in respond_nodes(wf):
        names = [e["name"].lower() for e in n["parameters"]["options"]["responseHeaders"]["entries"]]
        assert "content-security-policy" not in names, n["name"]


def config_values():
    """(file, node, key, value) of every Config node assignment."""
    for path in FILES:
        with open(path) as f:
            wf = json.load(f)
        for n in wf["nodes"]:
            if n["type"] == "n8n-nodes-base.set" and n["name"].startswith("Config"):
                for a in n["parameters"]["assignments"]["assignments"]:
                    yield os.path.basename(path), n["name"], a["name"], a["value"]


def test_settings_json_is_the_one_place_for_the_settings(tmp_path):
    """settings.json holds every Config node's key with the value the files
    ship; apply-settings.py writes a changed value into every Config node
    that has the key, and refuses unknown keys and wrong types."""
    with open(os.path.join(EXAMPLES, "settings.json")) as f:
        settings = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    seen = set()
    for fname, nname, key, value in config_values():
        assert key in settings, f"{fname}:{nname}: {key} missing from settings.json"
        assert settings[key] == value, f"{fname}:{nname}: {key} = {value!r}, settings.json {settings[key]!r}"
        seen.add(key)
    assert seen == set(settings), f"unused in the workflows: {set(settings) - seen}"

    tool = os.path.join(EXAMPLES, "apply-settings.py")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"approval_page_url": "https://n8n.test/webhook/outbox/approval",
                                "window_seconds": 30, "_note": "comment"}))
    out = tmp_path / "out"
    r = subprocess.run(["/usr/bin/python3", tool, str(mine), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "approval_page_url: approve-before-act.json, approve-by-exception.json" in r.stdout
    got = {}
    for path in sorted(out.glob("*.json")):
        wf = json.loads(path.read_text())
        for n in wf["nodes"]:
            if n["type"] == "n8n-nodes-base.set":
                for a in n["parameters"]["assignments"]["assignments"]:
                    got.setdefault(a["name"], set()).add(json.dumps(a["value"]))
    assert got["approval_page_url"] == {'"https://n8n.test/webhook/outbox/approval"'}
    assert got["window_seconds"] == {"30"}
    assert got["deliver_url"] == {json.dumps(settings["deliver_url"])}
    assert sorted(p.name for p in out.glob("*.json")) == sorted(os.path.basename(f) for f in FILES)
    for bad, msg in (({"aproval_page_url": "x"}, "unknown setting(s): aproval_page_url"),
                     ({"window_seconds": "30"}, "window_seconds: must be a number")):
        mine.write_text(json.dumps(bad))
        r = subprocess.run(["/usr/bin/python3", tool, str(mine), str(tmp_path / "x")],
                           capture_output=True, text=True)
        assert r.returncode == 1 and msg in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()


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


def postgres_nodes():
    out = []
    for path in FILES:
        with open(path) as f:
            wf = json.load(f)
        for n in wf["nodes"]:
            if n["type"] == "n8n-nodes-base.postgres":
                out.append(pytest.param(wf, n, id=f"{os.path.basename(path)}:{n['name']}"))
    return out


def predecessors(wf, name):
    return [src for src, kinds in wf["connections"].items()
            for out in kinds["main"] for c in out if c["node"] == name]


def builders(wf, name):
    """The nodes whose output item reaches `name`, looking through Switch
    nodes (which pass items on unchanged)."""
    by_name = {n["name"]: n for n in wf["nodes"]}
    out, todo, seen = [], list(predecessors(wf, name)), set()
    while todo:
        src = todo.pop()
        if src in seen:
            continue
        seen.add(src)
        if by_name[src]["type"] == "n8n-nodes-base.switch":
            todo.extend(predecessors(wf, src))
        else:
            out.append(by_name[src])
    return out


def placeholders(sql):
    return {int(m.group(1)) for m in PLACEHOLDER.finditer(sql)}


@pytest.mark.parametrize("wf,n", postgres_nodes())
def test_postgres_nodes_use_query_parameters(wf, n):
    p = n["parameters"]
    assert n["typeVersion"] == 2.5
    assert p["operation"] == "executeQuery"
    sql = p["query"]
    assert "{{" not in sql, "no value may be spliced into the SQL text"
    assert ";" not in sql.rstrip().rstrip(";"), "one statement per step"
    assert re.match(r"\s*SELECT\b", sql, re.I)
    used = placeholders(sql)
    assert all(m.group(2) is None for m in PLACEHOLDER.finditer(sql)), "no pg-promise filters"
    assert used == set(range(1, max(used) + 1)), f"placeholders {sorted(used)} must be $1..$n"
    # Every placeholder is cast: the statement does not depend on how a
    # value's type was guessed.
    for m in re.finditer(r"\$[0-9]+(?![0-9])(.{0,2})", sql):
        assert m.group(1) == "::", f"uncast placeholder in {sql!r}"
    cred = n.get("credentials", {}).get("postgres", {})
    assert cred.get("name") == PRODUCER_CREDENTIAL and cred.get("id")
    # "Always Output Data" also fires next to the error output when the
    # statement fails (a database error then answered "lease lost"): a
    # statement that may do nothing returns one row of NULLs instead.
    assert not n.get("alwaysOutputData"), "use the one-row wrapper, not alwaysOutputData"


@pytest.mark.parametrize("wf,n", postgres_nodes())
def test_query_parameters_are_an_array_built_in_code(wf, n):
    """n8n's default expression engine (vm) broke an array literal written
    in the Query Parameters field ("Query Parameters must be a string of
    comma-separated values or an array of values").  The array is built by
    a Code node (plain JavaScript, the same on every engine) and the field
    only references it; the Code node names every placeholder."""
    assert n["parameters"]["options"]["queryReplacement"] == "={{ $json.params }}"
    srcs = builders(wf, n["name"])
    assert srcs, "no node feeds this statement"
    for src in srcs:
        assert src["type"] == "n8n-nodes-base.code", f"{src['name']} must be the Code node building params"
        assert re.search(r"\bparams\s*:", src["parameters"]["jsCode"]), f"{src['name']} builds no params"


def http_nodes():
    out = []
    for path in FILES:
        with open(path) as f:
            wf = json.load(f)
        for n in wf["nodes"]:
            if n["type"] == "n8n-nodes-base.httpRequest":
                out.append(pytest.param(wf, n, id=f"{os.path.basename(path)}:{n['name']}"))
    return out


@pytest.mark.parametrize("wf,n", http_nodes())
def test_http_bodies_are_objects_built_in_code(wf, n):
    """The vm engine failed the model call with "JSON parameter needs to be
    valid JSON": no JSON text is assembled by an expression.  The body is an
    object a Code node builds, and the node sends it as it is."""
    p = n["parameters"]
    assert p.get("sendBody") is True and p.get("specifyBody") == "json"
    assert p["jsonBody"] == "={{ $json.body }}"
    for src in builders(wf, n["name"]):
        assert src["type"] == "n8n-nodes-base.code", src["name"]
        assert re.search(r"\bbody\s*:", src["parameters"]["jsCode"]), src["name"]


EXPRESSION = re.compile(r"\{\{(.*?)\}\}", re.S)


def expressions(value):
    if isinstance(value, str):
        if value.startswith("="):
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from expressions(v)
    elif isinstance(value, list):
        for v in value:
            yield from expressions(v)


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_expressions_stay_simple(path):
    """Outside Code nodes, an expression only reads the item it gets
    ($json, literals, object literals of those): no $('Node') (which the vm
    engine resolved to nothing), no JSON.stringify, no functions, no `{{ }}`
    in the middle of text, which the two engines need not treat alike."""
    with open(path) as f:
        wf = json.load(f)
    for n in wf["nodes"]:
        if n["type"] == "n8n-nodes-base.code":
            continue
        for e in expressions(n["parameters"]):
            assert e.startswith("={{") and e.rstrip().endswith("}}"), f"{n['name']}: {e!r}"
            assert len(EXPRESSION.findall(e)) == 1, f"{n['name']}: one expression per field: {e!r}"
            # n8n's vm engine does not resolve $('Node') in a node parameter
            # (Code nodes are plain JavaScript and may): read $json only.
            assert "$(" not in e and "$node" not in e, f"{n['name']}: only $json in {e!r}"
            for banned in ("JSON.stringify", "JSON.parse", ".join(", ".map(", "=>", "function"):
                assert banned not in e, f"{n['name']}: {banned} in {e!r}: build it in a Code node"


CAN_FAIL = {"n8n-nodes-base.code", "n8n-nodes-base.postgres", "n8n-nodes-base.crypto",
            "n8n-nodes-base.httpRequest"}


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_a_failing_step_answers_an_error(path):
    """A node that fails before the webhook has answered must lead to an
    answer with an error status (n8n otherwise answered an empty 200 and the
    run stayed `processing` until its lease expired): every such node sends
    its errors down its error output, and that path reaches a Respond node
    with a 5xx status."""
    with open(path) as f:
        wf = json.load(f)
    by_name = {n["name"]: n for n in wf["nodes"]}
    conns = wf["connections"]

    def outs(name, k):
        m = conns.get(name, {"main": []})["main"]
        return [c["node"] for c in m[k]] if len(m) > k else []

    def succ(name):
        return [c["node"] for out in conns.get(name, {"main": []})["main"] for c in out]

    def error_answer(name, seen=()):
        n = by_name[name]
        if n["type"] == "n8n-nodes-base.respondToWebhook":
            return n["parameters"]["options"]["responseCode"] >= 500
        return any(error_answer(s, seen + (name,)) for s in succ(name) if s not in seen)

    def walk(name, responded, seen):
        n = by_name[name]
        responded = responded or n["type"] == "n8n-nodes-base.respondToWebhook"
        if not responded and n["type"] in CAN_FAIL:
            assert n.get("onError") == "continueErrorOutput", f"{name}: a failure would answer nothing"
            err = outs(name, 1)
            assert err and all(error_answer(e) for e in err), f"{name}: its error output must answer 5xx"
        for s in outs(name, 0) if n.get("onError") == "continueErrorOutput" else succ(name):
            if s not in seen:
                walk(s, responded, seen | {s})

    for h in triggers(wf):
        walk(h["name"], False, {h["name"]})


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
        assert len(values) == max(placeholders(sql)), f"{name}: {max(placeholders(sql))} parameters expected"
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


def nothing(rows):
    """What a statement that did nothing returns: one row of NULLs (the kit's
    statements always return a row, so the node after them always runs)."""
    return len(rows) == 1 and all(v is None for v in rows[0].values())


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
    # ...and when to deliver again: when the holder's lease expires.
    assert 295 <= again["retry_after_seconds"] <= 300
    assert first["retry_after_seconds"] is None
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
    assert query(conn, "SELECT state, approved_by, metadata FROM outbox_effects") == \
        [("pending", "alice@example.com", EFFECTS[0]["metadata"])]
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    # A second POST (double click, replay) does nothing.
    assert nothing(step("approval", "Consume approval", tok_hash, "approve", "alice@example.com"))
    assert nothing(step("approval", "Consume approval", tok_hash, "reject", "bob@example.com"))
    assert nothing(step("approval", "Peek approval", tok_hash))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    assert claim(step, "approve-before-act", ev)["state"] == "approved"


def test_approval_reject_and_bad_tokens(step, conn):
    ev = event(2)
    c = claim(step, "approve-before-act", ev)
    tok, tok_hash = token()
    step("approve-before-act", "Create approval", *lease_of(c), tok_hash, 60, json.dumps(EFFECTS),
         None, None)
    assert nothing(step("approval", "Peek approval", hashlib.sha256(b"guess").hexdigest()))
    assert nothing(step("approval", "Consume approval", hashlib.sha256(b"guess").hexdigest(), "approve",
                "mallory@example.com"))
    assert nothing(step("approval", "Consume approval", tok_hash, "delete", "alice@example.com"))
    assert scalar(conn, "SELECT consumed_at FROM approvals") is None
    got = step("approval", "Consume approval", tok_hash, "reject", "alice@example.com")
    assert got == [{"idempotency_key": "crm:lead-2", "decision": "reject", "effect_id": None,
                    "effect_type": None, "target": None}]
    assert scalar(conn, "SELECT state FROM workflow_runs") == "failed_terminal"
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0
    # A re-run of the original execution is told, and does nothing.
    assert claim(step, "approve-before-act", ev)["status"] == "done"


def test_expired_approval_enqueues_nothing(step, conn):
    c = claim(step, "approve-before-act", event(3))
    _, tok_hash = token()
    step("approve-before-act", "Create approval", *lease_of(c), tok_hash, 60, json.dumps(EFFECTS),
         None, None)
    query(conn, "UPDATE approvals SET expires_at = now() - interval '1 second'")
    assert nothing(step("approval", "Peek approval", tok_hash))
    assert nothing(step("approval", "Consume approval", tok_hash, "approve", "alice@example.com"))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "awaiting_human"


def test_create_approval_after_losing_the_lease_does_nothing(step, conn):
    c = claim(step, "approve-before-act", event(4))
    _, tok_hash = token()
    stale = [c["idempotency_key"], str(uuid.uuid4()), str(c["version"])]
    assert nothing(step("approve-before-act", "Create approval", *stale, tok_hash, 60, json.dumps(EFFECTS),
                None, None))
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "processing"


def test_validation_failure_ends_failed_terminal(step, conn):
    ev = event(5)
    c = claim(step, "approve-before-act", ev)
    errs = {"validation_errors": ["intent: one of reply, escalate, ignore"], "model_output": "Sure!"}
    assert step("approve-before-act", "Mark failed_terminal", *lease_of(c), "failed_terminal",
                json.dumps(errs)) == [{"version": 1, "idempotency_key": "crm:lead-5",
                                       "errors": errs["validation_errors"]}]
    again = claim(step, "approve-before-act", ev)
    assert (again["status"], again["state"], again["result"]) == ("done", "failed_terminal", errs)
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0


def test_model_failure_is_retryable(step, conn):
    ev = event(6)
    c = claim(step, "approve-before-act", ev)
    assert step("approve-before-act", "Mark failed_retryable", *lease_of(c), "failed_retryable",
                json.dumps({"error": "Draft with model failed", "failed_step": "Draft with model",
                            "detail": "timeout"})) == \
        [{"version": 1, "idempotency_key": "crm:lead-6", "failed_step": "Draft with model"}]
    # Re-delivery or a re-run from n8n's history takes it over at once.
    again = claim(step, "approve-before-act", ev)
    assert again["status"] == "reclaimed" and again["version"] == 2 and again["lease_owner"]
    # The old execution's lease is void.
    assert nothing(step("approve-before-act", "Mark failed_terminal", *lease_of(c), "failed_terminal",
                "{}"))


def auto_effect():
    return ("http", "https://helpdesk.example.com/api/replies",
            json.dumps({"method": "POST", "body": {"text": "We are open 9-17."}}),
            json.dumps({"workflow": "approve-by-exception", "approval": "auto:template:opening_hours"}))


def test_approve_by_exception_enqueues_once(step, conn):
    ev = event(7, category="opening_hours")
    c = claim(step, "approve-by-exception", ev)
    rows = step("approve-by-exception", "Approve and enqueue", *lease_of(c),
                json.dumps({"decided": "auto"}), *auto_effect(), 0, 300)
    assert len(rows) == 1 and rows[0]["inserted"] is True and rows[0]["state"] == "pending"
    assert rows[0]["version"] == 1
    st, approved_by, meta = query(conn, "SELECT state, approved_by, metadata FROM outbox_effects")[0]
    assert st == "pending" and approved_by is None
    assert meta["approval"] == "auto:template:opening_hours" and meta["run_version"] == 1
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    # The same statement again (a retried node) is refused by the CAS and
    # enqueues nothing more.
    assert nothing(step("approve-by-exception", "Approve and enqueue", *lease_of(c),
                json.dumps({"decided": "auto"}), *auto_effect(), 0, 300))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    assert claim(step, "approve-by-exception", ev)["status"] == "done"


@pytest.mark.parametrize("wf,name,delay", [("approve-by-exception", "Approve and enqueue", 0),
                                           ("act-with-window", "Approve and enqueue with window", 60)])
def test_direct_enqueue_happens_while_the_run_is_processing(step, conn, wf, name, delay):
    """The effect is inserted while the run is still `processing` and only
    then is the run moved to `approved`, in one statement: an insert after
    the move (the kit's earlier order) is what the database refuses."""
    c = claim(step, wf, event(20, category="opening_hours"))
    rows = step(wf, name, *lease_of(c), "{}", *auto_effect(), delay, 300)
    assert len(rows) == 1 and rows[0]["inserted"] and rows[0]["version"] == 1
    assert scalar(conn, "SELECT state FROM workflow_runs") == "approved"
    assert scalar(conn, "SELECT result->>'effect_id' FROM workflow_runs") == rows[0]["effect_id"]
    # The database's approval gate: a plain INSERT for the run, now approved,
    # is refused.
    with pytest.raises(psycopg2.Error, match="processing"), step.conn.cursor() as cur:
        cur.execute("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                    "VALUES (%s, 'http', 'https://other.example.com/', '{}')", (c["idempotency_key"],))


def test_plain_insert_needs_the_run_row_first(step, conn):
    """docs/n8n.md: the plain four-column INSERT references workflow_runs,
    so the run must be claimed first (and, with the database's approval
    gate, still be `processing`)."""
    sql = ("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
           "VALUES (%s, 'http', 'https://helpdesk.example.com/api/replies', '{}') ON CONFLICT DO NOTHING")
    # As the producer login, the row policy refuses it (42501) before the
    # foreign key would (23503).
    with pytest.raises(psycopg2.errors.InsufficientPrivilege), step.conn.cursor() as cur:
        cur.execute(sql, ("crm:lead-22",))
    c = claim(step, "approve-by-exception", event(22, category="opening_hours"))
    with step.conn.cursor() as cur:
        cur.execute(sql, (c["idempotency_key"],))
        cur.execute(sql, (c["idempotency_key"],))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1


def test_approve_by_exception_without_the_lease_enqueues_nothing(step, conn):
    c = claim(step, "approve-by-exception", event(8, category="opening_hours"))
    stale = [c["idempotency_key"], str(uuid.uuid4()), "0"]
    assert nothing(step("approve-by-exception", "Approve and enqueue", *stale, "{}", *auto_effect(), 0, 300))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs") == "processing"


def test_approve_by_exception_escalation_creates_an_approval(step, conn):
    c = claim(step, "approve-by-exception", event(9, category="refund"))
    _, tok_hash = token()
    rows = step("approve-by-exception", "Create approval", *lease_of(c), tok_hash, 3600,
                json.dumps(EFFECTS), "support-leads@example.com", json.dumps({"decided": "escalated"}))
    assert len(rows) == 1
    assert scalar(conn, "SELECT state FROM workflow_runs") == "awaiting_human"
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 0


def cancel(step, eid, reason="r", actor="n8n:x"):
    rows = step("act-with-window", "Cancel effect", eid, reason, actor)
    assert len(rows) == 1 and rows[0]["effect_id"] == eid
    return rows[0]["status"], rows[0]["state"]


def test_act_with_window_enqueue_and_cancel(step, conn):
    ev = event(10)
    c = claim(step, "act-with-window", ev)
    rows = step("act-with-window", "Approve and enqueue with window", *lease_of(c),
                json.dumps({"decided": "window"}), *auto_effect(), 600, 300)
    assert len(rows) == 1 and rows[0]["inserted"]
    eid = rows[0]["effect_id"]
    assert scalar(conn, "SELECT available_at > now() + interval '590 seconds' FROM outbox_effects")
    # Cancelled before the window closes: never sent.
    assert cancel(step, eid, "customer changed mind", "n8n:alice@example.com") == ("cancelled", "failed")
    st, err = query(conn, "SELECT state, last_error FROM outbox_effects WHERE effect_id = %s", (eid,))[0]
    assert st == "failed" and err == "cancelled: customer changed mind"
    assert scalar(conn, "SELECT state FROM workflow_runs") == "failed_terminal"
    assert cancel(step, eid, "again") == ("finished", "failed")
    other = str(uuid.uuid4())
    assert cancel(step, other, "none") == ("not_found", None)


def test_act_with_window_cancel_past_the_window_is_too_late(step, conn):
    """Past its window the database refuses a producer's cancel; the
    statement says so (too_late) instead of failing, so the webhook answers
    409 "too late", not 500 "try again"."""
    c = claim(step, "act-with-window", event(12))
    eid = step("act-with-window", "Approve and enqueue with window", *lease_of(c), "{}",
               *auto_effect(), 600, 300)[0]["effect_id"]
    query(conn, "UPDATE effect_live SET available_at = now() - interval '1 second' WHERE effect_id = %s",
          (eid,))
    assert cancel(step, eid) == ("too_late", "pending")
    assert scalar(conn, "SELECT state FROM outbox_effects") == "pending"
    assert scalar(conn, "SELECT count(*) FROM operator_actions") == 0
    # The plain producer cancel is what raised before.
    with pytest.raises(psycopg2.errors.InsufficientPrivilege), step.conn.cursor() as cur:
        cur.execute("SELECT outbox_cancel(%s::uuid, 'r', 'n8n:x')", (eid,))


def test_act_with_window_cannot_cancel_a_sending_effect(step, conn):
    c = claim(step, "act-with-window", event(11))
    eid = step("act-with-window", "Approve and enqueue with window", *lease_of(c), "{}",
               *auto_effect(), 1, 300)[0]["effect_id"]
    query(conn, "UPDATE effect_live SET state = 'sending' WHERE effect_id = %s", (eid,))
    assert cancel(step, eid, "too late") == ("too_late", "sending")
    assert scalar(conn, "SELECT state FROM outbox_effects") == "sending"


# --- re-opening an expired approval --------------------------------------------------------

@pytest.fixture
def operator(db, conn):
    name = f"t_op_{uuid.uuid4().hex[:8]}"
    query(conn, f'CREATE ROLE "{name}" LOGIN IN ROLE outbox_operator')
    c = psycopg2.connect(db, user=name)
    c.autocommit = True
    yield c
    c.close()
    query(conn, f'DROP ROLE IF EXISTS "{name}"')


REOPEN = "SELECT * FROM outbox_reopen_approval(%s, %s, %s)"


def test_expired_approval_reopened_goes_down_the_approval_path_again(step, conn, operator):
    ev = event(40)
    c = claim(step, "approve-before-act", ev)
    _, old_hash = token()
    step("approve-before-act", "Create approval", *lease_of(c), old_hash, 60, json.dumps(EFFECTS),
         None, None)
    # While the approval is open, nothing to re-open.
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState, match="open until"):
        query(operator, REOPEN, ("crm:lead-40", "lee", "approver away"))
    query(conn, "UPDATE approvals SET expires_at = now() - interval '1 second'")
    # A re-delivery alone is told "done, awaiting_human" and does nothing.
    assert claim(step, "approve-before-act", ev)["status"] == "done"
    # The producer may not re-open; the operator may, once, with a reason.
    with pytest.raises(psycopg2.errors.InsufficientPrivilege), step.conn.cursor() as cur:
        cur.execute(REOPEN, ("crm:lead-40", "n8n", "x"))
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        query(operator, REOPEN, ("crm:lead-40", "lee", ""))
    assert query(operator, REOPEN, ("crm:lead-40", "lee", "approver away")) == \
        [("crm:lead-40", "failed_retryable", 2)]
    act = query(conn, "SELECT action, run_key, operator, reason, detail FROM operator_actions")
    assert act == [("reopen_approval", "crm:lead-40", "lee", "approver away", {"expired_approvals": 1})]
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState, match="failed_retryable"):
        query(operator, REOPEN, ("crm:lead-40", "lee", "again"))
    # The same event delivered again takes the run over and asks again.
    again = claim(step, "approve-before-act", ev)
    assert again["status"] == "reclaimed"
    _, new_hash = token()
    assert len(step("approve-before-act", "Create approval", *lease_of(again), new_hash, 60,
                    json.dumps(EFFECTS), None, None)) == 1
    assert nothing(step("approval", "Peek approval", old_hash))
    got = step("approval", "Consume approval", new_hash, "approve", "alice@example.com")
    assert len(got) == 1 and got[0]["effect_id"]
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    with pytest.raises(psycopg2.errors.NoDataFound):
        query(operator, REOPEN, ("crm:nothing", "lee", "x"))


@pytest.mark.parametrize("wf", ["approve-before-act", "approve-by-exception", "act-with-window"])
def test_a_key_another_login_holds_is_answered_409_unavailable(step, conn, wf):
    """The claim of a key another producer login holds raised 42501, which
    the kit answered 500 "deliver the event again later", every time.  It
    answers `unavailable` now, routed to a 409 that says a retry cannot
    succeed and names nobody, and nothing of the other run comes back."""
    other = f"t_n8n_other_{uuid.uuid4().hex[:8]}"
    query(conn, f'CREATE ROLE "{other}" LOGIN IN ROLE outbox_producer')
    try:
        c = psycopg2.connect(step.conn.dsn.replace(f"user={scalar(step.conn, 'SELECT session_user')}",
                                                   f"user={other}"))
        c.autocommit = True
        ev = event(77)
        assert claim(Step(c), wf, ev)["status"] == "claimed"
        query(conn, "UPDATE workflow_runs SET state = 'completed', result = '{\"secret\": 1}'")
        got = claim(step, wf, ev)
        assert got["status"] == "unavailable" and got["idempotency_key"] == "crm:lead-77"
        assert all(got[k] is None for k in ("state", "lease_owner", "version", "result",
                                            "retry_after_seconds")), got
        c.close()
    finally:
        query(conn, f"DROP OWNED BY \"{other}\"")
        query(conn, f'DROP ROLE IF EXISTS "{other}"')
    w = load(wf)
    sw = node(w, "Claim outcome")["parameters"]
    assert "unavailable: 4" in sw["output"] and sw["numberOutputs"] == 5
    target = w["connections"]["Claim outcome"]["main"][4][0]["node"]
    r = node(w, target)
    assert r["type"] == "n8n-nodes-base.respondToWebhook"
    assert r["parameters"]["options"]["responseCode"] == 409
    body = r["parameters"]["responseBody"]
    assert "status: 'unavailable'" in body and "cannot succeed" in body
    assert "session_user" not in body and "owner" not in body


def test_act_with_window_cancel_past_the_window_is_too_late_while_a_scope_is_paused(step, conn):
    """A pause parks a due effect at available_at 'infinity': the cancel
    webhook answered `cancelled` 25 s after a 20 s window.  The window is
    the producer's: past it, too_late, paused or not."""
    c = claim(step, "act-with-window", event(13))
    eid = step("act-with-window", "Approve and enqueue with window", *lease_of(c), "{}",
               *auto_effect(), 1, 300)[0]["effect_id"]
    wait_for(lambda: scalar(conn, "SELECT available_at < now() FROM effect_outbox"),
             what="the 1 s window to close")
    query(conn, "UPDATE effect_live SET available_at = 'infinity', held_by = 'host:helpdesk.example.com' "
                "WHERE effect_id = %s", (eid,))
    assert cancel(step, eid) == ("too_late", "pending")
    assert scalar(conn, "SELECT state FROM outbox_effects") == "pending"
