#!/bin/sh
# SPDX-License-Identifier: ISC
# tests/run.sh: the whole suite.  Starts a throwaway PostgreSQL (stopped at
# the end even when a test fails), migrates a template database, then runs
# the cmocka unit tests and the pytest integration suites, and closes with
# one line "N passed, N failed".
#
#   BUILD_DIR   where the binaries are (make test sets build-asan)
#   PYTEST_ARGS extra pytest arguments, e.g. "-k kill_switch -x"
set -u
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-test.XXXXXX)
chmod 755 "$work"
cleanup() { pg_stop "$work/pg"; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# Sanitizer settings: fail loudly, no leak noise from libraries' globals.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$(pwd)/tests/lsan.supp}

pg_start "$work/pg" || exit 1
echo "PostgreSQL on port $PGPORT ($work/pg)"

passed=0; failed=0

# Unit tests (cmocka): each binary prints its own summary.
for t in "$BUILD_DIR"/tests/test_*; do
    [ -x "$t" ] || continue
    out=$("$t" 2>&1); rc=$?
    echo "$out"
    p=$(echo "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    f=$(echo "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | tail -1)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    if [ $rc -ne 0 ] && [ -z "$f" ]; then failed=$((failed + 1)); fi
done

# The template database every test copies, migrated once by the real
# outboxctl.
psql -q -c "CREATE DATABASE outbox_tpl" || exit 1
"$BUILD_DIR/outboxctl" --db "dbname=outbox_tpl" migrate >/dev/null || exit 1

# Integration tests (pytest from Debian's python3).  Tests run in parallel
# (pytest-xdist, each in its own database), except those marked
# `exclusive` (they restart the server), which run alone afterwards.
# PYTEST_ARGS is split by pytest itself (shell-like), so "-k 'a or b'" works.
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} ${PYTEST_ARGS:-}"
jobs=${TEST_JOBS:-4}
par=""
/usr/bin/python3 -c "import xdist" 2>/dev/null && [ "$jobs" -gt 1 ] && par="-n $jobs"
# A path in PYTEST_ARGS ("tests/email", "tests/sql/test_x.py::test_y")
# narrows the run to it; without one the whole of tests/ is collected.
case " ${PYTEST_ARGS:-} " in
    *" tests/"*|*" tests "*) where="" ;;
    *) where=tests ;;
esac
run_pytest() {   # $1: junit file, rest: pytest arguments
    junit=$1; shift
    # shellcheck disable=SC2086
    /usr/bin/python3 -m pytest -p no:cacheprovider -q -rfE --junitxml="$junit" "$@" $where
    rc=$?
    if [ -f "$junit" ]; then
        counts=$(/usr/bin/python3 - "$junit" <<'PY'
import sys, xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
suites = [r] if r.tag == "testsuite" else list(r)
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t - f - sk, f)
PY
)
        passed=$((passed + ${counts% *})); failed=$((failed + ${counts#* }))
        [ $rc -ne 0 ] && [ $rc -ne 5 ] && [ "${counts#* }" -eq 0 ] && failed=$((failed + 1))
    elif [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
        failed=$((failed + 1))
    fi
}
# shellcheck disable=SC2086
run_pytest "$work/junit-parallel.xml" $par -m "not exclusive"
# The exclusive tests get a TMPDIR of their own (their temporary files,
# pytest's tmp_path, what lintian and gcc leave): what one leaves there is
# seen by the check in tests/conftest.py, not mixed with what other
# programs on the machine put in /tmp.
mkdir -m 1777 "$work/tmp"
export TMPDIR="$work/tmp"
run_pytest "$work/junit-exclusive.xml" -m "exclusive"
unset TMPDIR

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
