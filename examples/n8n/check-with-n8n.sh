#!/bin/sh
# SPDX-License-Identifier: ISC
# examples/n8n/check-with-n8n.sh: the end-to-end check of the n8n kit
# against a real n8n.  The suite runs it on the default engine
# (tests/n8n/test_n8n_real.py, part of `sh scripts/test.sh`); by hand:
#
#   sh examples/n8n/check-with-n8n.sh install   # install n8n only
#   sh examples/n8n/check-with-n8n.sh           # check on n8n's default engine
#   sh examples/n8n/check-with-n8n.sh legacy    # check on the legacy engine
#   sh examples/n8n/check-with-n8n.sh both      # default, then legacy
#
# Engines: n8n 1.123 evaluates expressions with its `vm` engine (isolated
# V8 contexts) unless N8N_EXPRESSION_ENGINE=legacy; the kit must behave the
# same on both.  The check runs n8n with N8N_EXPRESSION_ENGINE unset (the
# default) or set to legacy, says which in every result line, and confirms
# it from n8n's own start-up log (n8n warns when legacy is on).
#
# Where n8n comes from:
#   N8N_BIN=/path/to/n8n   use that executable (e.g. a global install);
#                          nothing is installed or changed
#   otherwise              the n8n pinned by tests/n8n/npm/package-lock.json,
#                          installed with `npm ci` (Node >= 20.19) into
#                          N8N_CACHE/n8n-<first 16 hex of the lock's sha256>
#                          and reused by every later check on the machine.
#                          N8N_CACHE is /var/cache/outbox-dispatcher for
#                          root, else ~/.cache/outbox-dispatcher.  1.8 GB;
#                          5 minutes on a quiet 2-core machine, 10 at a
#                          load of 7 (most of it compiling sqlite3 and
#                          isolated-vm).
#
# Ports: N8N_PORT, SINK_PORT, METRICS_PORT and PGPORT_FIXED fix n8n's, the
# local sink's, the dispatcher's metrics and PostgreSQL's ports (all on
# 127.0.0.1); unset, free ones are picked.  BUILD_DIR (default build)
# holds outboxctl and outbox-dispatcher (`make`).  CHECK_LEASE_SECONDS
# (default 120) is the runs' lease.  KEEP=1 keeps the temporary folder
# (logs of n8n, dispatcher and sink).
#
# What one check does, all on loopback and in a temporary folder:
#   1. a throwaway PostgreSQL (tests/lib/pg.sh), migrated with outboxctl, a
#      LOGIN role in outbox_producer for n8n's credential, the kill switch on;
#   2. examples/n8n/local-sink.py playing the OpenAI-compatible model, the
#      approver's chat webhook and the helpdesk API effects are delivered to;
#   3. build/outbox-dispatcher as docs/n8n.md's step 3 runs it (that ini,
#      outbox_worker with a scram password from PGPASSFILE);
#   4. n8n in its own user folder, its data in a database of that PostgreSQL
#      (so the check does not depend on n8n's sqlite module), settings
#      applied with apply-settings.py, the credential and the four
#      workflows imported with the CLI, each activated with
#      update:workflow --id=..., then started;
#   5. examples/n8n/check-scenarios.py drives every path (see its header),
#      stops n8n with SIGTERM mid-execution and starts it again.
# It ends with "n8n check (engine ...): N passed, N failed" and the time
# each part of that run took: 3.5 to 8 minutes with n8n installed, mostly
# n8n's own start-ups (each CLI run boots n8n) and the wait for a lease.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=$ROOT/examples/n8n
NPM_DIR=$ROOT/tests/n8n/npm
N8N_VERSION=$(sed -n 's/.*"n8n": *"\([^"]*\)".*/\1/p' "$NPM_DIR/package.json" | head -1)
LOCK_KEY=$(sha256sum "$NPM_DIR/package-lock.json" | cut -c1-16)
if [ -z "${N8N_CACHE:-}" ]; then
    if [ "$(id -u)" = 0 ]; then N8N_CACHE=/var/cache/outbox-dispatcher
    else N8N_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/outbox-dispatcher; fi
fi
N8N_HOME=$N8N_CACHE/n8n-$LOCK_KEY
BUILD_DIR=${BUILD_DIR:-build}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
N8N=${N8N_BIN:-$N8N_HOME/node_modules/.bin/n8n}
MODE=${1:-default}

now() { date +%s; }
T_BEGIN=$(now)

