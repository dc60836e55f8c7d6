#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/insert_cost.sh: the producer's insert, PostgreSQL CPU and WAL per
# effect, single-row and bulk (bench/insert_cost.py says how).  One
# throwaway server (tests/lib/pg.sh, the settings of make bench), one
# database migrated by this tree's outboxctl; no worker runs.
#
#   sh bench/insert_cost.sh      # knobs: INSERT_N, INSERT_ROUNDS, INSERT_BULK, BUILD_DIR
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
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
"$BUILD_DIR/outboxctl" --db "host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench" migrate >/dev/null
INSERT_PGDATA="$work/pg/data" /usr/bin/python3 bench/insert_cost.py
