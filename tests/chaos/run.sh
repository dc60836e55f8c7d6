#!/bin/sh
# SPDX-License-Identifier: ISC
# tests/chaos/run.sh: what `make chaos` runs.  Starts a throwaway PostgreSQL
# of its own (the run restarts it), runs tests/chaos/chaos.py against the
# binaries in BUILD_DIR, stops PostgreSQL, and exits with chaos.py's status.
#
#   BUILD_DIR       binaries (default build)
#   CHAOS_QUICK=1   5,000 effects in about two and a half minutes
#   CHAOS_WORKERS, CHAOS_EFFECTS, CHAOS_SECONDS, CHAOS_SEED, CHAOS_KINDS:
#                   see tests/chaos/chaos.py
#   CHAOS_KEEP=1    keep the work directory (logs, receipts, report.json)
set -u
cd "$(dirname "$0")/../.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
for b in outbox-dispatcher outboxctl; do
    [ -x "$BUILD_DIR/$b" ] || { echo "chaos: $BUILD_DIR/$b not built (make all)" >&2; exit 2; }
done
. tests/lib/pg.sh

work=$(mktemp -d /tmp/outbox-chaos.XXXXXX)
chmod 755 "$work"
CHAOS_DIR=$work/run
export CHAOS_DIR
mkdir -p "$CHAOS_DIR"
cleanup() {
    pg_stop "$work/pg"
    if [ "${CHAOS_KEEP:-0}" = 1 ] || [ "${rc:-1}" != 0 ]; then
        rm -rf "$work/pg"
        echo "chaos: logs, receipts and report.json kept in $CHAOS_DIR"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A short checkpoint so restarts are quick; commit timestamps for the
# kill-switch check (chaos.py orders flips and marks by commit).
PG_EXTRA_OPTS="-c checkpoint_timeout=30s -c track_commit_timestamp=on" pg_start "$work/pg" || exit 1
echo "chaos: PostgreSQL on port $PGPORT ($work/pg)"
/usr/bin/python3 tests/chaos/chaos.py
rc=$?
exit $rc
