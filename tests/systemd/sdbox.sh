#!/bin/sh
# SPDX-License-Identifier: ISC
# tests/systemd/sdbox.sh: a real systemd (the host's, Debian 12's 252) as
# PID 1 of new PID/mount/cgroup/UTS/IPC namespaces, so that a test can use
# systemctl, journalctl and real units without touching the host:
# copy-on-write overlays over /etc, /usr/local and /var (their upper layers
# on a tmpfs), a private /run and /tmp, read-only /sys and /proc/sys,
# cgroup2 on /sys/fs/cgroup (a cgroup of its own on the host's hierarchy),
# units that would touch host state masked.  The network is the host's
# (loopback peers such as a test PostgreSQL are reachable).
#
#   sdbox.sh start DIR     boot; DIR (new, empty) holds its state; waits
#                          until systemd answers, prints nothing
#   sdbox.sh run DIR CMD.. run CMD inside (all of the box's namespaces),
#                          with its exit status
#   sdbox.sh stop DIR      kill everything in the box (SIGKILL to its PID 1,
#                          by PID), remove its cgroups, unmount, remove DIR
#
# Needs root.  Reusable: any test may boot one and run what it wants in it
# (make install, systemctl ...).  SDBOX_OVERLAYS="/usr /opt" (at start) adds
# copy-on-write overlays over more directories: installing a .deb writes
# to /usr, which is the host's unless overlaid.  SDBOX_TREE=DIR (at start)
# shows DIR (the source tree) inside at its own path, copy-on-write, also
# when it lies under /tmp: what runs there (make, make install) writes to
# the box's layer, never to the tree.  `run` starts its command in the
# caller's directory as the box sees it (the tree's overlay), or in /.
#
# Nothing the box sees depends on what earlier tests did on the host: its
# /tmp, /run and the upper layers are new, its machine id is its own
# (random; an empty /etc/machine-id would make systemd take the host's from
# /var/lib/dbus/machine-id and journalctl merge the host's journal files
# into the box's), its journal volatile (its /run, never /var/log/journal).
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
CG_ROOT=/sys/fs/cgroup
[ -f "$CG_ROOT/cgroup.controllers" ] || CG_ROOT=/sys/fs/cgroup/unified

# Units that would touch host state (devices, clock, kernel settings,
# consoles, networking) or only slow the boot down.
MASK="systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket
systemd-udev-trigger.service systemd-udev-settle.service systemd-hwdb-update.service
systemd-modules-load.service systemd-sysctl.service systemd-remount-fs.service
systemd-firstboot.service systemd-timesyncd.service systemd-networkd.service
systemd-resolved.service systemd-binfmt.service proc-sys-fs-binfmt_misc.automount
proc-sys-fs-binfmt_misc.mount sys-kernel-config.mount sys-kernel-debug.mount
sys-kernel-tracing.mount sys-fs-fuse-connections.mount dev-hugepages.mount dev-mqueue.mount
systemd-random-seed.service systemd-pstore.service systemd-machine-id-commit.service
systemd-boot-system-token.service systemd-repart.service systemd-fsck-root.service
getty@.service serial-getty@.service console-getty.service getty.target
systemd-logind.service e2scrub_reap.service e2scrub_all.timer postgresql.service
pgbouncer.service cron.service ssh.service apt-daily.timer apt-daily-upgrade.timer
dpkg-db-backup.timer fstrim.timer man-db.timer remote-fs.target swap.target
systemd-journal-flush.service systemd-update-utmp.service ldconfig.service
systemd-tmpfiles-clean.timer"

