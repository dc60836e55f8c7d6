#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/levers.sh: claim + completion PostgreSQL CPU and WAL per effect of
# this tree's schema against a baseline commit's, measured per call and
# interleaved (bench/levers.py says how).  One throwaway server
# (tests/lib/pg.sh, the bench's settings, autovacuum off), one database per
# variant, each migrated by its own outboxctl.  No worker and no provider:
# the claim and the completion are called directly.
#
#   sh bench/levers.sh            # or: make bench-levers
#
# Variants: baseline = the outboxctl of LEVERS_BASELINE_REF (2d13b03 by
# default, built once by bench/baseline.sh and cached by commit id),
# current = $BUILD_DIR/outboxctl.  LEVERS_VARIANTS replaces that list
# (NAME=OUTBOXCTL[:EXTRA.sql] ..., the first is the reference); to add one,
# LEVERS_EXTRA_VARIANTS appends to it, e.g.
#   LEVERS_EXTRA_VARIANTS="tried=build/outboxctl:/tmp/try.sql" sh bench/levers.sh
# Other knobs: LEVERS_N (effects per variant and batch size, 30000),
# LEVERS_BATCHES (rows per claim and per completion, "16 64 128"),
# LEVERS_RESULTS (a JSON file), BUILD_DIR.
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
if [ -z "${LEVERS_VARIANTS:-}" ]; then
    baseline=$(sh bench/baseline.sh "${LEVERS_BASELINE_REF:-2d13b03}" "$work")
    LEVERS_VARIANTS="baseline=$baseline current=$(cd "$BUILD_DIR" && pwd)/outboxctl"
fi
LEVERS_VARIANTS="$LEVERS_VARIANTS ${LEVERS_EXTRA_VARIANTS:-}"
export LEVERS_VARIANTS
PG_EXTRA_OPTS="${PG_EXTRA_OPTS:-} -c max_wal_size=4GB -c checkpoint_timeout=30min -c autovacuum=off"
export PG_EXTRA_OPTS
pg_start "$work/pg" >/dev/null
/usr/bin/python3 bench/levers.py
