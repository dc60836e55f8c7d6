#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/test-at.sh DATE: the suite (tests/run.sh) with every wall clock
# at DATE, PostgreSQL's included: tests/tools/clock_offset.so, preloaded
# into every process the run starts, adds one offset from the real time,
# so the tests, the workers and the server agree on the time and it runs
# on as usual.  For finding tests that depend on today's date
# (tests/README.md, "No test depends on today's date").
#
#   sh scripts/test-at.sh '2027-12-31 12:00'
#   BUILD_DIR, PYTEST_ARGS, TEST_JOBS: as for tests/run.sh
#
# Warm the n8n cache first, without a moved date (sh examples/n8n/
# check-with-n8n.sh install): at another date the npm registry's
# certificate may not be valid yet, or any more.
set -eu
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/test-at.sh 'YYYY-MM-DD hh:mm'" >&2; exit 2; }
target=$(date -u -d "$1 UTC" +%s) || exit 2
offset=$(( target - $(date -u +%s) ))

# The shim is built for this run in a folder every user of the run (the
# server runs as postgres) can read, and removed afterwards.
shim_dir=$(mktemp -d /tmp/outbox-clock.XXXXXX)
trap 'rm -rf "$shim_dir"' EXIT
chmod 755 "$shim_dir"
${CC:-cc} -std=c11 -Wall -Wextra -Werror -O2 -shared -fPIC \
    -o "$shim_dir/clock_offset.so" tests/tools/clock_offset.c -ldl
chmod 755 "$shim_dir/clock_offset.so"

# The sanitizer runtime refuses to start when another library is preloaded
# ahead of it, unless told not to check.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1}:verify_asan_link_order=0"
# Tests that move one worker's clock further (tests/resilience/
# test_worker_clock.py, the chaos run) read the run's offset here.
export OUTBOX_TEST_CLOCK_OFFSET="$offset"
export LD_PRELOAD="$shim_dir/clock_offset.so${LD_PRELOAD:+ $LD_PRELOAD}"
echo "test-at: clocks at $(date -u -d "@$target" '+%Y-%m-%d %H:%M:%S UTC') (offset ${offset} s)"
sh tests/run.sh
