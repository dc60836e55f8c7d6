#!/usr/bin/env python3
# SPDX-License-Identifier: ISC
"""examples/n8n/check-scenarios.py: the scenarios check-with-n8n.sh drives
against a running n8n with the kit imported, the local sink and the
dispatcher (run by that script, not alone):

  check-scenarios.py WORK N8N_PORT DB_CONNINFO ENGINE

Approve before act (the reference sequence, a duplicate delivery, five
concurrent deliveries, a payload mismatch, the bounded repair, a
validation failure), the approval page and decision (unsigned, approved,
replayed, rejected), approve by exception (automatic and escalated), act
with a window (cancelled, and sent after the window), failing steps (a
database call refused: the webhook answers an error status with a body,
never an empty 200, and the run is released for a retry), and the
dispatcher's delivery of every approved effect with its idempotency key.
Prints PASS/FAIL lines and "n8n check (engine ENGINE): N passed, N failed".
"""
import json, sys, threading, time, urllib.error, urllib.parse, urllib.request
import psycopg2
work, n8n_port, dsn, engine = sys.argv[1:5]
have_dispatcher = True
T0 = time.monotonic()
HOOK = f"http://127.0.0.1:{n8n_port}/webhook"
results = []

def http(method, url, body=None, headers=None, form=False):
    data = None
    h = dict(headers or {})
    if body is not None:
        if form:
            data = urllib.parse.urlencode(body).encode()
            h["Content-Type"] = "application/x-www-form-urlencoded"
        else:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            code, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        code, raw = e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw

def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")

def check(name, fn):
    try:
        detail = fn()
        results.append((name, True))
        print(f"PASS {name}" + (f": {detail}" if detail else ""), flush=True)
    except Exception as e:
        results.append((name, False))
        print(f"FAIL {name}: {e}", flush=True)

def jsonl(name):
    try:
        return [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
    except FileNotFoundError:
        return []

db = psycopg2.connect(dsn)
db.autocommit = True
def q(sql, *args):
    with db.cursor() as c:
        c.execute(sql, args)
        return c.fetchall()

def ev(event_id, message="Hello, I would like a quote for 40 seats.", **kw):
    e = {"source": "crm", "event_id": event_id, "email": "lead@example.com", "message": message}
    e.update(kw)
    return e

def delivered(event_id):
    return [d for d in jsonl("deliver") if isinstance(d["body"], dict)
            and d["body"].get("event_id") == event_id]

# Webhooks are registered some seconds after n8n's health endpoint answers:
# poll the production URLs themselves (an invalid event changes nothing).
def ready():
    out = []
    for path in ("outbox/lead", "outbox/ticket", "outbox/scheduled"):
        code, body = http("POST", f"{HOOK}/{path}", {})
        out.append(code == 400 and isinstance(body, dict) and body.get("status") == "invalid_event")
    code, body = http("GET", f"{HOOK}/outbox/approval?token=probe")
    out.append(code == 404 and "not valid" in str(body))
    return all(out)
check("n8n answers on every production webhook", lambda: wait_for(ready, 900, "webhooks") and None)
T_READY = time.monotonic() - T0

state = {}

def approve_before_act():
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-1"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    state["lead1"] = body
    assert q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:lead-1'") == [("awaiting_human",)]
    return f"202 {body['status']} approval {body['approval_id']}"
check("approve-before-act: event -> claim -> model -> valid -> awaiting_human", approve_before_act)

def duplicate():
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-1"))
    assert code == 200 and body["status"] == "duplicate" and body["state"] == "awaiting_human", (code, body)
    llm = [l for l in jsonl("llm") if "40 seats" in l["user"]]
    assert len(llm) == 1, f"the model was called {len(llm)} times"
    return "200 duplicate, state awaiting_human, model called once"
check("duplicate delivery reports the current state, no second model call", duplicate)

def mismatch():
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-1", message="changed"))
    assert code == 422 and body["status"] == "payload_mismatch", (code, body)
check("same key, different payload: 422 payload_mismatch", mismatch)

def concurrent():
    out = []
    def post():
        out.append(http("POST", f"{HOOK}/outbox/lead", ev("lead-c", "Five at once: a quote please")))
    threads = [threading.Thread(target=post) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(c for c, _ in out)
    acted = [b for c, b in out if c == 202]
    assert len(acted) == 1 and acted[0]["status"] == "awaiting_human", out
    for c, b in out:
        assert c == 202 or (c, b["status"]) in ((409, "in_progress"), (200, "duplicate")), (c, b)
    llm = [l for l in jsonl("llm") if "Five at once" in l["user"]]
    assert len(llm) == 1, f"the model was called {len(llm)} times"
    assert q("SELECT count(*) FROM approvals WHERE idempotency_key = 'crm:lead-c'") == [(1,)]
    return f"answers {codes}: one acted, model called once, one approval"
check("five concurrent deliveries of one event: one acts, the others are told", concurrent)

def token_only_in_message():
    msgs = wait_for(lambda: [m for m in jsonl("notify") if m.get("key") == "crm:lead-1"], 20,
                    "the approver's message")
    assert len(msgs) == 1, msgs
    url = msgs[0]["approval_url"]
    token = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)["token"][0]
    assert len(token) == 64
    dump = q("SELECT string_agg(t::text, ' ') FROM approvals t")[0][0]
    assert token not in dump
    state["token"], state["url"] = token, url
    return "link sent to the approver; only its SHA-256 in approvals"
check("approval link: raw token only in the approver's message", token_only_in_message)

def page():
    code, html = http("GET", state["url"])
    assert code == 200 and "Approval needed" in html and 'value="approve"' in html, (code, html[:300])
    assert q("SELECT consumed_at FROM approvals WHERE idempotency_key = 'crm:lead-1'") == [(None,)]
    return "200 confirmation page, nothing consumed"
check("GET approval page shows and changes nothing", page)

def unsigned():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True)
    assert code == 401, (code, html)
    assert q("SELECT consumed_at FROM approvals WHERE idempotency_key = 'crm:lead-1'") == [(None,)]