# The pinned n8n: tests/n8n/npm/package.json and its package-lock.json
# (npm overrides: xlsx 0.18.5, since n8n's own pin fetches it from a host
# outside the npm registry; isolated-vm 5.0.4, since 6.x needs Node 22 and
# the vm engine runs on it).  `npm ci` installs exactly that lock into
# N8N_CACHE/n8n-<first 16 hex of the lock's sha256>, built in a temporary
# folder beside it and renamed into place only once complete, so an
# interrupted or failed install is never reused and a changed lock gets a
# folder of its own.
install_n8n() {
    if [ -n "${N8N_BIN:-}" ]; then
        [ -x "$N8N_BIN" ] || { echo "check-with-n8n: N8N_BIN=$N8N_BIN is not executable" >&2; exit 1; }
        return 0
    fi
    if [ -x "$N8N" ]; then
        echo "using the n8n installed in $N8N_HOME (lock $LOCK_KEY, not reinstalled)"
        return 0
    fi
    command -v node >/dev/null && command -v npm >/dev/null || {
        echo "check-with-n8n: needs node >= 20.19 and npm" >&2; exit 1; }
    node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=19)?0:1)' || {
        echo "check-with-n8n: n8n $N8N_VERSION needs node >= 20.19 (this is $(node --version))" >&2; exit 1; }
    mkdir -p "$N8N_CACHE"
    # What an install killed half-way left (never used: it has no final name).
    find "$N8N_CACHE" -maxdepth 1 -name '.n8n-*.partial.*' -mmin +120 -exec rm -rf {} + 2>/dev/null || true
    tmp=$(mktemp -d "$N8N_CACHE/.n8n-$LOCK_KEY.partial.XXXXXX")
    cp "$NPM_DIR/package.json" "$NPM_DIR/package-lock.json" "$tmp/"
    # Telemetry off, native modules built against this Node's headers, a
    # private TMPDIR removed afterwards (scripts/npm-env.sh).
    . "$ROOT/scripts/npm-env.sh"
    trap 'npm_quiet_end' EXIT
    trap 'exit 130' INT TERM
    t=$(now)
    echo "installing n8n $N8N_VERSION (npm ci, 1.8 GB) into $N8N_HOME: about 5 minutes on a quiet 2-core machine..."
    if ! npm_quiet_in "$tmp" ci --no-audit --no-fund --loglevel=error > "$tmp.log" 2>&1 \
        || [ ! -x "$tmp/node_modules/.bin/n8n" ]; then
        echo "check-with-n8n: npm ci of n8n $N8N_VERSION failed (its last lines):" >&2
        tail -30 "$tmp.log" >&2
        rm -rf "$tmp" "$tmp.log"
        exit 1
    fi
    rm -f "$tmp.log"
    trap - EXIT
    # Two checks installing at once: the first rename wins, the other's
    # copy is dropped.
    chmod 755 "$tmp"
    if mv -T "$tmp" "$N8N_HOME" 2>/dev/null; then :; else rm -rf "$tmp"; fi
    [ -x "$N8N" ] || { echo "check-with-n8n: no $N8N after the install" >&2; exit 1; }
    echo "installed n8n $N8N_VERSION in $(( $(now) - t )) s"
}

case $MODE in
install) install_n8n; exit 0 ;;
both)
    rc=0
    sh "$0" default || rc=1
    sh "$0" legacy || rc=1
    exit $rc ;;
default|legacy) ;;
*) echo "usage: check-with-n8n.sh [install|default|legacy|both]" >&2; exit 2 ;;
esac
install_n8n
if [ "$MODE" = legacy ]; then
    export N8N_EXPRESSION_ENGINE=legacy
    ENGINE="legacy"
else
    unset N8N_EXPRESSION_ENGINE
    ENGINE="vm, n8n's default"
fi
N8N_RUNNING_VERSION=$("$N8N" --version 2>/dev/null | tail -1)
echo "n8n check: n8n $N8N_RUNNING_VERSION, expression engine: $ENGINE"

[ -x "$BUILD_DIR/outboxctl" ] && [ -x "$BUILD_DIR/outbox-dispatcher" ] || {
    echo "check-with-n8n: build first (make): no $BUILD_DIR/outboxctl or outbox-dispatcher" >&2; exit 1; }

free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