boot_inside() {   # runs as PID 1 of the new namespaces; execs systemd
    dir=$1
    # Private state on a tmpfs: overlays' upper layers and the log.
    mount -t tmpfs -o mode=0755 tmpfs "$dir/fs"
    # Shortest path first: /usr before /usr/local, or it would hide it.
    for d in $(printf '%s\n' /etc /usr/local /var ${SDBOX_OVERLAYS:-} | awk '{ print length, $0 }' | sort -n | uniq | cut -d' ' -f2); do
        [ -d "$d" ] || continue
        n=$(echo "$d" | tr / -)
        mkdir -p "$dir/fs/$n.up" "$dir/fs/$n.work"
        mount -t overlay overlay -o "lowerdir=$d,upperdir=$dir/fs/$n.up,workdir=$dir/fs/$n.work" "$d"
    done
    # Never boot with a host directory writable by mistake.
    for d in /etc /usr/local /var ${SDBOX_OVERLAYS:-}; do
        [ ! -d "$d" ] || [ "$(findmnt -n -o FSTYPE --mountpoint "$d")" = overlay ] || { echo "sdbox: $d is not overlaid" >&2; exit 1; }
    done
    tree=${SDBOX_TREE:-}
    if [ -n "$tree" ]; then
        mkdir -p "$dir/fs/tree.up" "$dir/fs/tree.work" "$dir/fs/tree"
        mount -t overlay overlay -o "lowerdir=$tree,upperdir=$dir/fs/tree.up,workdir=$dir/fs/tree.work" "$dir/fs/tree"
    fi
    mount -t tmpfs -o mode=0755 tmpfs /run
    # The new /tmp is built aside, the tree's overlay put in it if the tree
    # lies under /tmp, then moved over /tmp (which hides $dir too).
    mkdir -p "$dir/fs/tmp"
    mount -t tmpfs -o mode=1777 tmpfs "$dir/fs/tmp"
    case "$tree" in
    '') ;;
    /tmp/*) mkdir -p "$dir/fs/tmp/${tree#/tmp/}" && mount --move "$dir/fs/tree" "$dir/fs/tmp/${tree#/tmp/}" ;;
    *) mount --move "$dir/fs/tree" "$tree" ;;
    esac
    mount --move "$dir/fs/tmp" /tmp
    # The kernel's settings are the host's: read-only.
    mount --bind /proc/sys /proc/sys
    mount -o remount,bind,ro /proc/sys
    mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null || {
        mount -t tmpfs tmpfs /sys/fs/cgroup
        mount -t cgroup2 cgroup2 /sys/fs/cgroup
    }
    mount -o remount,bind,ro /sys 2>/dev/null || { mount --bind /sys /sys && mount -o remount,bind,ro /sys; }
    for u in $MASK; do ln -sf /dev/null "/etc/systemd/system/$u"; done
    rm -f /etc/systemd/system/multi-user.target.wants/* /etc/systemd/system/timers.target.wants/* \
          /etc/systemd/system/sysinit.target.wants/* /etc/systemd/system/getty.target.wants/*
    cat > /etc/systemd/system/sdbox.target <<'UNIT'
[Unit]
Description=sdbox: journald and nothing else
Requires=systemd-journald.socket
After=systemd-journald.socket
AllowIsolate=yes
UNIT
    # A machine id of its own; a volatile journal (its flush is masked
    # too), so that journalctl inside reads the box's entries only.
    od -An -N16 -tx1 /dev/urandom | tr -d ' \n' > /etc/machine-id
    echo >> /etc/machine-id
    mkdir -p /etc/systemd/journald.conf.d
    printf '[Journal]\nStorage=volatile\n' > /etc/systemd/journald.conf.d/sdbox.conf
    hostname sdbox
    # Without a shared root, LoadCredential= files arrive empty.
    mount --make-rshared /
    export container=sdbox
    exec /lib/systemd/systemd --system --unit=sdbox.target
}

pid1() { cat "$1/pid1"; }

case "${1:-}" in
start)
    dir=$2
    mkdir -p "$dir/fs"
    # A cgroup of its own, so that what systemd creates can be removed.
    cg="$CG_ROOT/sdbox-$(basename "$dir")-$$"
    mkdir "$cg"
    echo "$cg" > "$dir/cgroup"
    # shellcheck disable=SC2016
    sh -c 'echo $$ > "$1/cgroup.procs"; exec unshare --pid --fork --mount --mount-proc --cgroup --uts --ipc --propagation private "$2" __inside "$3"' \
        sh "$cg" "$HERE/sdbox.sh" "$dir" </dev/null >"$dir/console.log" 2>&1 &
    echo $! > "$dir/unshare.pid"
    # PID 1 of the box is unshare's child.
    i=0
    while :; do
        c=$(cat "/proc/$(cat "$dir/unshare.pid")/task/$(cat "$dir/unshare.pid")/children" 2>/dev/null | awk '{print $1}')
        [ -n "$c" ] && break
        i=$((i + 1)); [ $i -lt 200 ] || { echo "sdbox: unshare did not start" >&2; cat "$dir/console.log" >&2; exit 1; }
        sleep 0.05
    done
    echo "$c" > "$dir/pid1"
    i=0
    until nsenter -t "$c" -m -p -u -i -C systemctl is-system-running --wait >/dev/null 2>&1 \
          || nsenter -t "$c" -m -p -u -i -C systemctl is-system-running 2>/dev/null | grep -q degraded; do
        i=$((i + 1))
        if [ $i -ge 300 ] || ! kill -0 "$c" 2>/dev/null; then
            echo "sdbox: systemd did not come up" >&2; tail -50 "$dir/console.log" >&2; exit 1
        fi
        sleep 0.1
    done
    ;;
__inside)
    boot_inside "$2"
    ;;
run)
    dir=$2; shift 2
    # The directory is resolved inside (nsenter's --wd would open the
    # host's, bypassing the tree's overlay).
    exec nsenter -t "$(pid1 "$dir")" -m -p -u -i -C sh -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' sh "$(pwd)" "$@"
    ;;
stop)
    dir=$2
    if [ -f "$dir/pid1" ]; then
        p=$(pid1 "$dir")
        kill -KILL "$p" 2>/dev/null || true
        u=$(cat "$dir/unshare.pid" 2>/dev/null || true)
        i=0
        while [ -n "$u" ] && kill -0 "$u" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
    fi
    if [ -f "$dir/cgroup" ]; then
        cg=$(cat "$dir/cgroup")
        # Deepest first.
        find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    fi
    rm -rf "$dir"
    ;;
*)
    echo "usage: sdbox.sh start|run|stop DIR [CMD...]" >&2
    exit 2
    ;;
esac
