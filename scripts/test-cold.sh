#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/test-cold.sh: what `make test-cold` runs.  The README's test
# command as a machine that never ran it would: a fresh clone of the
# current commit (what is committed: uncommitted changes are not in it),
# run the way CI runs it (`bash .ci/run`, CI=true, so `sh scripts/test.sh`:
# the packages, the sanitizer build, the whole suite), with everything a
# first run fills empty and private:
#   HOME            a new empty folder: no ~/.npmrc, ~/.npm, ~/.cache
#   TMPDIR          a new empty folder (pytest's tmp_path, npm's TMPDIR)
#   N8N_CACHE       empty: the real-n8n test's first `npm ci` of n8n runs
#   PEER_CACHE      empty (XDG_CACHE_HOME too): bench-peer's `npm ci` runs
#   npm's cache     empty (under the new HOME)
# The machine's own caches (/var/cache/outbox-dispatcher, ~/.npm,
# ~/.cache) are neither read nor written.  All of it is removed at the end.
# Prints the suite's closing line and how long the run took; exits with
# the suite's status.
#
#   COLD_DIR    where the temporary folder goes (default /tmp; the n8n
#               install needs about 2 GB)
#   COLD_KEEP=1 keep the temporary folder (its path is printed)
#   COLD_CMD    the command to run in the clone instead of `bash .ci/run`,
#               e.g. COLD_CMD="make test" to leave the packages alone
#   PYTEST_ARGS passed on, as to `make test` (a cold run of a few tests:
#               PYTEST_ARGS="-k n8n")
#
# When to run it: see tests/README.md ("A cold run").
set -eu
cd "$(dirname "$0")/.."
src=$(pwd)
commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "test-cold: uncommitted changes are not part of the cold run (it clones $commit)" >&2
fi
base=$(mktemp -d "${COLD_DIR:-/tmp}/outbox-cold.XXXXXX")
# The tests run PostgreSQL as the postgres user (tests/lib/pg.sh) inside
# folders under TMPDIR: the path must be traversable, TMPDIR as /tmp is.
chmod 755 "$base"
mkdir -p "$base/home" "$base/tmp" "$base/cache/n8n" "$base/cache/peer"
chmod 700 "$base/home"
chmod 1777 "$base/tmp"
cleanup() {
    if [ "${COLD_KEEP:-}" = 1 ]; then
        echo "test-cold: kept $base" >&2
    else
        rm -rf "$base"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

git clone -q --no-hardlinks "$src" "$base/src"
git -C "$base/src" checkout -q --detach "$commit"
echo "test-cold: $commit in $base/src, HOME=$base/home, TMPDIR=$base/tmp, caches empty"

start=$(date +%s)
# Whatever npm settings this shell has (npm_config_*, a telemetry switch)
# are the machine's, not a fresh one's: they are dropped.
(
    for v in $(env | sed -n 's/^\([Nn][Pp][Mm]_[Cc][Oo][Nn][Ff][Ii][Gg]_[A-Za-z0-9_]*\)=.*/\1/p'); do
        unset "$v"
    done
    unset SCARF_ANALYTICS DO_NOT_TRACK N8N_BIN XDG_CONFIG_HOME XDG_DATA_HOME XDG_STATE_HOME
    export HOME="$base/home" TMPDIR="$base/tmp" TMP="$base/tmp" TEMP="$base/tmp"
    export XDG_CACHE_HOME="$base/home/.cache" N8N_CACHE="$base/cache/n8n" PEER_CACHE="$base/cache/peer"
    export CI=true
    cd "$base/src"
    status=0
    eval "${COLD_CMD:-bash .ci/run}" || status=$?
    echo "$status" > "$base/status"
) 2>&1 | tee "$base/run.log" || true
rc=$(cat "$base/status" 2>/dev/null || echo 1)
echo "test-cold: $(( $(date +%s) - start )) s, closing line: $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$base/run.log" | tail -1)"
exit $rc