check("POST decision without the SSO identity is refused", unsigned)

def approve():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True,
                      headers={"X-Auth-Request-Email": "approver@example.com"})
    assert code == 200 and "Approved" in html, (code, html)
    rows = q("SELECT effect_id, approved_by, state FROM effect_outbox WHERE idempotency_key = 'crm:lead-1'")
    assert len(rows) == 1 and rows[0][1] == "approver@example.com", rows
    return f"effect {rows[0][0]} queued, approved_by {rows[0][1]}"
check("POST approve consumes the token and enqueues the effect", approve)

def replay():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True,
                      headers={"X-Auth-Request-Email": "approver@example.com"})
    assert code == 409 and "Nothing was done" in html, (code, html)
    assert q("SELECT count(*) FROM effect_outbox WHERE idempotency_key = 'crm:lead-1'") == [(1,)]
check("replayed POST: nothing done, still one effect", replay)

def delivered_once(event_id, key):
    def go():
        assert have_dispatcher, "no dispatcher built"
        d = wait_for(lambda: delivered(event_id), 60, f"delivery of {event_id}")
        ek, st, pid = q("SELECT effect_key, state, provider_id FROM effect_outbox WHERE idempotency_key = %s", key)[0]
        assert d[0]["headers"].get("idempotency-key") == ek, (d[0]["headers"], ek)
        wait_for(lambda: q("SELECT state FROM workflow_runs WHERE idempotency_key = %s", key)[0][0] == "completed",
                 30, f"run {key} completed")
        st, pid = q("SELECT state, provider_id FROM effect_outbox WHERE idempotency_key = %s", key)[0]
        assert st == "completed", st
        assert len(delivered(event_id)) == 1
        return f"delivered once, Idempotency-Key {ek[:12]}..., provider id {pid}, run completed"
    return go
check("dispatcher delivers the approved effect to the sink", delivered_once("lead-1", "crm:lead-1"))

def repair():
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-2", "REPAIR-ME: a quote please"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    n = [l for l in jsonl("llm") if "REPAIR-ME" in l["user"]]
    assert len(n) == 2, n
    return "prose first, one repair, then awaiting_human"
check("bounded repair: one retry of the model, then valid", repair)

def invalid():
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-3", "ALWAYS-INVALID please"))
    assert code == 422 and body["status"] == "failed_terminal", (code, body)
    assert q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:lead-3'") == [("failed_terminal",)]
    assert len([l for l in jsonl("llm") if "ALWAYS-INVALID" in l["user"]]) == 2
    wait_for(lambda: [m for m in jsonl("notify") if "crm:lead-3" in m.get("text", "")], 20, "human told")
    assert q("SELECT count(*) FROM effect_outbox WHERE idempotency_key = 'crm:lead-3'") == [(0,)]
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-3", "ALWAYS-INVALID please"))
    assert code == 200 and body["state"] == "failed_terminal", (code, body)
    return "422 failed_terminal, human notified, a re-delivery is not re-run"
check("invalid after the repair: failed_terminal, nothing queued", invalid)

def auto():
    code, body = http("POST", f"{HOOK}/outbox/ticket",
                      ev("t-1", "When are you open?", category="opening_hours"))
    assert code == 202 and body["status"] == "queued" and body["decided"] == "auto", (code, body)
    row = q("SELECT approved_by, metadata->>'approval' FROM effect_outbox WHERE idempotency_key = 'crm:t-1'")
    assert row == [(None, "auto:template:opening_hours")], row
    return f"queued automatically, effect {body['effect_id']}"
check("approve-by-exception: eligible ticket enqueued without a human", auto)
check("dispatcher delivers the automatic effect", delivered_once("t-1", "crm:t-1"))

