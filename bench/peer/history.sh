#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/peer/history.sh: `make bench-history` (bench/peer/history.py): one
# throwaway PostgreSQL with bench-peer's settings (fsync off), this tree's
# schema, the kill switch on.  Knobs: HISTORY_N, HISTORY_ROUNDS,
# HISTORY_SIZES, HISTORY_HOLD_SECONDS, BUILD_DIR.
set -eu
cd "$(dirname "$0")/../.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
PATH=$PATH:/usr/sbin:/sbin
export PATH
for b in outbox-dispatcher outboxctl providers/outbox_http.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "bench-history: $BUILD_DIR/$b missing: run make first" >&2; exit 1; }
done
command -v nginx >/dev/null 2>&1 || { echo "bench-history: needs nginx (apt-get install nginx-light)" >&2; exit 1; }
. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-history.XXXXXX)
chmod 755 "$work"
cleanup() {
    pg_stop "$work/pg"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
export PG_EXTRA_OPTS BENCH_WORK=$work
pg_start "$work/pg" >/dev/null || exit 1
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
"$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
"$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "make bench-history" >/dev/null
/usr/bin/python3 bench/peer/history.py
