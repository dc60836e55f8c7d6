#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/scaling.sh: the scaling curve: effects/s and CPU per
# effect for 1, 2, 4, 8 workers connected directly, and 2, 4, 8 workers
# through PgBouncer in transaction mode (poll_only = true) with pools of 2
# and of 1 server connection per worker.  ~10 min on 2 quiet cores.
# Results: docs/performance.md, "Scaling curve".
#
#   BUILD_DIR                 where the binaries are (default build: make first)
#   SCALING_N                 effects per run (100000)
#   SCALING_WORKERS           direct worker counts ("1 2 4 8")
#   SCALING_BOUNCER           worker counts through PgBouncer ("2 4 8")
#   SCALING_POOL_PER_WORKER   PgBouncer pool sizes per worker ("2 1")
#   SCALING_RESULTS           also write the runs as JSON to this file
#
# Needs what bench/run.sh needs (nginx-light, pgbench's package,
# python3-psycopg2) and pgbouncer (scripts/install-deps.sh).
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
PATH=$PATH:/usr/sbin:/sbin
export PATH
for b in outbox-dispatcher outboxctl providers/outbox_http.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "scaling: $BUILD_DIR/$b missing: run make first" >&2; exit 1; }
done
for c in nginx pgbouncer; do
    command -v $c >/dev/null 2>&1 || { echo "scaling: $c missing (apt-get install nginx-light pgbouncer)" >&2; exit 1; }
done

. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-scaling.XXXXXX)
chmod 755 "$work"
cleanup() { pg_stop "$work/pg"; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# The bench's server settings (bench/run.sh).
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null || exit 1
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
"$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
"$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "bench/scaling.sh" >/dev/null

export BENCH_WORK="$work"
/usr/bin/python3 bench/scaling.py
