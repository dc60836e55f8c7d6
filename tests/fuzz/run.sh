#!/bin/sh
# SPDX-License-Identifier: ISC
# tests/fuzz/run.sh: build the libFuzzer targets with clang
# (-fsanitize=fuzzer,address,undefined) and run each for a bounded time
# over its seed corpus in tests/fuzz/corpus/<target>/.  New corpus entries
# go to a temporary directory (the repo keeps only the seeds); a crash,
# sanitizer report, leak or failed oracle fails the run loudly, printing
# the reproducer (base64) and the command to replay it.
#
#   FUZZ_SECONDS   seconds per target (default 20)
#   FUZZ_TARGETS   which targets (default: every tests/fuzz/fuzz_*.c)
#   FUZZ_BUILD     where binaries and crash artifacts go (default build-fuzz)
#   CLANG          compiler (default clang)
#
# Exit status: 0 when every target ran clean, 1 on a finding, 2 when the
# targets cannot be built (no clang or no libFuzzer).
set -u
cd "$(dirname "$0")/../.."
root=$(pwd)

FUZZ_SECONDS=${FUZZ_SECONDS:-20}
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
CLANG=${CLANG:-clang}
case "$FUZZ_BUILD" in /*) ;; *) FUZZ_BUILD="$root/$FUZZ_BUILD" ;; esac
if [ -z "${FUZZ_TARGETS:-}" ]; then
    FUZZ_TARGETS=$(for f in tests/fuzz/fuzz_*.c; do basename "$f" .c; done)
fi

if ! command -v "$CLANG" >/dev/null 2>&1; then
    echo "fuzz: $CLANG not found (apt-get install clang)" >&2
    exit 2
fi

PKGS="libcurl jansson libevent inih libcrypto"
pkg_cflags=$(pkg-config --cflags $PKGS) || exit 2
pkg_libs=$(pkg-config --libs $PKGS) || exit 2
CFLAGS="-g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
        -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Ilib -Iproviders $pkg_cflags"

# Per target: the code under test, and the longest input worth trying.
sources() {
    case "$1" in
    fuzz_config)  echo "lib/config.c lib/config_read.c lib/util.c lib/log.c lib/text.c" ;;
    fuzz_payload) echo providers/http/*.c providers/lib/*.c lib/text.c lib/json_text.c lib/scrub.c lib/hostname.c ;;
    *)            echo "" ;;
    esac
}
max_len() {
    case "$1" in
    fuzz_config)  echo 4096 ;;
    fuzz_payload) echo 8192 ;;
    *)            echo 4096 ;;
    esac
}

mkdir -p "$FUZZ_BUILD" || exit 2
work=$(mktemp -d /tmp/outbox-fuzz.XXXXXX) || exit 2
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

# Build them all first (in parallel): a build failure is not a finding.
pids=""
for t in $FUZZ_TARGETS; do
    echo "fuzz: building $t"
    # shellcheck disable=SC2046,SC2086
    $CLANG $CFLAGS -o "$FUZZ_BUILD/$t" "tests/fuzz/$t.c" $(sources "$t") $pkg_libs -lm \
        >"$work/$t.build.log" 2>&1 &
    pids="$pids $!"
done
build_failed=0
for p in $pids; do wait "$p" || build_failed=1; done
for t in $FUZZ_TARGETS; do
    if [ -s "$work/$t.build.log" ]; then cat "$work/$t.build.log" >&2; fi
    [ -x "$FUZZ_BUILD/$t" ] || build_failed=1
done
if [ $build_failed -ne 0 ]; then
    echo "fuzz: build failed (is libclang-rt-14-dev installed for -fsanitize=fuzzer?)" >&2
    exit 2
fi

# Sanitizers: stop at the first report; leaks count.
export ASAN_OPTIONS="${FUZZ_ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
unset LSAN_OPTIONS

findings=0
for t in $FUZZ_TARGETS; do
    seeds="$root/tests/fuzz/corpus/$t"
    new="$work/corpus-$t"
    art="$FUZZ_BUILD/artifacts/$t/"
    rm -rf "$art"; mkdir -p "$new" "$art" "$seeds"
    dict=""
    [ -f "tests/fuzz/$t.dict" ] && dict="-dict=$root/tests/fuzz/$t.dict"
    echo "fuzz: $t for ${FUZZ_SECONDS}s (seeds: $(ls "$seeds" | wc -l), max_len $(max_len "$t"))"
    # The first corpus directory receives new entries: the temporary one.
    # Absolute paths: a target may chdir() in LLVMFuzzerInitialize.
    # stdin from /dev/null, no controlling terminal: nothing can block on it.
    # shellcheck disable=SC2086
    setsid "$FUZZ_BUILD/$t" -max_total_time="$FUZZ_SECONDS" -max_len="$(max_len "$t")" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$art" \
        $dict "$new" "$seeds" </dev/null >"$work/$t.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
        findings=$((findings + 1))
        echo "==================== FUZZ FINDING in $t (exit $rc) ====================" >&2
        grep -v '^#[0-9]' "$work/$t.log" | tail -60 >&2
        for a in "$art"crash-* "$art"leak-* "$art"timeout-* "$art"oom-* "$art"slow-unit-*; do
            [ -f "$a" ] || continue
            echo "--- reproducer $a ($(wc -c < "$a") bytes), base64:" >&2
            head -c 4096 "$a" | base64 >&2
            echo "--- replay: $FUZZ_BUILD/$t $a" >&2
        done
        echo "=======================================================================" >&2
    else
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ *DONE)' "$work/$t.log" |
            sed "s/^/fuzz: $t: /"
        echo "fuzz: $t: clean, $(ls "$new" | wc -l) new corpus entries (not kept)"
    fi
done

if [ $findings -ne 0 ]; then
    echo "fuzz: $findings target(s) with findings" >&2
    exit 1
fi
echo "fuzz: all targets clean"
exit 0
