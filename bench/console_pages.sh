#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/console_pages.sh: the web console's pages timed over HTTP on a
# history of N finished effects (and N/5 open ones), bench/console_pages.py
# says how.  One throwaway server (tests/lib/pg.sh), the console of
# $BUILD_DIR; no worker runs.
#
#   CONSOLE_BENCH_HISTORY=1000000 sh bench/console_pages.sh
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -x "$BUILD_DIR/outbox-console" ] || { echo "console_pages: build first (make all)" >&2; exit 1; }
. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-console-bench.XXXXXX)
chmod 755 "$work"
trap 'pg_stop "$work/pg"; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
pg_start "$work/pg"
psql -q -c "CREATE DATABASE outbox_bench"
"$BUILD_DIR/outboxctl" --db "dbname=outbox_bench" migrate >/dev/null
BUILD_DIR="$BUILD_DIR" WORK="$work" /usr/bin/python3 bench/console_pages.py
