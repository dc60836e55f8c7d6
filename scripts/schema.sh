#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/schema.sh: what `make schema` runs.  Regenerates sql/schema.sql
# from a fresh install: a throwaway PostgreSQL (tests/lib/pg.sh), an empty
# database migrated by BUILD_DIR's outboxctl (the migrations compiled into
# it are the tree's), its schema printed by scripts/schema_dump.py.
#
#   BUILD_DIR   where outboxctl is (default build)
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -x "$BUILD_DIR/outboxctl" ] || { echo "schema: $BUILD_DIR/outboxctl not built (make)" >&2; exit 2; }
. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-schema.XXXXXX)
chmod 755 "$work"
trap 'pg_stop "$work/pg"; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
unset PGPORT_FIXED
pg_start "$work/pg"
psql -q -c "CREATE DATABASE outbox_schema"
"$BUILD_DIR/outboxctl" --db "dbname=outbox_schema" migrate >/dev/null
/usr/bin/python3 scripts/schema_dump.py "dbname=outbox_schema" > "$work/schema.sql"
mv "$work/schema.sql" sql/schema.sql
echo "sql/schema.sql: $(wc -l < sql/schema.sql) lines"