cd "$ROOT"
. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-n8n-check.XXXXXX)
chmod 755 "$work"
PIDS=""
cleanup() {
    # check-scenarios.py restarts n8n: its process id is in n8n.pid.
    [ -f "$work/n8n.pid" ] && PIDS="$PIDS $(cat "$work/n8n.pid")"
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

# 1. PostgreSQL, schema, the producer login, kill switch on.
pg_start "$work/pg" >/dev/null
"$PG_BIN/createdb" outbox
"$PG_BIN/createdb" n8n        # n8n's own data (workflows, executions)
DB="host=$PGHOST port=$PGPORT dbname=outbox user=postgres"
"$BUILD_DIR/outboxctl" --db "$DB" migrate
"$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -d outbox <<'SQL'
CREATE ROLE n8n_check_producer LOGIN PASSWORD 'n8n-check' IN ROLE outbox_producer;
SQL
"$BUILD_DIR/outboxctl" --db "$DB" kill-switch on --operator n8n-check --reason "manual n8n check"

# 2. The local sink: model, approver chat, delivery target.
SINK_PORT=${SINK_PORT:-$(free_port)}
/usr/bin/python3 "$KIT/local-sink.py" --port "$SINK_PORT" --record "$work" > "$work/sink.log" 2>&1 &
PIDS="$PIDS $!"

# 3. The dispatcher as the guide's step 3 runs it: its minimal ini, taken
# from docs/n8n.md as written (only the metrics port is a free one, the
# plugins are BUILD_DIR's, e.g. build-asan/providers in the suite, and the
# check's worker name and poll interval are added); the worker's login
# outbox_worker with a password that PostgreSQL asks for (scram over TCP,
# as on a Debian server where the Unix socket's peer authentication would
# refuse it) and that the worker reads from PGPASSFILE.  The sink is on
# loopback, which the http provider refuses unless allow_hosts lists it
# (the guide's ini does).
"$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -d outbox \
    -c "CREATE ROLE outbox_worker LOGIN PASSWORD 'worker-check' IN ROLE outbox_dispatcher"
hba=$work/pg/data/pg_hba.conf
{ echo "host outbox outbox_worker 127.0.0.1/32 scram-sha-256"; cat "$hba"; } > "$work/hba.new"
cat "$work/hba.new" > "$hba"
"$PG_BIN/psql" -X -q -d outbox -c "SELECT pg_reload_conf()" >/dev/null
printf '127.0.0.1:%s:outbox:outbox_worker:worker-check\n' "$PGPORT" > "$work/outbox.pgpass"
chmod 600 "$work/outbox.pgpass"
METRICS_PORT=${METRICS_PORT:-$(free_port)}
/usr/bin/python3 - "$ROOT/docs/n8n.md" "$METRICS_PORT" "$BUILD_DIR" > "$work/dispatcher.ini" <<'PY'
import re, sys
guide, port, build = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
step3 = guide[guide.index("### 3. The dispatcher"):]
ini = re.search(r"```ini\n(.*?)```", step3, re.S).group(1)
out = []
for line in ini.splitlines():
    if re.match(r"listen\s*=\s*127\.0\.0\.1:9464", line):
        line = f"listen = 127.0.0.1:{port}"
    elif re.match(r"provider_dir\s*=\s*build/providers", line):
        line = f"provider_dir = {build}/providers"
    out.append(line)
    if line.strip() == "[dispatcher]":
        out += ["worker_name = n8n-check", "poll_interval_ms = 500"]
print("\n".join(out))
PY
grep -q '^conninfo = host=127.0.0.1 dbname=outbox user=outbox_worker' "$work/dispatcher.ini" || {
    echo "check-with-n8n: the guide's ini has another conninfo:" >&2; cat "$work/dispatcher.ini" >&2; exit 1; }
(cd "$ROOT" && PGPORT=$PGPORT PGPASSFILE="$work/outbox.pgpass" AI_ACTIONS_ENABLED=true \
    exec "$BUILD_DIR/outbox-dispatcher" --config "$work/dispatcher.ini") > "$work/dispatcher.log" 2>&1 &
PIDS="$PIDS $!"

# 4. n8n: its own user folder and temporary folder (n8n makes
# n8nDataTableUploads in it; the check leaves the host's /tmp as it was),
# telemetry off, the kit imported and activated.
N8N_PORT=${N8N_PORT:-$(free_port)}
export TMPDIR="$work/tmp" N8N_USER_FOLDER="$work/n8n" N8N_PORT N8N_LISTEN_ADDRESS=127.0.0.1 N8N_HOST=127.0.0.1 \
    DB_TYPE=postgresdb DB_POSTGRESDB_HOST=127.0.0.1 DB_POSTGRESDB_PORT="$PGPORT" \
    DB_POSTGRESDB_DATABASE=n8n DB_POSTGRESDB_USER=postgres \
    N8N_PROTOCOL=http WEBHOOK_URL="http://127.0.0.1:$N8N_PORT/" \
    N8N_DIAGNOSTICS_ENABLED=false \
    N8N_VERSION_NOTIFICATIONS_ENABLED=false N8N_TEMPLATES_ENABLED=false \
    N8N_PERSONALIZATION_ENABLED=false N8N_HIRING_BANNER_ENABLED=false \
    EXTERNAL_FRONTEND_HOOKS_URLS= N8N_DIAGNOSTICS_CONFIG_FRONTEND= N8N_DIAGNOSTICS_CONFIG_BACKEND= \
    N8N_ENCRYPTION_KEY="check-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" \
    N8N_ENFORCE_SETTINGS_FILE_PERMISSIONS=true N8N_BLOCK_ENV_ACCESS_IN_NODE=true \
    N8N_SECURE_COOKIE=false N8N_LOG_LEVEL=${N8N_LOG_LEVEL:-info} \
    EXECUTIONS_DATA_SAVE_ON_SUCCESS=all EXECUTIONS_DATA_SAVE_ON_ERROR=all
mkdir -p "$TMPDIR" "$N8N_USER_FOLDER" "$work/import"

# The settings, in one file as a user keeps them (apply-settings.py writes
# them into every Config node), and the credential as the CLI imports it.
SINK="http://127.0.0.1:$SINK_PORT" HOOK="http://127.0.0.1:$N8N_PORT/webhook"
# The runs' lease: the wait after n8n is stopped mid-execution (300 s in
# the shipped settings), shorter here to keep the check short, and longer
# than n8n's restart so the check sees the 409 that names it.
export CHECK_LEASE_SECONDS=${CHECK_LEASE_SECONDS:-120}
cat > "$work/settings.json" <<EOF
{
  "llm_url": "$SINK/v1/chat/completions", "llm_model": "fake-llm-1", "llm_timeout_ms": 10000,
  "notify_url": "$SINK/notify", "deliver_url": "$SINK/deliver",
  "approval_page_url": "$HOOK/outbox/approval", "decision_url": "$HOOK/outbox/approval/decide",
  "cancel_url": "$HOOK/outbox/cancel", "window_seconds": 8, "lease_seconds": $CHECK_LEASE_SECONDS
}
EOF
/usr/bin/python3 "$KIT/apply-settings.py" "$work/settings.json" "$work/import" > "$work/import.log"
cat > "$work/credentials.json" <<EOF
[{"id": "outboxProducerPg", "name": "outbox producer", "type": "postgres",
  "data": {"host": "127.0.0.1", "port": $PGPORT, "database": "outbox",
           "user": "n8n_check_producer", "password": "n8n-check", "ssl": "disable",
           "allowUnauthorizedCerts": false, "sshTunnel": false, "maxConnections": 10}}]
EOF

T_IMPORT=$(now)
"$N8N" import:credentials --input="$work/credentials.json" >> "$work/import.log" 2>&1
"$N8N" import:workflow --separate --input="$work/import" >> "$work/import.log" 2>&1
for id in $(/usr/bin/python3 -c 'import glob, json, sys
for p in sorted(glob.glob(sys.argv[1] + "/*.json")): print(json.load(open(p))["id"])' "$work/import"); do
    "$N8N" update:workflow --id="$id" --active=true >> "$work/import.log" 2>&1
done
T_START=$(now)
"$N8N" start > "$work/n8n.log" 2>&1 &
echo $! > "$work/n8n.pid"
export N8N_CMD="$N8N" OUTBOXCTL="$BUILD_DIR/outboxctl"

# 5. Drive every path.
set +e
/usr/bin/python3 "$KIT/check-scenarios.py" "$work" "$N8N_PORT" "$DB" "$ENGINE"
rc=$?
T_END=$(now)

# The engine n8n actually ran: it warns at start when legacy is on.
if grep -q 'legacy. expression engine' "$work/n8n.log"; then ran=legacy; else ran=vm; fi
case $ENGINE in "$ran"*) ;; *)
    echo "FAIL n8n ran the $ran engine, not $ENGINE"; rc=1 ;; esac
echo "n8n check (engine $ENGINE): import $((T_START - T_IMPORT)) s, n8n start and scenarios $((T_END - T_START)) s, whole check $((T_END - T_BEGIN)) s"
if [ $rc -ne 0 ]; then
    echo "--- n8n log (last 40 lines)"; tail -40 "$work/n8n.log"
    [ -f "$work/n8n-restarted.log" ] && { echo "--- restarted n8n's log (last 30 lines)"; tail -30 "$work/n8n-restarted.log"; }
    echo "--- import log"; tail -20 "$work/import.log"
    echo "--- dispatcher log (last 20 lines)"; tail -20 "$work/dispatcher.log"
fi
exit $rc