def escalated():
    code, body = http("POST", f"{HOOK}/outbox/ticket",
                      ev("t-2", "I want a refund", category="refund"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    assert q("SELECT count(*) FROM effect_outbox WHERE idempotency_key = 'crm:t-2'") == [(0,)]
check("approve-by-exception: other tickets go to a human", escalated)

def reject():
    msgs = wait_for(lambda: [m for m in jsonl("notify") if m.get("key") == "crm:t-2"], 20, "t-2 link")
    token = urllib.parse.parse_qs(urllib.parse.urlparse(msgs[0]["approval_url"]).query)["token"][0]
    code, html = http("POST", f"{HOOK}/outbox/approval/decide", {"token": token, "decision": "reject"},
                      form=True, headers={"X-Auth-Request-Email": "lead@example.com"})
    assert code == 200 and "Rejected" in html, (code, html)
    assert q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:t-2'") == [("failed_terminal",)]
    assert q("SELECT count(*) FROM effect_outbox WHERE idempotency_key = 'crm:t-2'") == [(0,)]
    code, html = http("POST", f"{HOOK}/outbox/approval/decide", {"token": token, "decision": "approve"},
                      form=True, headers={"X-Auth-Request-Email": "lead@example.com"})
    assert code == 409, (code, html)
    return "run failed_terminal, nothing queued; the used token then approves nothing"
check("reject: the run closes, nothing is queued, the token is spent", reject)

def window_cancel():
    code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-1", "Reminder: your demo is tomorrow"))
    assert code == 202 and body["status"] == "scheduled", (code, body)
    code, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"], "reason": "demo moved"})
    assert code == 200 and c["cancelled"] is True, (code, c)
    code, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"]})
    assert code == 200 and c["cancelled"] is False, (code, c)
    st, err = q("SELECT state, last_error FROM effect_outbox WHERE effect_id = %s", body["effect_id"])[0]
    assert st == "failed" and err.startswith("cancelled"), (st, err)
    return "scheduled, cancelled inside the window, second cancel refused"
check("act-with-window: cancel inside the window", window_cancel)

def window_send():
    code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-2", "Reminder: your call is today"))
    assert code == 202, (code, body)
    assert not delivered("s-2")
    assert have_dispatcher, "no dispatcher built"
    wait_for(lambda: delivered("s-2"), 60, "s-2 delivered after its window")
    # s-1 was scheduled earlier with the same window: it would be due by now.
    assert not delivered("s-1"), "a cancelled effect was sent"
    return "sent after the window; the cancelled one never"
check("act-with-window: sent after the window, cancelled one never", window_send)

# A step that fails (here: the database refuses a call, as it would when
# down or when a gate refuses an insert) makes the webhook answer an error
# status with a body, never an empty 200; a run it held is released.
SUPER = psycopg2.connect(dsn)
SUPER.autocommit = True
def grant(fn, on):
    with SUPER.cursor() as c:
        c.execute(f"{'GRANT' if on else 'REVOKE'} EXECUTE ON FUNCTION {fn} "
                  f"{'TO' if on else 'FROM'} outbox_producer")

def failing_create_approval():
    sig = "outbox_create_approval(text, uuid, bigint, bytea, text[], integer, jsonb, text, jsonb)"
    grant(sig, False)
    try:
        code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-f", "Failing step: a quote please"))
    finally:
        grant(sig, True)
    assert code >= 500 and isinstance(body, dict) and body.get("status"), (code, body)
    st = q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:lead-f'")
    assert st == [("failed_retryable",)], st
    code2, body2 = http("POST", f"{HOOK}/outbox/lead", ev("lead-f", "Failing step: a quote please"))
    assert code2 == 202 and body2["status"] == "awaiting_human", (code2, body2)
    return f"{code} {body['status']}, run failed_retryable; delivered again: {code2} {body2['status']}"
check("a failing step (create approval refused) answers an error, the retry then works",
      failing_create_approval)

def failing_claim():
    sig = "outbox_claim_run(text, text, uuid, integer)"
    grant(sig, False)
    try:
        code, body = http("POST", f"{HOOK}/outbox/ticket", ev("t-f", "When are you open?", category="opening_hours"))
    finally:
        grant(sig, True)
    assert code >= 500 and isinstance(body, dict) and body.get("status"), (code, body)
    assert q("SELECT count(*) FROM workflow_runs WHERE idempotency_key = 'crm:t-f'") == [(0,)]
    return f"{code} {body['status']}"
check("a failing claim answers an error status with a body", failing_claim)

def failing_cancel():
    sig = "outbox_cancel(uuid, text, text)"
    code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-f", "Reminder: failing cancel"))
    assert code == 202, (code, body)
    grant(sig, False)
    try:
        code, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"]})
    finally:
        grant(sig, True)
    assert code >= 500 and isinstance(c, dict) and c.get("cancelled") is False, (code, c)
    code, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"]})
    assert code == 200 and c["cancelled"] is True, (code, c)
    return "500, cancelled: false; again: cancelled"
check("a failing cancel answers an error status, not an empty 200", failing_cancel)

passed = sum(1 for _, ok in results if ok)
failed = len(results) - passed
print(f"n8n check (engine {engine}): {passed} passed, {failed} failed; "
      f"webhooks ready {T_READY:.0f} s after n8n's start, scenarios {time.monotonic() - T0 - T_READY:.0f} s")
sys.exit(1 if failed else 0)
