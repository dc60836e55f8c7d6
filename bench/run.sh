#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/run.sh: `make bench` (full, ~15 min on 2 cores) and `make bench-quick`
# (QUICK=1, under a minute).  See bench/README.md for what is measured and
# how; the knobs are the environment variables listed in bench/bench.py.
#
#   BUILD_DIR   where the binaries are (default build; make bench builds it)
#
# Installs what is missing on Debian 12 (nginx-light, pgbench, psycopg2),
# starts a throwaway PostgreSQL (tests/lib/pg.sh), creates and migrates the
# database `bench`, turns the kill switch on, and hands over to bench.py,
# which starts the sinks and workers, measures, and prints the table.
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
PATH=$PATH:/usr/sbin:/sbin
export PATH

for b in outbox-dispatcher outboxctl providers/outbox_http.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "bench: $BUILD_DIR/$b missing: run make first" >&2; exit 1; }
done

# What the bench needs from Debian: nginx (the fast sink), pgbench (the
# producers and the ceiling), python3-psycopg2 (the driver).
missing=""
command -v nginx >/dev/null 2>&1 || missing="$missing nginx-light"
command -v pgbench >/dev/null 2>&1 || missing="$missing postgresql-contrib postgresql-client"
/usr/bin/python3 -c 'import psycopg2' 2>/dev/null || missing="$missing python3-psycopg2"
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bench: installing$missing"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null; }
    else
        echo "bench: please install:$missing" >&2
        exit 1
    fi
fi
if [ "${PROFILE:-0}" != 0 ] && ! command -v perf >/dev/null 2>&1; then
    echo "bench: PROFILE=1 needs perf (apt-get install linux-perf)" >&2
    exit 1
fi

. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-bench.XXXXXX)
chmod 755 "$work"
cleanup() {
    pg_stop "$work/pg"
    if [ -n "${BENCH_KEEP:-}" ]; then echo "bench: scratch kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The server: tests/lib/pg.sh's throwaway settings (fsync and
# synchronous_commit off, shared_buffers 256MB) plus a WAL size that does
# not checkpoint in the middle of a run.  bench.py repeats the latency runs
# with fsync and synchronous_commit on (BENCH_DURABLE).
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min"
if [ "${BENCH_PGSS:-0}" != 0 ]; then
    PG_EXTRA_OPTS="$PG_EXTRA_OPTS -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
fi
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null || exit 1
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
"$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
"$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "make bench" >/dev/null
[ "${BENCH_PGSS:-0}" = 0 ] || psql -q -d bench -c "CREATE EXTENSION pg_stat_statements"
# A change to try against the migrated schema (CREATE OR REPLACE FUNCTION,
# CREATE INDEX ...): the way to measure a SQL change before it becomes a
# migration.
if [ -n "${BENCH_EXTRA_SQL:-}" ]; then
    psql -q -v ON_ERROR_STOP=1 -d bench -f "$BENCH_EXTRA_SQL" >/dev/null
fi

export BENCH_WORK=$work
/usr/bin/python3 bench/bench.py

# The latency runs again with a durable server: fsync, synchronous_commit
# and full_page_writes on (the full run; BENCH_DURABLE=0 skips it).
if [ "${BENCH_DURABLE:-$([ -n "${QUICK:-}" ] && [ "${QUICK:-}" != 0 ] && echo 0 || echo 1)}" != 0 ] &&
   echo " ${BENCH_ONLY:-durable} " | grep -q " durable "; then
    pg_stop "$work/pg"
    PG_EXTRA_OPTS="$PG_EXTRA_OPTS -c fsync=on -c synchronous_commit=on -c full_page_writes=on"
    pg_start "$work/pg" >/dev/null || exit 1
    BENCH_PHASE=durable /usr/bin/python3 bench/bench.py
fi
BENCH_PHASE=summary /usr/bin/python3 bench/bench.py
