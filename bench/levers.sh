#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/levers.sh: what each lever of the database's cost is worth inside PostgreSQL,
# measured per call and interleaved (bench/levers.py).  One throwaway
# server (tests/lib/pg.sh, the bench's settings), one database per variant,
# each migrated with this tree's outboxctl and then changed by the SQL of
# its variant (bench/levers/*.sql, or the rewrites levers.py makes of the
# shipped functions).  No worker and no provider: the claim and the
# completion are called directly, the way bench/ceiling.sql calls the lease.
#
#   sh bench/levers.sh            # or: make bench-levers
#
# Knobs: LEVERS_N (effects per variant, 30000), LEVERS_BATCH (rows per
# claim and per completion, 64 = [dispatcher] batch_size),
# LEVERS_VARIANTS (names, see levers.py; default all), BUILD_DIR.
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -x "$BUILD_DIR/outboxctl" ] || { echo "levers: build first (make all)" >&2; exit 1; }
/usr/bin/python3 -c "import psycopg2" 2>/dev/null || {
    echo "levers: needs python3-psycopg2 (apt-get install python3-psycopg2)" >&2; exit 1; }

. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-levers.XXXXXX)
chmod 755 "$work"
trap 'pg_stop "$work/pg"; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null
export LEVERS_OUTBOXCTL="$BUILD_DIR/outboxctl" LEVERS_PGDATA="$work/pg/data"
/usr/bin/python3 bench/levers.py
