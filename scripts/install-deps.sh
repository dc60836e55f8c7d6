#!/bin/sh
# SPDX-License-Identifier: ISC
# scripts/install-deps.sh: every Debian 12 package the build, the tests and
# the demo need.  Idempotent; run as root (or through sudo).
#
#   scripts/install-deps.sh          everything (build, tests, benches, demo)
#   scripts/install-deps.sh --build  only what `make` and `make deb` need
#                                    (the compiler and the libraries' -dev
#                                    packages, debhelper, help2man): ~15
#                                    packages, no PostgreSQL, nginx or Node.js
set -eu
# Two runs at once (two clones' test runs side by side) would meet on
# dpkg's and apt's locks and the second would fail: they take turns.
# flock is util-linux's, on every Debian machine.
if [ -z "${OUTBOX_DEPS_LOCKED:-}" ] && command -v flock >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    OUTBOX_DEPS_LOCKED=1 exec flock /run/outbox-install-deps.lock sh "$0" "$@"
fi
# What `make` and `make deb` need (debian/control's Build-Depends).
BUILD_PKGS="build-essential pkg-config git ca-certificates
      libpq-dev libcurl4-openssl-dev libesmtp-dev libjansson-dev libevent-dev
      libinih-dev libsystemd-dev libssl-dev libmicrohttpd-dev
      debhelper dpkg-dev fakeroot help2man"
if [ "${1:-}" = --build ]; then
    SUDO=
    [ "$(id -u)" = 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -q --no-install-recommends $BUILD_PKGS
    exit 0
elif [ -n "${1:-}" ]; then
    echo "usage: scripts/install-deps.sh [--build]" >&2
    exit 2
fi
PKGS="build-essential pkg-config git ca-certificates openssl
      libpq-dev libcurl4-openssl-dev libesmtp-dev libjansson-dev libevent-dev
      libinih-dev libsystemd-dev libssl-dev libcmocka-dev
      postgresql postgresql-contrib
      python3 python3-pytest python3-pytest-xdist python3-psycopg2 python3-aiosmtpd
      clang libclang-rt-14-dev cppcheck systemd valgrind
      jq curl util-linux"
# (jq, curl, util-linux: tests/systemd boots systemd with unshare/nsenter and
# runs the docs' journalctl | jq and curl commands.)
# PgBouncer (1.18): tests/resilience/test_pgbouncer.py and bench/scaling.sh start their
# own, in transaction mode on a free loopback port.
PKGS="$PKGS pgbouncer"
# The Debian package (make deb, tests/deploy/test_package.py) and the monitoring
# tests (tests/operator/test_monitoring.py: python3-yaml reads the rules).
PKGS="$PKGS debhelper dpkg-dev fakeroot lintian help2man man-db python3-yaml"
# libfaketime: tests/resilience/test_worker_clock.py and the chaos run's
# clock-step fault run a worker with its wall clock off.
PKGS="$PKGS faketime libfaketime"
# The Unicode Character Database: scripts/gen_term_table.py generates
# lib/term_table.h from it, and tests/unit/test_escape.c checks every
# code point's escaping against it.
PKGS="$PKGS unicode-data"
# The loopback sink of make bench and bench-peer (tests/sql/test_peer_bench.py).
PKGS="$PKGS nginx-light"
# The web console (console/, outbox-console): libmicrohttpd is its HTTP server
# (connection limits and timeouts, no hand-written parser); its browser tests
# (tests/console/test_console_browser.py) drive Debian's headless chromium
# through chromium-driver and python3-selenium, nothing downloaded at test time.
PKGS="$PKGS libmicrohttpd-dev chromium chromium-driver python3-selenium"
# node and npm: bench-peer installs graphile-worker with npm ci.  A node
# already installed (e.g. NodeSource's, which brings its own npm) is kept.
command -v npm >/dev/null 2>&1 || PKGS="$PKGS nodejs npm"
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
    # nginx's own service (port 80): the benches start private ones.
    $SUDO systemctl disable --now nginx.service >/dev/null 2>&1 || true
fi

# OpenSMTPD (bench only: make bench-email measures the email provider
# against it; no test needs it).  bench/opensmtpd_relay.py runs its own
# smtpd on a loopback port with a private queue; the package's service is
# never used.  apt must not remove anything for it: opensmtpd replaces any
# other MTA (postfix, exim4, ...), so on a machine that has one it is left
# out (--no-remove) and bench-email skips its OpenSMTPD part.  When this
# script installs it, the service it enables (port 25) is disabled and
# stopped again; an opensmtpd that was already installed is left as it was.
if ! dpkg-query -W -f='${Status}' opensmtpd 2>/dev/null | grep -q 'ok installed'; then
    if $SUDO apt-get install -y -q --no-install-recommends --no-remove opensmtpd; then
        if [ -d /run/systemd/system ]; then
            $SUDO systemctl disable --now opensmtpd.service >/dev/null 2>&1 || true
        else
            $SUDO systemctl disable opensmtpd.service >/dev/null 2>&1 ||
                $SUDO update-rc.d opensmtpd disable >/dev/null 2>&1 || true
            $SUDO service opensmtpd stop >/dev/null 2>&1 || true
        fi
    else
        echo "install-deps: opensmtpd left out (it would replace this machine's MTA);" \
             "make bench-email skips its OpenSMTPD part" >&2
    fi
fi

# promtool (tests/operator/test_monitoring.py) comes from Debian's prometheus
# package, but only that one static binary is taken out of it: installing
# the package would add a user and start a Prometheus server.
if ! command -v promtool >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    (cd "$tmp" && $SUDO apt-get download -q prometheus)
    dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$tmp" ./usr/bin/promtool
    $SUDO install -m 0755 "$tmp/usr/bin/promtool" /usr/local/bin/promtool
    rm -rf "$tmp"
fi

# Postfix (tests/email/test_email_postfix.py, tests/servers/postfix_relay.py:
# the relay most users run, Debian's 3.7 with CHUNKING on as Debian ships
# it).  The postfix package conflicts with opensmtpd (the bench's other
# relay) and would set up a system MTA; so its binaries are unpacked
# (apt-get download, dpkg-deb -x) into /opt/outbox-postfix, and only what
# they need is installed: their libraries, and the postfix user and
# postdrop group that a master refuses to run without.  The tests start
# private instances (own config, queue and port, loopback only).
PKGS_POSTFIX="libdb5.3 libicu72 libnsl2 libsasl2-2 libssl3 netbase"
# shellcheck disable=SC2086
$SUDO apt-get install -y -q --no-install-recommends $PKGS_POSTFIX
getent group postdrop >/dev/null || $SUDO groupadd --system postdrop
getent passwd postfix >/dev/null ||
    $SUDO useradd --system --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin postfix
if [ ! -x /opt/outbox-postfix/usr/lib/postfix/sbin/master ]; then
    tmp=$(mktemp -d)
    chmod 755 "$tmp"
    (cd "$tmp" && $SUDO apt-get download -q postfix)
    $SUDO mkdir -p /opt/outbox-postfix
    $SUDO dpkg-deb -x "$tmp"/postfix_*.deb /opt/outbox-postfix
    rm -rf "$tmp"
fi
