#!/bin/sh
# examples/n8n/check-with-n8n.sh: the manual check of the n8n kit against a
# real n8n.  Too slow and too big for CI (the install takes ~13 minutes and
# ~1.8 GB once; a check run about two minutes), so it is run by hand:
#
#   sh examples/n8n/check-with-n8n.sh install   # install n8n only (once)
#   sh examples/n8n/check-with-n8n.sh           # install if needed, then check
#
# What the check does, all on loopback and in a temporary folder:
#   1. a throwaway PostgreSQL (tests/lib/pg.sh), migrated with outboxctl, a
#      LOGIN role in outbox_producer for n8n's credential, the kill switch on;
#   2. a local sink that plays the OpenAI-compatible model, the approver's
#      chat webhook and the helpdesk API the effects are delivered to;
#   3. build/outbox-dispatcher (AI_ACTIONS_ENABLED=true) on that database;
#   4. n8n with the workflows of examples/n8n imported (their Config nodes
#      pointed at the sink) and activated, and the credential imported;
#   5. posts sample events and drives every path: approve before act (with
#      the duplicate delivery, the bounded repair and a validation failure),
#      the approval page and decision (unsigned, approved, replayed), approve
#      by exception (automatic and escalated), act with a window (cancelled,
#      and sent after the window), and waits for the dispatcher to deliver
#      each approved effect to the sink with its idempotency key.
# It ends with "n8n check: N passed, N failed".
#
# Environment: N8N_HOME (install folder, default /var/tmp/outbox-n8n),
# N8N_VERSION (default 1.123.81), BUILD_DIR (default build), KEEP=1 keeps
# the temporary folder (logs of n8n, the dispatcher and the sink).
#
# Known to work here: n8n 1.123.81 on Node 20 installs with npm overrides
# pinning xlsx to 0.18.5 (the default pulls it from a host outside the npm
# registry) and isolated-vm to 5.0.4 (6.x needs Node 22); it runs with
# N8N_EXPRESSION_ENGINE=legacy and telemetry off.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
N8N_HOME=${N8N_HOME:-/var/tmp/outbox-n8n}
N8N_VERSION=${N8N_VERSION:-1.123.81}
BUILD_DIR=${BUILD_DIR:-build}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
N8N=$N8N_HOME/node_modules/.bin/n8n

install_n8n() {
    if [ -x "$N8N" ] && [ "$(cat "$N8N_HOME/.installed" 2>/dev/null)" = "$N8N_VERSION" ]; then
        echo "n8n $N8N_VERSION already installed in $N8N_HOME"
        return 0
    fi
    command -v node >/dev/null && command -v npm >/dev/null || {
        echo "check-with-n8n: needs node >= 20.19 and npm" >&2; exit 1; }
    node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=19)?0:1)' || {
        echo "check-with-n8n: n8n $N8N_VERSION needs node >= 20.19 (this is $(node --version))" >&2; exit 1; }
    mkdir -p "$N8N_HOME"
    cat > "$N8N_HOME/package.json" <<EOF
{
  "name": "outbox-n8n-check",
  "private": true,
  "dependencies": { "n8n": "$N8N_VERSION" },
  "overrides": { "xlsx": "0.18.5", "isolated-vm": "5.0.4" }
}
EOF
    echo "installing n8n $N8N_VERSION into $N8N_HOME (about 13 minutes, 1.8 GB)..."
    (cd "$N8N_HOME" && npm install --no-audit --no-fund)
    echo "$N8N_VERSION" > "$N8N_HOME/.installed"
}

if [ "${1:-}" = install ]; then
    install_n8n
    exit 0
fi
install_n8n

[ -x "$BUILD_DIR/outboxctl" ] || { echo "check-with-n8n: build first (make)" >&2; exit 1; }
HAVE_DISPATCHER=1
[ -x "$BUILD_DIR/outbox-dispatcher" ] || {
    HAVE_DISPATCHER=0
    echo "check-with-n8n: $BUILD_DIR/outbox-dispatcher is not built: delivery steps will fail" >&2; }

free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

