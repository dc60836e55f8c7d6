#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/baseline.sh: the outboxctl of another commit, for the benchmarks
# that compare a schema with the one before it (bench/levers.sh,
# bench/insert_cost.sh).  Prints the binary's path on stdout.
#
#   sh bench/baseline.sh REF [SCRATCH]
#
# REF is resolved to its commit id; the binary is kept in
# ~/.cache/outbox-bench-baseline/<commit>/outboxctl (OUTBOX_BASELINE_CACHE
# for another folder) and reused from there.  Otherwise REF is checked out
# in a throwaway `git worktree` under SCRATCH (a temporary folder when not
# given), `make -j2 build/outboxctl` builds it (the migrations and
# functions of that commit are compiled into it), and the worktree is
# removed.  The binary is copied into the cache under a temporary name and
# renamed, so an interrupted build is never reused.
set -eu
ref=${1:?usage: baseline.sh REF [SCRATCH]}
cd "$(dirname "$0")/.."
commit=$(git rev-parse --verify --quiet "$ref^{commit}") || {
    echo "baseline: $ref is not a commit of this repository (git rev-parse)" >&2; exit 1; }
cache=${OUTBOX_BASELINE_CACHE:-${HOME:-/root}/.cache/outbox-bench-baseline}/$commit
if [ -x "$cache/outboxctl" ]; then
    echo "baseline: outboxctl of $ref ($commit) from $cache" >&2
    echo "$cache/outboxctl"
    exit 0
fi
own_scratch=
scratch=${2:-}
if [ -z "$scratch" ]; then
    scratch=$(mktemp -d /tmp/outbox-baseline.XXXXXX)
    own_scratch=$scratch
fi
tree=$scratch/baseline-$commit
cleanup() {
    git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"
    [ -z "$own_scratch" ] || rm -rf "$own_scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "baseline: building outboxctl of $ref ($commit) in $tree" >&2
git worktree add --detach "$tree" "$commit" >/dev/null 2>&1 || {
    echo "baseline: git worktree add $tree $commit failed" >&2; exit 1; }
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -C "$tree" -j2 build/outboxctl >"$scratch/baseline-build.log" 2>&1 || {
    tail -20 "$scratch/baseline-build.log" >&2; echo "baseline: make build/outboxctl failed at $commit" >&2; exit 1; }
mkdir -p "$cache"
cp "$tree/build/outboxctl" "$cache/outboxctl.partial.$$"
mv "$cache/outboxctl.partial.$$" "$cache/outboxctl"
echo "$cache/outboxctl"
