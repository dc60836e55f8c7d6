#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/insert_cost.sh: the producer's plain insert as a producer login,
# PostgreSQL CPU and WAL per row, one row per transaction and in bulk, this
# tree's schema against a baseline commit's, interleaved
# (bench/insert_cost.py says how).  One throwaway server (tests/lib/pg.sh,
# the settings of make bench); no worker runs.
#
#   sh bench/insert_cost.sh      # or: make bench-insert
#
# baseline = the outboxctl of LEVERS_BASELINE_REF (2d13b03 by default,
# bench/baseline.sh, cached by commit id), current = $BUILD_DIR/outboxctl;
# INSERT_VARIANTS replaces the list (NAME=OUTBOXCTL ..., the first is the
# reference).  Knobs: INSERT_N, INSERT_ROUNDS, INSERT_BULK, INSERT_CHUNK.
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -x "$BUILD_DIR/outboxctl" ] || { echo "insert_cost: build first (make all)" >&2; exit 1; }
/usr/bin/python3 -c "import psycopg2" 2>/dev/null || {
    echo "insert_cost: needs python3-psycopg2" >&2; exit 1; }
. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-insert.XXXXXX)
chmod 755 "$work"
trap 'pg_stop "$work/pg"; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
if [ -z "${INSERT_VARIANTS:-}" ]; then
    baseline=$(sh bench/baseline.sh "${LEVERS_BASELINE_REF:-2d13b03}" "$work")
    INSERT_VARIANTS="baseline=$baseline current=$(cd "$BUILD_DIR" && pwd)/outboxctl"
fi
export INSERT_VARIANTS
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min -c autovacuum=off"
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null
/usr/bin/python3 bench/insert_cost.py
