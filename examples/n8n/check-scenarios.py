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
Then what a caller meets around n8n itself: n8n's own answers while it
starts (none carries the kit's X-Outbox-Kit marker; a source that retries
until it gets the kit's answer loses nothing), the approval page's headers
as n8n really sends them (the guide's Content-Security-Policy line), a 200
HTML page from the model's endpoint (a failed call, not bad output), a
cancel past the window (409 too_late, and the operator's outboxctl cancel),
a decision other than approve or reject (400), the way on for an expired
approval, and n8n stopped with SIGTERM mid-execution (n8n's own 500; the
run waits for its lease, which the kit's 409 names in Retry-After), then
restarted with N8N_INSECURE_DISABLE_WEBHOOK_IFRAME_SANDBOX=true.
Prints PASS/FAIL lines and "n8n check (engine ENGINE): N passed, N failed".

Environment (set by check-with-n8n.sh): N8N_CMD (the n8n executable, to
restart it), OUTBOXCTL, and WORK/n8n.pid (n8n's process id, rewritten on
restart).
"""
import json, os, re, signal, subprocess, sys, threading, time
import urllib.error, urllib.parse, urllib.request
import psycopg2
work, n8n_port, dsn, engine = sys.argv[1:5]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTBOXCTL = os.environ.get("OUTBOXCTL", os.path.join(ROOT, "build", "outboxctl"))
have_dispatcher = True
LEASE = int(os.environ.get("CHECK_LEASE_SECONDS", "120"))
T0 = time.monotonic()
HOOK = f"http://127.0.0.1:{n8n_port}/webhook"
results = []

# Answers that look like the kit's (a JSON status, an approval page) but
# lack its marker: the check fails if there is any.
unmarked = []


def is_kit(headers, body=None):
    """The kit's answer, not n8n's: the X-Outbox-Kit header, and on a JSON
    object `"outbox": true` (docs/n8n.md, "Telling the kit's answers from
    n8n's")."""
    if headers.get("x-outbox-kit") != "1":
        return False
    return not isinstance(body, dict) or body.get("outbox") is True


def request(method, url, body=None, headers=None, form=False):
    """(status, body as JSON or text, headers in lower case); status 0 when
    nothing answered."""
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
        with urllib.request.urlopen(req, timeout=150) as r:
            code, raw, hdrs = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        code, raw, hdrs = e.code, e.read().decode(), e.headers
    except OSError as e:
        return 0, str(e), {}
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    try:
        out = json.loads(raw)
    except ValueError:
        out = raw
    kitlike = (isinstance(out, dict) and ("status" in out or "cancelled" in out)) or \
        (isinstance(out, str) and ("Nothing was" in out or "Approval needed" in out))
    if kitlike and not is_kit(hdrs, out):
        unmarked.append((method, url.split("?")[0], code))
    return code, out, hdrs


def http(method, url, body=None, headers=None, form=False):
    code, out, _ = request(method, url, body, headers, form)
    return code, out

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

def run_state(key):
    """The run's state as the producer functions see it: the completion of
    its last effect does not write the run, every reader settles it first."""
    q("SELECT outbox_settle_runs(ARRAY[%s])", key)
    return q("SELECT state FROM workflow_runs WHERE idempotency_key = %s", key)[0][0]

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
        return c.fetchall() if c.description else None

def ev(event_id, message="Hello, I would like a quote for 40 seats.", **kw):
    e = {"source": "crm", "event_id": event_id, "email": "lead@example.com", "message": message}
    e.update(kw)
    return e

def delivered(event_id):
    return [d for d in jsonl("deliver") if isinstance(d["body"], dict)
            and d["body"].get("event_id") == event_id]

def startup_window(event_id):
    """From the moment n8n is started, deliver one event the way a source
    should: again and again until the answer is the kit's (X-Outbox-Kit).
    n8n answers first itself (connection refused, 503 "Database is not
    ready", 200 "n8n is starting up. Please wait", 404 "not registered"):
    none of those carries the marker or creates a run; a source that took
    the 200 for "delivered" would have lost the event."""
    key = "crm:" + event_id
    seen = {}
    deadline = time.monotonic() + 900
    while True:
        assert time.monotonic() < deadline, f"no answer from the kit in 900 s; n8n answered {seen}"
        code, body, h = request("POST", f"{HOOK}/outbox/ticket",
                                ev(event_id, "When are you open?", category="opening_hours"))
        if is_kit(h, body):
            break
        assert not (isinstance(body, dict) and "status" in body), \
            f"the kit answered {code} {body} without its marker"
        assert q("SELECT count(*) FROM workflow_runs WHERE idempotency_key = %s", key) == [(0,)], \
            f"n8n's {code} {str(body)[:60]!r} started a run"
        what = "no connection" if code == 0 else f"{code} {str(body if isinstance(body, str) else body.get('message', body))[:48]!r}"
        seen[what] = seen.get(what, 0) + 1
        time.sleep(0.2)
    assert code == 202 and body["status"] == "queued", (code, body)
    assert q("SELECT count(*) FROM workflow_runs WHERE idempotency_key = %s", key) == [(1,)]
    state.setdefault("n8n_startup_answers", []).append(seen)
    return "before the kit's 202: " + (", ".join(f"{n} x {w}" for w, n in seen.items()) or "nothing")

state = {}
check("n8n starting: its own answers carry no kit marker, the retried event is taken once",
      lambda: startup_window("boot-1"))

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
        out.append(request("POST", f"{HOOK}/outbox/lead", ev("lead-c", "Five at once: a quote please")))
    threads = [threading.Thread(target=post) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(c for c, _, _ in out)
    acted = [b for c, b, _ in out if c == 202]
    assert len(acted) == 1 and acted[0]["status"] == "awaiting_human", out
    for c, b, h in out:
        assert c == 202 or (c, b["status"]) in ((409, "in_progress"), (200, "duplicate")), (c, b)
        assert is_kit(h, b), (c, b, h)
        if c == 409:
            # When to deliver again: when the holder's lease expires.
            assert int(h["retry-after"]) == b["retry_after_seconds"] and 1 <= b["retry_after_seconds"] <= LEASE, (b, h)
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

GUIDE = open(os.path.join(ROOT, "docs", "n8n.md")).read()

def page_headers():
    """The headers the page really gets: n8n drops a workflow's own
    Content-Security-Policy and sends its sandbox policy, exactly as the
    guide shows it; the kit's other headers arrive."""
    code, html, h = request("GET", state["url"])
    assert code == 200, (code, html[:200])
    documented = re.search(r"^Content-Security-Policy: (sandbox [^\n`]+)$", GUIDE, re.M)
    assert documented, "docs/n8n.md shows no sandbox Content-Security-Policy line"
    assert h.get("content-security-policy") == documented.group(1), \
        f"sent {h.get('content-security-policy')!r}, the guide says {documented.group(1)!r}"
    for k, v in (("x-frame-options", "DENY"), ("referrer-policy", "no-referrer"),
                 ("cache-control", "no-store"), ("x-outbox-kit", "1")):
        assert h.get(k) == v, (k, h.get(k))
    return "Content-Security-Policy: " + h["content-security-policy"][:40] + "..., X-Frame-Options: DENY"
check("approval page headers: n8n's sandbox CSP as the guide shows it, the kit's others", page_headers)

def unsigned():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True)
    assert code == 401, (code, html)
    assert q("SELECT consumed_at FROM approvals WHERE idempotency_key = 'crm:lead-1'") == [(None,)]
check("POST decision without the SSO identity is refused", unsigned)

def bad_decision():
    code, html, h = request("POST", f"{HOOK}/outbox/approval/decide",
                            {"token": state["token"], "decision": "delete"}, form=True,
                            headers={"X-Auth-Request-Email": "approver@example.com"})
    assert code == 400 and "decision must be approve or reject" in html and is_kit(h), (code, html)
    assert q("SELECT consumed_at FROM approvals WHERE idempotency_key = 'crm:lead-1'") == [(None,)]
    return "400, nothing consumed"
check("POST decision=delete, signed in: 400, not 401", bad_decision)

def approve():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True,
                      headers={"X-Auth-Request-Email": "approver@example.com"})
    assert code == 200 and "Approved" in html, (code, html)
    rows = q("SELECT effect_id, approved_by, state FROM outbox_effects WHERE idempotency_key = 'crm:lead-1'")
    assert len(rows) == 1 and rows[0][1] == "approver@example.com", rows
    return f"effect {rows[0][0]} queued, approved_by {rows[0][1]}"
check("POST approve consumes the token and enqueues the effect", approve)

def replay():
    code, html = http("POST", f"{HOOK}/outbox/approval/decide",
                      {"token": state["token"], "decision": "approve"}, form=True,
                      headers={"X-Auth-Request-Email": "approver@example.com"})
    assert code == 409 and "Nothing was done" in html, (code, html)
    assert q("SELECT count(*) FROM outbox_effects WHERE idempotency_key = 'crm:lead-1'") == [(1,)]
check("replayed POST: nothing done, still one effect", replay)

def delivered_once(event_id, key):
    def go():
        assert have_dispatcher, "no dispatcher built"
        d = wait_for(lambda: delivered(event_id), 60, f"delivery of {event_id}")
        ek, st, pid = q("SELECT effect_key, state, provider_id FROM outbox_effects WHERE idempotency_key = %s", key)[0]
        assert d[0]["headers"].get("idempotency-key") == ek, (d[0]["headers"], ek)
        wait_for(lambda: run_state(key) == "completed", 30, f"run {key} completed")
        st, pid = q("SELECT state, provider_id FROM outbox_effects WHERE idempotency_key = %s", key)[0]
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
    assert q("SELECT count(*) FROM outbox_effects WHERE idempotency_key = 'crm:lead-3'") == [(0,)]
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-3", "ALWAYS-INVALID please"))
    assert code == 200 and body["state"] == "failed_terminal", (code, body)
    return "422 failed_terminal, human notified, a re-delivery is not re-run"
check("invalid after the repair: failed_terminal, nothing queued", invalid)

def model_html_200():
    code, body, h = request("POST", f"{HOOK}/outbox/lead", ev("lead-html", "HTML-ONCE: a quote please"))
    assert code == 503 and body["status"] == "failed_retryable" and is_kit(h, body), (code, body)
    assert body["step"] == "Validate draft", body
    assert q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:lead-html'") == [("failed_retryable",)]
    assert len([l for l in jsonl("llm") if "HTML-ONCE" in l["user"]]) == 1, "a repair call was made"
    assert not [m for m in jsonl("notify") if "crm:lead-html" in m.get("text", "")], "a human was told"
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-html", "HTML-ONCE: a quote please"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    return "503 failed_retryable, no repair call; delivered again: 202 awaiting_human"
check("the model's endpoint answers 200 with an HTML page: a failed call, retried, not bad output",
      model_html_200)

def expired_way_on():
    # lead-2 waits for a human; its approval expires unused.
    q("UPDATE approvals SET expires_at = now() - interval '1 second' WHERE idempotency_key = 'crm:lead-2'")
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-2", "REPAIR-ME: a quote please"))
    assert code == 200 and body["state"] == "awaiting_human", (code, body)
    q("SELECT * FROM outbox_reopen_approval('crm:lead-2', 'n8n-check', 'the approver was away')")
    code, body = http("POST", f"{HOOK}/outbox/lead", ev("lead-2", "REPAIR-ME: a quote please"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    links = wait_for(lambda: [m for m in jsonl("notify") if m.get("key") == "crm:lead-2"][1:], 20, "a second link")
    assert q("SELECT count(*) FROM approvals WHERE idempotency_key = 'crm:lead-2'") == [(2,)]
    return "outbox_reopen_approval, then the same event again: a new draft and a new link"
check("an expired approval: re-opened by the operator, the event delivered again asks again", expired_way_on)

def auto():
    code, body = http("POST", f"{HOOK}/outbox/ticket",
                      ev("t-1", "When are you open?", category="opening_hours"))
    assert code == 202 and body["status"] == "queued" and body["decided"] == "auto", (code, body)
    row = q("SELECT approved_by, metadata->>'approval' FROM outbox_effects WHERE idempotency_key = 'crm:t-1'")
    assert row == [(None, "auto:template:opening_hours")], row
    return f"queued automatically, effect {body['effect_id']}"
check("approve-by-exception: eligible ticket enqueued without a human", auto)
check("dispatcher delivers the automatic effect", delivered_once("t-1", "crm:t-1"))

def escalated():
    code, body = http("POST", f"{HOOK}/outbox/ticket",
                      ev("t-2", "I want a refund", category="refund"))
    assert code == 202 and body["status"] == "awaiting_human", (code, body)
    assert q("SELECT count(*) FROM outbox_effects WHERE idempotency_key = 'crm:t-2'") == [(0,)]
check("approve-by-exception: other tickets go to a human", escalated)

def reject():
    msgs = wait_for(lambda: [m for m in jsonl("notify") if m.get("key") == "crm:t-2"], 20, "t-2 link")
    token = urllib.parse.parse_qs(urllib.parse.urlparse(msgs[0]["approval_url"]).query)["token"][0]
    code, html = http("POST", f"{HOOK}/outbox/approval/decide", {"token": token, "decision": "reject"},
                      form=True, headers={"X-Auth-Request-Email": "lead@example.com"})
    assert code == 200 and "Rejected" in html, (code, html)
    assert q("SELECT state FROM workflow_runs WHERE idempotency_key = 'crm:t-2'") == [("failed_terminal",)]
    assert q("SELECT count(*) FROM outbox_effects WHERE idempotency_key = 'crm:t-2'") == [(0,)]
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
    assert code == 409 and c["status"] == "finished" and c["cancelled"] is False, (code, c)
    st, err = q("SELECT state, last_error FROM outbox_effects WHERE effect_id = %s", body["effect_id"])[0]
    assert st == "failed" and err.startswith("cancelled"), (st, err)
    return "scheduled, cancelled inside the window; a second cancel: 409 finished"
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

def ctl(*args):
    r = subprocess.run([OUTBOXCTL, "--db", dsn, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout

def cancel_too_late():
    # Sends held (kill switch off), so the effect stays pending past its window.
    ctl("kill-switch", "off", "--operator", "n8n-check", "--reason", "hold sends for the late cancel")
    try:
        code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-late", "Reminder: cancelled too late"))
        assert code == 202, (code, body)
        eid = body["effect_id"]
        wait_for(lambda: q("SELECT available_at < now() FROM outbox_effects WHERE effect_id = %s", eid)[0][0],
                 60, "the window to pass")
        for _ in range(2):      # retrying changes nothing, and says so
            code, c, h = request("POST", f"{HOOK}/outbox/cancel", {"effect_id": eid, "reason": "too late"})
            assert code == 409 and c["status"] == "too_late" and c["cancelled"] is False and is_kit(h, c), (code, c)
            assert "outboxctl cancel" in c["message"], c
        assert q("SELECT state FROM outbox_effects WHERE effect_id = %s", eid) == [("pending",)]
        # The operator's way, as the answer says.
        out = ctl("cancel", eid, "--operator", "n8n-check", "--reason", "customer withdrew late")
        assert "cancelled: customer withdrew late" in out, out
    finally:
        ctl("kill-switch", "on", "--operator", "n8n-check", "--reason", "late cancel done")
    state["late"] = eid
    return "409 too_late twice, effect still pending; outboxctl cancel stopped it"
check("act-with-window: cancel past the window answers 409 too_late, not 'try again'", cancel_too_late)

def cancel_too_late_while_paused():
    # A paused scope parks the due effect at available_at 'infinity': the
    # window is the producer's all the same.
    ctl("kill-switch", "off", "--type", "http", "--operator", "n8n-check", "--reason", "hold http for the paused cancel")
    try:
        code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-paused", "Reminder: paused, cancelled too late"))
        assert code == 202, (code, body)
        eid = body["effect_id"]
        wait_for(lambda: q("SELECT l.available_at = 'infinity' AND b.available_at < now() FROM effect_live l "
                           "JOIN effect_outbox b USING (effect_id) WHERE effect_id = %s", eid) == [(True,)],
                 90, "the window to pass and the paused scope to park the effect")
        code, c, h = request("POST", f"{HOOK}/outbox/cancel", {"effect_id": eid, "reason": "too late"})
        assert code == 409 and c["status"] == "too_late" and c["cancelled"] is False and is_kit(h, c), (code, c)
        assert q("SELECT state FROM outbox_effects WHERE effect_id = %s", eid) == [("pending",)]
        ctl("cancel", eid, "--operator", "n8n-check", "--reason", "paused and withdrawn late")
    finally:
        ctl("kill-switch", "on", "--type", "http", "--operator", "n8n-check", "--reason", "paused cancel done")
    return "parked by the pause, past its window: 409 too_late"
check("act-with-window: cancel past the window while its scope is paused answers 409 too_late", cancel_too_late_while_paused)

def key_of_another_login():
    # A key another producer login claimed: never this login's, so the
    # answer says a retry cannot succeed, and names nobody.
    q("INSERT INTO workflow_runs (idempotency_key, state, payload_hash, owner_role) "
      "VALUES ('crm:other-login-1', 'completed', 'x', 'n8n_check_other_login')")
    for _ in range(2):
        code, c, h = request("POST", f"{HOOK}/outbox/lead", ev("other-login-1"))
        assert code == 409 and c["status"] == "unavailable" and is_kit(h, c), (code, c)
        assert "n8n_check_other_login" not in json.dumps(c) and "cannot succeed" in c["message"], c
    return "409 unavailable twice, the other login not named"
check("a key another producer login holds: 409 unavailable, not 500 'try again later'", key_of_another_login)

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
    sig = "outbox_claim_run_status(text, text, uuid, integer)"
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
    sig = "outbox_cancel_status(uuid, text, text)"
    code, body = http("POST", f"{HOOK}/outbox/scheduled", ev("s-f", "Reminder: failing cancel"))
    assert code == 202, (code, body)
    grant(sig, False)
    try:
        code, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"]})
    finally:
        grant(sig, True)
    assert code >= 500 and isinstance(c, dict) and c.get("cancelled") is False, (code, c)
    code2, c = http("POST", f"{HOOK}/outbox/cancel", {"effect_id": body["effect_id"]})
    assert code2 == 200 and c["cancelled"] is True, (code2, c)
    return f"{code}, cancelled: false; again: cancelled"
check("a failing cancel answers an error status, not an empty 200", failing_cancel)

def n8n_pid():
    with open(f"{work}/n8n.pid") as f:
        return int(f.read())

def exited(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True

def sigterm_mid_execution():
    out = {}
    def post():
        out["r"] = request("POST", f"{HOOK}/outbox/lead", ev("lead-term", "SLOW-ONCE: a quote please"))
    t = threading.Thread(target=post)
    t.start()
    wait_for(lambda: [l for l in jsonl("llm") if "SLOW-ONCE" in l["user"]], 60, "the model call")
    pid = n8n_pid()
    os.kill(pid, signal.SIGTERM)
    t.join(150)
    code, body, h = out["r"]
    assert code in (0, 500) and not is_kit(h, body), (code, str(body)[:300])
    wait_for(lambda: exited(pid), 120, "n8n to exit")
    st, left = q("SELECT state, extract(epoch FROM lease_expires_at - now()) FROM workflow_runs "
                 "WHERE idempotency_key = 'crm:lead-term'")[0]
    assert st == "processing" and left > 0, (st, left)
    # Start n8n again, now without its webhook sandbox.
    env = dict(os.environ, N8N_INSECURE_DISABLE_WEBHOOK_IFRAME_SANDBOX="true")
    with open(f"{work}/n8n-restarted.log", "w") as log:
        p = subprocess.Popen([os.environ["N8N_CMD"], "start"], env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    with open(f"{work}/n8n.pid", "w") as f:
        f.write(str(p.pid))
    state["term_answer"] = (code, str(body)[:80])
    return (f"n8n answered {code} {'(no answer)' if code == 0 else repr(str(body)[:60])}, not the kit's; "
            f"run still processing, lease {left:.0f} s to go")
check("n8n stopped with SIGTERM mid-execution: n8n's own answer, the run waits for its lease",
      sigterm_mid_execution)
if "term_answer" in state:
    check("n8n restarting: its own answers carry no kit marker, the retried event is taken once",
          lambda: startup_window("boot-2"))

    def after_the_lease():
        code, body, h = request("POST", f"{HOOK}/outbox/lead", ev("lead-term", "SLOW-ONCE: a quote please"))
        waited = "the lease had expired during the restart"
        if code == 409:
            assert body["status"] == "in_progress" and is_kit(h, body), (code, body)
            left = q("SELECT extract(epoch FROM lease_expires_at - now()) FROM workflow_runs "
                     "WHERE idempotency_key = 'crm:lead-term'")[0][0]
            ra = int(h["retry-after"])
            assert ra == body["retry_after_seconds"] and abs(ra - left) <= 2, (ra, left, body)
            time.sleep(ra + 1)          # what the answer says to wait
            code, body, h = request("POST", f"{HOOK}/outbox/lead", ev("lead-term", "SLOW-ONCE: a quote please"))
            waited = f"409 in_progress, Retry-After {ra} s"
        assert code == 202 and body["status"] == "awaiting_human" and is_kit(h, body), (code, body)
        calls = sorted({l["n"] for l in jsonl("llm") if "SLOW-ONCE" in l["user"]})
        assert calls == [1, 2], f"model calls {calls}: the interrupted one and one after the take-over"
        return waited + "; then taken over: 202 awaiting_human"
    check("delivered again after the restart: 409 with Retry-After until the lease expires, then taken over",
          after_the_lease)

    def page_without_sandbox():
        msgs = wait_for(lambda: [m for m in jsonl("notify") if m.get("key") == "crm:lead-term"], 20, "the link")
        code, html, h = request("GET", msgs[-1]["approval_url"])
        assert code == 200 and "Approval needed" in html, (code, html[:200])
        assert "content-security-policy" not in h, h.get("content-security-policy")
        assert h.get("x-frame-options") == "DENY", h
        return "no Content-Security-Policy at all (n8n drops the workflow's); X-Frame-Options: DENY"
    check("N8N_INSECURE_DISABLE_WEBHOOK_IFRAME_SANDBOX=true: the page has no CSP", page_without_sandbox)

def all_marked():
    assert not unmarked, f"kit answers without the X-Outbox-Kit marker: {unmarked[:5]}"
    assert not delivered("s-late"), "the effect cancelled by the operator was sent"
check("every kit answer carried its marker; the late-cancelled effect was never sent", all_marked)

passed = sum(1 for _, ok in results if ok)
failed = len(results) - passed
print(f"n8n check (engine {engine}): {passed} passed, {failed} failed; "
      f"webhooks ready {T_READY:.0f} s after n8n's start, scenarios {time.monotonic() - T0 - T_READY:.0f} s")
sys.exit(1 if failed else 0)
