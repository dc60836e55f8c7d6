#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/peer/peer.sh: `make bench-peer`, the dispatcher beside graphile-worker
# on identical HTTP work (bench/README.md, "Beside graphile-worker").
#
# Installs graphile-worker from the lockfile (bench/peer/install.sh, cached),
# starts one throwaway PostgreSQL (tests/lib/pg.sh, the settings of
# bench/run.sh) with two databases, `bench` (migrated by this tree's
# outboxctl, kill switch on) and `graphile` (graphile-worker's schema), and
# runs bench/peer/peer.py once per fsync setting, restarting the server in
# between; peer.py prints the table at the end.
#
# Knobs: PEER_N (items per round, 100000; QUICK=1: 2000), PEER_ROUNDS (rounds
# per side and setting, 2; QUICK: 1), PEER_FSYNC ("off on"), PEER_WARMUP
# (items per side before the rounds of a setting, 5000; QUICK: 0),
# PEER_CASES (the statistics cases: "all producer none scoped", see
# peer.py; PEER_ANALYZE=0 / 1 is none / all),
# PEER_RESULTS (keep the results as JSON there), BUILD_DIR, PEER_CACHE.
set -eu
cd "$(dirname "$0")/../.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
PATH=$PATH:/usr/sbin:/sbin
export PATH
for b in outbox-dispatcher outboxctl providers/outbox_http.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "bench-peer: $BUILD_DIR/$b missing: run make first" >&2; exit 1; }
done
command -v nginx >/dev/null 2>&1 || { echo "bench-peer: needs nginx (apt-get install nginx-light)" >&2; exit 1; }
/usr/bin/python3 -c 'import psycopg2' 2>/dev/null ||
    { echo "bench-peer: needs python3-psycopg2" >&2; exit 1; }
PEER_NODE_PATH=$(sh bench/peer/install.sh)
export PEER_NODE_PATH

. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-peer.XXXXXX)
chmod 755 "$work"
cleanup() {
    pg_stop "$work/pg"
    if [ -n "${BENCH_KEEP:-}" ]; then echo "bench-peer: scratch kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

base_opts="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
export BENCH_WORK=$work
first=1
for fsync in ${PEER_FSYNC:-off on}; do
    case $fsync in
        off) PG_EXTRA_OPTS=$base_opts ;;
        on)  PG_EXTRA_OPTS="$base_opts -c fsync=on -c synchronous_commit=on -c full_page_writes=on" ;;
        *)   echo "bench-peer: PEER_FSYNC takes off and on, not $fsync" >&2; exit 1 ;;
    esac
    export PG_EXTRA_OPTS
    pg_stop "$work/pg"
    pg_start "$work/pg" >/dev/null || exit 1
    if [ $first = 1 ]; then
        psql -q -d postgres -c "CREATE DATABASE bench" -c "CREATE DATABASE graphile" >/dev/null
        ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
        "$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
        "$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "make bench-peer" >/dev/null
        PEER_GRAPHILE_DSN="postgres://$PGUSER@$PGHOST:$PGPORT/graphile" NODE_PATH=$PEER_NODE_PATH \
            node bench/peer/graphile_worker.js migrate
        first=0
    fi
    PEER_PHASE=$fsync /usr/bin/python3 bench/peer/peer.py
done
PEER_PHASE=summary /usr/bin/python3 bench/peer/peer.py