cd "$ROOT"
. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-n8n-check.XXXXXX)
chmod 755 "$work"
PIDS=""
cleanup() {
    for p in $PIDS; do kill "$p" 2>/dev/null || true; done
    for p in $PIDS; do
        i=0
        while kill -0 "$p" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
        kill -9 "$p" 2>/dev/null || true
    done
    pg_stop "$work/pg"
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. PostgreSQL, schema, roles, kill switch.
pg_start "$work/pg" >/dev/null
"$PG_BIN/createdb" outbox
DB="host=$PGHOST port=$PGPORT dbname=outbox user=postgres"
"$BUILD_DIR/outboxctl" --db "$DB" migrate
"$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -d outbox <<'SQL'
CREATE ROLE n8n_check_producer LOGIN PASSWORD 'n8n-check' IN ROLE outbox_producer;
SQL
"$BUILD_DIR/outboxctl" --db "$DB" kill-switch on --operator n8n-check --reason "manual n8n check"

# 2. The sink: model, approver notifications, delivery target.
SINK_PORT=$(free_port)
/usr/bin/python3 - "$SINK_PORT" "$work" > "$work/sink.log" 2>&1 <<'PY' &
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, work = int(sys.argv[1]), sys.argv[2]
lock = threading.Lock()
seen = {}
def record(name, obj):
    with lock, open(f"{work}/{name}.jsonl", "a") as f:
        f.write(json.dumps(obj) + "\n")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        sys.stderr.write("sink: " + (a[0] % a[1:]) + "\n")
    def reply(self, code, obj):
        b = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n).decode("utf-8", "replace")
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        if self.path.startswith("/v1/chat/completions"):
            msgs = body.get("messages", [])
            user = msgs[1]["content"] if len(msgs) > 1 else ""
            with lock:
                seen[user] = seen.get(user, 0) + 1
                k = seen[user]
            good = json.dumps({"intent": "reply", "subject": "Your quote request",
                               "reply": "Thanks for reaching out. A quote follows today."})
            if "ALWAYS-INVALID" in user or ("REPAIR-ME" in user and k == 1):
                content = "Sure! I would reply that we are happy to help."
            else:
                content = good
            record("llm", {"user": user, "n": k, "answer": content})
            return self.reply(200, {"id": "cmpl-1", "model": "fake-llm-1",
                                    "choices": [{"index": 0, "message": {"role": "assistant",
                                                                         "content": content}}]})
        if self.path.startswith("/notify"):
            record("notify", body)
            return self.reply(200, {"ok": True})
        if self.path.startswith("/deliver"):
            record("deliver", {"headers": {k.lower(): v for k, v in self.headers.items()},
                               "body": body})
            with lock:
                seen["deliver"] = seen.get("deliver", 0) + 1
                k = seen["deliver"]
            return self.reply(200, {"id": f"sink-{k}"})
        self.reply(404, {"error": "no such path"})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
PY
PIDS="$PIDS $!"

# 3. The dispatcher.
if [ $HAVE_DISPATCHER = 1 ]; then
    cat > "$work/dispatcher.ini" <<EOF
[database]
conninfo = $DB

[dispatcher]
worker_name = n8n-check
provider_dir = $BUILD_DIR/providers
lease_seconds = 30
poll_interval_ms = 500

[metrics]
listen =

[provider.http]
allow_hosts = 127.0.0.1
timeout_ms = 5000
EOF
    AI_ACTIONS_ENABLED=true "$BUILD_DIR/outbox-dispatcher" --config "$work/dispatcher.ini" \
        > "$work/dispatcher.log" 2>&1 &
    PIDS="$PIDS $!"
fi

