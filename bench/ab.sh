#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/ab.sh: this tree against another commit, alternating throughput runs
# (A = the other commit, B = this tree), each on a fresh server of its own
# (bench/run.sh with BENCH_ONLY=throughput), so both sides see the same
# machine load over the same minutes.  Prints one line per run (effects/s,
# CPU per effect of workers, PostgreSQL and sink, WAL per effect, load
# average) and the means.
#
#   sh bench/ab.sh [REF]     REF defaults to origin's main, else `main`
#
# Knobs: AB_ROUNDS (3), BENCH_N (60000), BENCH_WORKERS (2), AB_BUILD_A (a
# build of REF already made: skips the export and build).  The SQL each side
# runs is the one compiled into its own outboxctl, so a SQL change is
# measured with the worker that goes with it.
set -eu
cd "$(dirname "$0")/.."
ref=${1:-main}
rounds=${AB_ROUNDS:-3}
n=${BENCH_N:-60000}
workers=${BENCH_WORKERS:-2}
[ -x build/outbox-dispatcher ] || { echo "ab: make first" >&2; exit 1; }
if [ -n "${AB_BUILD_A:-}" ]; then
    build_a=$AB_BUILD_A
else
    src=$(mktemp -d /tmp/outbox-ab.XXXXXX)
    trap 'rm -rf "$src"' EXIT
    git archive "$ref" | tar -x -C "$src"
    echo "ab: building $ref ($(git rev-parse --short "$ref")) in $src"
    make -C "$src" -j2 >"$src/build.log" 2>&1 || { tail -20 "$src/build.log"; exit 1; }
    build_a=$src/build
fi
out=$(mktemp /tmp/outbox-ab-results.XXXXXX)
trap 'rm -f "$out"; [ -z "${src:-}" ] || rm -rf "$src"' EXIT
for i in $(seq 1 "$rounds"); do
    for side in A B; do
        if [ "$side" = A ]; then b=$build_a; else b=$(pwd)/build; fi
        load=$(cut -d' ' -f1 /proc/loadavg)
        line=$(BENCH_N=$n BENCH_WORKERS=$workers BENCH_ONLY=throughput BENCH_DURABLE=0 QUICK=1 \
               BUILD_DIR=$b sh bench/run.sh 2>&1 | grep "fresh-$workers: [0-9]* effects in" || true)
        [ -n "$line" ] || { echo "ab: run $side $i failed" >&2; exit 1; }
        echo "$side $line load=$load" | tee -a "$out" | sed 's/\[ *[0-9.]*s\] *fresh-[0-9]*: //'
    done
done
/usr/bin/python3 - "$out" <<'PY'
import re, sys
runs = {"A": [], "B": []}
for line in open(sys.argv[1]):
    m = re.search(r"= (\d+) effects/s .*workers ([\d.]+), PostgreSQL ([\d.]+), sink ([\d.]+).*WAL (\d+)", line)
    if m:
        runs[line[0]].append([float(x) for x in m.groups()])
def mean(side, i):
    v = [r[i] for r in runs[side]]
    return sum(v) / len(v)
print("means of %d runs each   effects/s  PostgreSQL ms/effect  workers ms/effect  WAL bytes/effect" % len(runs["A"]))
for s in "AB":
    print("%s                      %9.0f  %20.3f  %17.3f  %16.0f" % (s, mean(s, 0), mean(s, 2), mean(s, 1), mean(s, 4)))
print("B / A                    %9.2f  %20.2f  %17.2f  %16.2f" % tuple(mean("B", i) / mean("A", i) for i in (0, 2, 1, 4)))
PY
