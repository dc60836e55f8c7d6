#!/bin/sh
# SPDX-License-Identifier: ISC
# tests/demo.sh: the dispatcher end to end on a throwaway PostgreSQL.
#
#  1. start PostgreSQL in a temporary folder and migrate it
#  2. start a local HTTP sink (tests/servers/http_sink.py)
#  3. play the seeds' approve-before-act path with the producer functions:
#     claim a run, create an approval (hash only), consume it (which
#     enqueues the effects) - plus one direct enqueue that will fail
#  4. turn the kill switch on, start two workers, wait for delivery
#  5. show the operator's view: outboxctl status, the attempts log, what
#     the sink received; then stop everything
#
# BUILD_DIR picks the binaries (default build).
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-demo.XXXXXX)
chmod 755 "$work"
sink_pid=""; w1=""; w2=""
cleanup() {
    for p in $w1 $w2; do kill -TERM "$p" 2>/dev/null || true; done
    for p in $w1 $w2; do wait "$p" 2>/dev/null || true; done
    [ -n "$sink_pid" ] && kill "$sink_pid" 2>/dev/null || true
    pg_stop "$work/pg"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }

step "PostgreSQL in $work/pg"
pg_start "$work/pg"
psql -q -c "CREATE DATABASE demo"
DB="host=$PGHOST port=$PGPORT user=$PGUSER dbname=demo"
"$BUILD_DIR/outboxctl" --db "$DB" migrate

step "local HTTP sink"
/usr/bin/python3 tests/servers/http_sink.py 0 --quiet --log "$work/sink.jsonl" > "$work/sink.out" 2>&1 &
sink_pid=$!
i=0
while ! grep -q listening "$work/sink.out"; do
    i=$((i + 1)); [ $i -gt 100 ] && { echo "sink did not start" >&2; exit 1; }
    sleep 0.05
done
SINK="http://127.0.0.1:$(awk '/listening/ {print $2}' "$work/sink.out")"
echo "sink at $SINK"

step "producer: claim, approval, consume (one statement each)"
psql -q -d demo -v sink="$SINK" <<'SQL'
\set ON_ERROR_STOP on
-- Step 2: claim the run (a new key gets status 'claimed').
SELECT status, state, version FROM outbox_claim_run('lead-42', 'sha256-of-input',
       '6f1c2a53-59a8-4c57-9d3c-0c1a3c6e0b11', 300);
-- A duplicate delivery of the same webhook: no second lease.
SELECT status, state FROM outbox_claim_run('lead-42', 'sha256-of-input',
       '9a0e7d7e-0f0b-4a0e-8a55-2c1d2f7b9e22', 300);
-- Step 6: CAS to awaiting_human + a one-time approval; only the token's
-- SHA-256 is stored (the raw token would go to the approver by email).
SELECT approval_id IS NOT NULL AS approval_created FROM outbox_create_approval(
       'lead-42', '6f1c2a53-59a8-4c57-9d3c-0c1a3c6e0b11', 0,
       sha256('demo-raw-token-256-bits'::bytea), ARRAY['approve','reject'], 3600,
       jsonb_build_array(
         jsonb_build_object('effect_type', 'http', 'target', :'sink' || '/ok',
                            'payload', jsonb_build_object('body', jsonb_build_object('note', 'call back')),
                            'metadata', jsonb_build_object('workflow_version', 'v3', 'model', 'demo-model-1')),
         jsonb_build_object('effect_type', 'http', 'target', :'sink' || '/flaky/1/503?retry_after=1',
                            'payload', jsonb_build_object('body', 'crm note'))));
-- Step 7: the approver's POST consumes the token and enqueues, atomically.
SELECT decision, effect_type, target FROM outbox_consume_approval(
       sha256('demo-raw-token-256-bits'::bytea), 'approve', 'alice@example.com');
-- Used once: a second consume returns nothing.
SELECT count(*) AS second_consume FROM outbox_consume_approval(
       sha256('demo-raw-token-256-bits'::bytea), 'approve', 'alice@example.com');
-- Approve-by-exception, with one that will fail (HTTP 422) and one whose
-- outcome will be ambiguous (HTTP 500: it goes to unknown, not re-sent).
INSERT INTO workflow_runs (idempotency_key, state, payload_hash) VALUES ('ticket-7', 'processing', 'h');
SELECT inserted FROM outbox_enqueue('ticket-7', 'http', :'sink' || '/status/422', '{}');
SELECT inserted FROM outbox_enqueue('ticket-7', 'http', :'sink' || '/status/500', '{}');
SQL

step "kill switch on (a new database starts with sends disabled)"
"$BUILD_DIR/outboxctl" --db "$DB" kill-switch on --operator demo --reason "demo run"

step "two workers"
for n in 1 2; do
    cat > "$work/w$n.ini" <<EOF
[database]
conninfo = $DB
[dispatcher]
worker_name = demo-w$n
poll_interval_ms = 500
[metrics]
listen =
[provider.http]
allow_hosts = 127.0.0.1
timeout_ms = 3000
backoff_base_ms = 200
EOF
done
AI_ACTIONS_ENABLED=true "$BUILD_DIR/outbox-dispatcher" --config "$work/w1.ini" 2> "$work/w1.log" &
w1=$!
AI_ACTIONS_ENABLED=true "$BUILD_DIR/outbox-dispatcher" --config "$work/w2.ini" 2> "$work/w2.log" &
w2=$!

i=0
until [ "$(psql -At -d demo -c "SELECT count(*) FROM outbox_effects WHERE state IN ('pending','sending')")" = 0 ]; do
    i=$((i + 1)); [ $i -gt 300 ] && { echo "effects not delivered in 30 s" >&2; tail "$work"/w*.log >&2; exit 1; }
    sleep 0.1
done

step "operator's view: outboxctl status"
"$BUILD_DIR/outboxctl" --db "$DB" status

step "effects"
psql -d demo -c "SELECT effect_type, target, state, attempts, provider_id, last_error_class AS error
                 FROM outbox_effects ORDER BY created_at"
step "runs (the settled state: as their effects made them)"
# The workers do not write runs when effects finish; every reader settles
# the runs it reads first (outbox_settle_runs), and so does this one, so
# the state shown is the one outboxctl and the producer functions report.
psql -q -d demo -c "SELECT outbox_settle_runs(NULL)" >/dev/null
psql -d demo -c "SELECT idempotency_key, state FROM workflow_runs ORDER BY 1"
step "attempts log"
psql -d demo -c "SELECT worker, attempt, outcome_class, provider_status, provider_id
                 FROM effect_attempts ORDER BY attempt_id"
step "unknown effects waiting for an operator"
"$BUILD_DIR/outboxctl" --db "$DB" unknown list
step "one structured log line per attempt (worker 1)"
grep '"event":"attempt"' "$work/w1.log" "$work/w2.log" | head -3 | cut -d: -f2-
step "the sink received"
/usr/bin/python3 - "$work/sink.jsonl" <<'PY'
import collections, json, sys
reqs = [json.loads(l) for l in open(sys.argv[1])]
per_key = collections.Counter(r["key"] for r in reqs)
for r in reqs:
    print(f"  {r['method']} {r['path']:<24} Idempotency-Key {r['key'][:16]}...")
print(f"{len(reqs)} requests, {len(per_key)} keys; the only key seen twice is the one the "
      f"sink answered 503 + Retry-After first: {[k[:16] for k, n in per_key.items() if n > 1]}")
PY
echo
echo "demo done: every effect ended completed, failed or unknown, and none was sent twice."
