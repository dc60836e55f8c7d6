#!/bin/sh
# scripts/install-deps.sh: every Debian 12 package the build, the tests and
# the demo need.  Idempotent; run as root (or through sudo).
set -eu
PKGS="build-essential pkg-config git ca-certificates openssl
      libpq-dev libcurl4-openssl-dev libesmtp-dev libjansson-dev libevent-dev
      libinih-dev libsystemd-dev libssl-dev libcmocka-dev
      postgresql postgresql-contrib
      python3 python3-pytest python3-pytest-xdist python3-psycopg2 python3-aiosmtpd
      clang libclang-rt-14-dev cppcheck systemd valgrind
      jq curl util-linux"
# (jq, curl, util-linux: tests/systemd boots systemd with unshare/nsenter and
# runs the docs' journalctl | jq and curl commands.)
# PgBouncer (1.18): tests/test_pgbouncer.py and bench/scaling.sh start their
# own, in transaction mode on a free loopback port.
PKGS="$PKGS pgbouncer"
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2086
$SUDO apt-get install -y -q --no-install-recommends $PKGS
# The Debian package starts a cluster of its own; the tests never use it.
# The pgbouncer package enables a service of its own (localhost:6432, no
# databases); nothing here uses it, so it is stopped where systemd runs.
if [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now pgbouncer.service >/dev/null 2>&1 || true
fi
