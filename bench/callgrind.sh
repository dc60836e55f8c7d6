#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/callgrind.sh: the worker's own CPU per effect, as instruction
# counts (valgrind --tool=callgrind), which do not depend on the machine's
# load: one worker drains N effects to nginx; prints Ir per effect and the
# top functions.  See bench/README.md.
#
#   BUILD_DIR   where the binaries are (default build-cpu: a release build)
#   N           effects (default 5000)
#   TOP         functions listed (default 15)
#   OUT         where the callgrind file is kept (default: scratch, removed)
#
# Only the event loop is counted (--toggle-collect=event_base_loop): not the
# start (config, plugins, TLS init) nor the exit; the connects and the first
# queries of the loop are, and cost well under 1 % at N=5000.
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-cpu}
N=${N:-5000}
TOP=${TOP:-15}
PATH=$PATH:/usr/sbin:/sbin
export PATH

for b in outbox-dispatcher outboxctl providers/outbox_http.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "callgrind: $BUILD_DIR/$b missing: make BUILD=$BUILD_DIR first" >&2; exit 1; }
done
for c in valgrind callgrind_annotate nginx psql; do
    command -v $c >/dev/null 2>&1 || { echo "callgrind: $c missing" >&2; exit 1; }
done

. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-callgrind.XXXXXX)
chmod 755 "$work"
nginx_pid=""
worker_pid=""
cleanup() {
    [ -z "$worker_pid" ] || kill "$worker_pid" 2>/dev/null || true
    [ -z "$nginx_pid" ] || kill "$nginx_pid" 2>/dev/null || true
    pg_stop "$work/pg"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The database, as bench/run.sh makes it.
pg_start "$work/pg" >/dev/null || exit 1
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
"$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
"$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "callgrind" >/dev/null

# The sink: bench.py's nginx, answering 200 {"id":"x"} from memory.
port=$(pg_free_port)
mkdir -p "$work/nginx"
cat >"$work/nginx/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path $work/nginx/body;
    proxy_temp_path $work/nginx/proxy;
    fastcgi_temp_path $work/nginx/fastcgi;
    uwsgi_temp_path $work/nginx/uwsgi;
    scgi_temp_path $work/nginx/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    default_type application/json;
    server {
        listen 127.0.0.1:$port;
        location /ok { return 200 '{"id":"x"}'; }
    }
}
EOF
nginx -p "$work/nginx" -c nginx.conf -e "$work/nginx/error.log" >/dev/null 2>&1 &
nginx_pid=$!

# N runs and one pending effect each, bench.py's ~270-byte webhook payload.
payload='{"method": "POST", "headers": {"X-Bench": "1"}, "body": {"event": "invoice.paid", "invoice": "INV-000123", "amount_cents": 129900, "currency": "EUR", "customer": {"id": "cus_42", "email": "a@example.com"}, "note": "bench payload of a typical webhook size"}}'
psql -q -v ON_ERROR_STOP=1 -d bench >/dev/null <<EOF
INSERT INTO workflow_runs (idempotency_key, state, payload_hash)
  SELECT 't' || g, 'processing', 'h' FROM generate_series(1, $N) g;
INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload)
  SELECT 't' || g, 'http', 'http://127.0.0.1:$port/ok', '$payload'::jsonb FROM generate_series(1, $N) g;
VACUUM ANALYZE;
EOF

# The worker: bench.py's default config ([log] level = warn).
cat >"$work/worker.ini" <<EOF
[database]
conninfo = $ci
[dispatcher]
worker_name = callgrind
provider_dir = $PWD/$BUILD_DIR/providers
[metrics]
listen =
[log]
level = warn
[provider.http]
allow_hosts = 127.0.0.1
EOF
out=${OUT:-$work/callgrind.out}
AI_ACTIONS_ENABLED=true valgrind --tool=callgrind --callgrind-out-file="$out" \
    --toggle-collect=event_base_loop \
    "$BUILD_DIR/outbox-dispatcher" --config "$work/worker.ini" \
    >/dev/null 2>"$work/worker.log" &
worker_pid=$!

# Until every effect has an attempt and nothing is pending or sending
# (the live queue's rows due at a finite time; `unknown` is due at infinity).
start=$(date +%s)
while :; do
    kill -0 "$worker_pid" 2>/dev/null || { echo "callgrind: worker exited:" >&2; tail -20 "$work/worker.log" >&2; exit 1; }
    left=$(psql -tA -d bench -c "SELECT (SELECT count(*) FROM effect_history WHERE outcome_class IS NOT NULL) >= $N
        AND NOT EXISTS (SELECT 1 FROM effect_live WHERE available_at < 'infinity')")
    [ "$left" = t ] && break
    [ $(($(date +%s) - start)) -lt 1800 ] || { echo "callgrind: not drained in 30 min" >&2; exit 1; }
    sleep 0.5
done
kill -TERM "$worker_pid"
wait "$worker_pid" || true
worker_pid=""
done_n=$(psql -tA -d bench -c "SELECT count(*) FROM effect_history WHERE state = 'completed'")

total=$(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
echo "effects completed: $done_n of $N"
echo "Ir total: $total"
echo "Ir/effect: $((total / N))"
echo
# Inclusive: without the chain from main() to the event loop (all ~100 %).
echo "top $TOP inclusive (under the event loop):"
callgrind_annotate --inclusive=yes "$out" 2>/dev/null | grep -E '^ *[0-9,]+ +\( ?[0-9]' |
    awk '{ p = $0; sub(/^[^(]*\( */, "", p); sub(/%.*/, "", p); if (p + 0 < 99) print }' | head -n "$TOP"
echo
echo "top $TOP self:"
callgrind_annotate "$out" 2>/dev/null | grep -E '^ *[0-9,]+ +\( ?[0-9]' | grep -v 'PROGRAM TOTALS' | head -n "$TOP"
