#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/test-at.sh DATE: the suite (tests/run.sh) with every clock at
# DATE, PostgreSQL's included: libfaketime (faketime's LD_PRELOAD) with
# one offset from the real time, inherited by every process the run
# starts, so the tests, the workers and the server agree on the time and
# it runs on as usual.  For finding tests that depend on today's date
# (tests/README.md, "No test depends on today's date").
#
#   sh scripts/test-at.sh '2027-12-31 12:00'
#   BUILD_DIR, PYTEST_ARGS, TEST_JOBS: as for tests/run.sh
#
# Warm the n8n cache first, without a faked date (sh examples/n8n/
# check-with-n8n.sh install): under one, the npm registry's certificate
# may not be valid yet, or any more.
set -eu
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/test-at.sh 'YYYY-MM-DD hh:mm'" >&2; exit 2; }
command -v faketime >/dev/null 2>&1 || { echo "test-at: needs faketime (scripts/install-deps.sh)" >&2; exit 2; }
target=$(date -u -d "$1 UTC" +%s) || exit 2
offset=$(( target - $(date -u +%s) ))
# The sanitizer runtime refuses to start when another library is preloaded
# ahead of it, unless told not to check.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1}:verify_asan_link_order=0"
echo "test-at: clocks at $(date -u -d "@$target" '+%Y-%m-%d %H:%M:%S UTC') (offset ${offset} s)"
# Only the wall clock moves: the monotonic clocks (timeouts, intervals)
# are not dates, and a machine on that date has them as usual.  (With the
# monotonic clock moved too, every wait of Python's threading hangs:
# libfaketime does not translate sem_clockwait's deadline.)  Python's
# time.sleep needs a stand-in then (tests/lib/faketime/sitecustomize.py).
export FAKETIME_DONT_FAKE_MONOTONIC=1
export PYTHONPATH="$(pwd)/tests/lib/faketime${PYTHONPATH:+:$PYTHONPATH}"
exec faketime -f "+${offset}" sh tests/run.sh