# 4. n8n: its own folder, telemetry off, the kit imported and activated.
N8N_PORT=$(free_port)
export N8N_USER_FOLDER="$work/n8n" N8N_PORT N8N_LISTEN_ADDRESS=127.0.0.1 N8N_HOST=127.0.0.1 \
    N8N_PROTOCOL=http WEBHOOK_URL="http://127.0.0.1:$N8N_PORT/" \
    N8N_EXPRESSION_ENGINE=legacy N8N_DIAGNOSTICS_ENABLED=false \
    N8N_VERSION_NOTIFICATIONS_ENABLED=false N8N_TEMPLATES_ENABLED=false \
    N8N_PERSONALIZATION_ENABLED=false N8N_HIRING_BANNER_ENABLED=false \
    EXTERNAL_FRONTEND_HOOKS_URLS= N8N_DIAGNOSTICS_CONFIG_FRONTEND= N8N_DIAGNOSTICS_CONFIG_BACKEND= \
    N8N_ENCRYPTION_KEY="check-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" \
    N8N_ENFORCE_SETTINGS_FILE_PERMISSIONS=true N8N_BLOCK_ENV_ACCESS_IN_NODE=true \
    N8N_SECURE_COOKIE=false N8N_LOG_LEVEL=${N8N_LOG_LEVEL:-info} \
    EXECUTIONS_DATA_SAVE_ON_SUCCESS=all EXECUTIONS_DATA_SAVE_ON_ERROR=all
mkdir -p "$N8N_USER_FOLDER" "$work/import"

/usr/bin/python3 - "$ROOT/examples/n8n" "$work/import" "$SINK_PORT" "$N8N_PORT" "$PGPORT" <<'PY'
import glob, json, os, sys
src, dst, sink, n8n, pgport = sys.argv[1:]
sink_url, hook = f"http://127.0.0.1:{sink}", f"http://127.0.0.1:{n8n}/webhook"
override = {
    "llm_url": f"{sink_url}/v1/chat/completions", "llm_model": "fake-llm-1",
    "llm_timeout_ms": 10000, "notify_url": f"{sink_url}/notify",
    "deliver_url": f"{sink_url}/deliver", "approval_page_url": f"{hook}/outbox/approval",
    "decision_url": f"{hook}/outbox/approval/decide", "cancel_url": f"{hook}/outbox/cancel",
    "window_seconds": 8,
}
for path in sorted(glob.glob(os.path.join(src, "*.json"))):
    wf = json.load(open(path))
    for n in wf["nodes"]:
        if n["type"] == "n8n-nodes-base.set":
            for a in n["parameters"]["assignments"]["assignments"]:
                if a["name"] in override:
                    a["value"] = override[a["name"]]
    json.dump(wf, open(os.path.join(dst, os.path.basename(path)), "w"), indent=1)
cred = [{"id": "outboxProducerPg", "name": "outbox producer", "type": "postgres",
         "data": {"host": "127.0.0.1", "port": int(pgport), "database": "outbox",
                  "user": "n8n_check_producer", "password": "n8n-check", "ssl": "disable",
                  "allowUnauthorizedCerts": False, "sshTunnel": False, "maxConnections": 10}}]
json.dump(cred, open(os.path.join(dst, "..", "credentials.json"), "w"))
PY

echo "importing into n8n $("$N8N" --version 2>/dev/null | tail -1)..."
"$N8N" import:credentials --input="$work/credentials.json" > "$work/import.log" 2>&1
for f in "$work"/import/*.json; do
    "$N8N" import:workflow --input="$f" >> "$work/import.log" 2>&1
done
"$N8N" update:workflow --all --active=true >> "$work/import.log" 2>&1
"$N8N" start > "$work/n8n.log" 2>&1 &
PIDS="$PIDS $!"

# 5. Drive every path.
set +e
/usr/bin/python3 - "$work" "$N8N_PORT" "$DB" "$HAVE_DISPATCHER" <<'PY'
import json, sys, time, urllib.error, urllib.parse, urllib.request
import psycopg2
work, n8n_port, dsn, have_dispatcher = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
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
check("n8n answers on every production webhook", lambda: wait_for(ready, 300, "webhooks") and None)

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

def token_only_in_message():
    msgs = [m for m in jsonl("notify") if m.get("key") == "crm:lead-1"]
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

passed = sum(1 for _, ok in results if ok)
failed = len(results) - passed
print(f"n8n check: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
rc=$?
if [ $rc -ne 0 ]; then
    echo "--- n8n log (last 40 lines)"; tail -40 "$work/n8n.log"
    echo "--- import log"; tail -20 "$work/import.log"
    [ -f "$work/dispatcher.log" ] && { echo "--- dispatcher log (last 20 lines)"; tail -20 "$work/dispatcher.log"; }
fi
exit $rc
