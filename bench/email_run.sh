#!/bin/sh
# SPDX-License-Identifier: ISC
# bench/email_run.sh: `make bench-email`: the email provider's throughput
# with sessions reused against a one-session-per-message client, and a
# slow-greeting run that must end with no false unknown.  A throwaway
# PostgreSQL (tests/lib/pg.sh); two relays, each in its own process: a
# private OpenSMTPD (bench/opensmtpd_relay.py: Debian's opensmtpd package,
# root, loopback port, private queue; skipped with the reason when it
# cannot run) and the project's SMTP test server
# (tests/servers/smtp_server.py); bench/email_bench.py does the measuring.
# Needs python3-psycopg2 and python3-aiosmtpd (and opensmtpd).
set -eu
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
PATH=$PATH:/usr/sbin:/sbin
export PATH
for b in outbox-dispatcher outboxctl providers/outbox_email.so; do
    [ -e "$BUILD_DIR/$b" ] || { echo "bench-email: $BUILD_DIR/$b missing: run make first" >&2; exit 1; }
done
/usr/bin/python3 -c 'import psycopg2, aiosmtpd' 2>/dev/null ||
    { echo "bench-email: please install python3-psycopg2 python3-aiosmtpd" >&2; exit 1; }

. tests/lib/pg.sh
work=$(mktemp -d /tmp/outbox-bench-email.XXXXXX)
chmod 755 "$work"
cleanup() {
    pg_stop "$work/pg"
    if [ -n "${BENCH_KEEP:-}" ]; then echo "bench-email: scratch kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

pg_start "$work/pg" >/dev/null || exit 1
psql -q -d postgres -c "CREATE DATABASE bench" >/dev/null
ci="host=$PGHOST port=$PGPORT user=$PGUSER dbname=bench"
"$BUILD_DIR/outboxctl" --db "$ci" migrate >/dev/null
"$BUILD_DIR/outboxctl" --db "$ci" kill-switch on --operator bench --reason "make bench-email" >/dev/null
export BENCH_WORK="$work"
/usr/bin/python3 bench/email_bench.py
