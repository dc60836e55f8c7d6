# SPDX-License-Identifier: ISC
"""The Debian package under a real systemd (tests/systemd/sdbox.sh, /usr
copy-on-write), through its whole life as docs/running-a-fleet.md and
docs/operating.md tell it, their marked blocks run as written (only the
database's address, the webhook host and the .deb's directory replaced):

install (nothing enabled or started), database, host, three instances,
sends on, the prune timer (as the operator login, with its own
credential: a run prunes what is old and is recorded under that login);
then, while a producer streams effects, the upgrade to a newer build
(install: the running workers untouched and no unit left
NeedDaemonReload=yes; migrate; daemon-reload; rolling restart: every
instance on the new binary), every effect delivered exactly once; remove
under a policy-rc.d that denies (the workers stopped all the same); purge
(none of the package's files, no enablement link, no state left but the
operator's own files); a reinstall finds nothing enabled.
"""
import os
import threading
import time

import psycopg2
import pytest

from debian_package import build_deb, build_upgrade_deb
from outbox_test import wait_for

from boxes import Box, Postgres, doc_blocks, healthz

INSTANCES = (1, 2, 3)
UNITS = [f"outbox-dispatcher@{i}.service" for i in INSTANCES]
BASE_PORT = 9464

pytestmark = [
    pytest.mark.exclusive,   # ports 9464.., a second PostgreSQL, a package build
    pytest.mark.skipif(os.geteuid() != 0, reason="boots systemd in namespaces and installs a .deb: needs root"),
]


@pytest.fixture
def pg():
    p = Postgres()
    yield p
    p.close()


@pytest.fixture
def box(shipped_port):
    # The box shares the machine's network: its workers listen on 9464...
    b = Box(overlays=("/usr", "/opt"))
    yield b
    b.close()


def main_pids(box):
    return {u: box.prop(u, "MainPID") for u in UNITS}


def exe(box, pid):
    return box.run(f"readlink /proc/{pid}/exe").stdout.strip()


def dispatcher_processes(box):
    """PIDs in the box running an outbox-dispatcher binary (deleted or not)."""
    r = box.run("for p in /proc/[0-9]*; do e=$(readlink $p/exe 2>/dev/null) || continue; "
                "case $e in *outbox-dispatcher*) echo ${p#/proc/} $e;; esac; done", check=False)
    return r.stdout.split("\n") if r.stdout.strip() else []


def test_package_lifecycle_under_real_systemd(box, pg):
    from http_sink import Sink
    t0 = time.monotonic()
    blocks = doc_blocks()
    for name in ("package-install", "database", "host", "enable", "kill-switch", "prune-timer",
                 "upgrade", "rolling-restart", "remove", "purge"):
        assert name in blocks, f"the docs have no <!-- systemd-test: {name} --> block"
    debs = {"v1": build_deb()}
    debs["v2"] = build_upgrade_deb(debs["v1"])
    for tag, path in debs.items():
        box.put(f"/run/debs/{tag}/{os.path.basename(path)}", open(path, "rb").read())

    def text(name, deb="v1"):
        t = blocks[name].replace("host=db.internal", f"host=127.0.0.1 port={pg.port}")
        return t.replace("hooks.internal", "127.0.0.1").replace("./build/deb/", f"/run/debs/{deb}/")

    def doc(name, deb="v1", **kw):
        return box.run(text(name, deb), **kw)

    def version():
        return box.run("dpkg-query -W -f '${Version}' outbox-dispatcher").stdout

    # Install: the units are there, nothing enabled, nothing running.
    doc("package-install")
    v1 = version()
    for u in UNITS + ["outbox-dispatcher.target", "outbox-prune.timer"]:
        assert box.run(f"systemctl is-enabled {u}", check=False).stdout.strip() == "disabled", u
    assert box.prop(UNITS[0], "LoadState") == "loaded" and box.prop(UNITS[0], "ActiveState") == "inactive"

    doc("database")
    doc("host")
    doc("enable", timeout=120)
    for i in INSTANCES:
        wait_for(lambda: healthz(BASE_PORT + i - 1) == (200, "ok"), timeout=30, what=f"@{i} healthy")
    doc("kill-switch")

    # Reload with the docs' credentials: a valid file reloads, in every
    # instance (the worker reads its credential itself); a broken one fails
    # the reload, and the worker keeps running on its old config.
    for i in INSTANCES:
        pid = box.prop(UNITS[i - 1], "MainPID")
        r = box.run(text("reload").replace("outbox-dispatcher@1", f"outbox-dispatcher@{i}"),
                    check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        journal = box.run(f"journalctl -u {UNITS[i - 1]} -o cat --no-pager").stdout
        assert "config reloaded" in journal and "Reload failed" not in journal, journal[-3000:]
        assert box.prop(UNITS[i - 1], "MainPID") == pid
    box.run("cp /etc/outbox-dispatcher/dispatcher.ini /run/good.ini && "
            "printf '\\n[dispatcher]\\nlease_seconds = many\\n' >> /etc/outbox-dispatcher/dispatcher.ini")
    pid = box.prop(UNITS[0], "MainPID")
    r = doc("reload", check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    journal = box.run(f"journalctl -u {UNITS[0]} -o cat --no-pager").stdout
    assert "lease_seconds" in journal and "Reload failed" in journal, journal[-3000:]
    assert "Permission denied" not in journal, journal[-3000:]
    assert box.prop(UNITS[0], "MainPID") == pid and box.prop(UNITS[0], "ActiveState") == "active"
    assert box.prop(UNITS[0], "StatusText").startswith("reload failed; running with the old config")
    wait_for(lambda: healthz(BASE_PORT) == (200, "ok"), timeout=30, what="@1 healthy after the refused reload")
    box.run("cp /run/good.ini /etc/outbox-dispatcher/dispatcher.ini")

    # Each unit gets its own credentials: the prune login reaches no worker.
    doc("prune-timer")
    # (Persistent=yes: systemd keeps a stamp of the timer, which purge removes.)
    assert box.run("ls /var/lib/systemd/timers/").stdout.split() == ["stamp-outbox-prune.timer"]
    for u in UNITS:
        # (outbox: the unit's SetCredential= fallback, "absent".)
        creds = box.run(f"ls /run/credentials/{u}/").stdout.split()
        assert sorted(creds) == ["outbox", "outbox_db-conninfo"], (u, creds)
        assert "outbox_prune" not in box.run(f"cat /run/credentials/{u}/*").stdout, u

    sink = Sink().start()
    insp = psycopg2.connect(pg.dsn())
    insp.autocommit = True
    icur = insp.cursor()
    produced, stop, errors = [], threading.Event(), []

    def producer():
        try:
            c = psycopg2.connect(pg.dsn(user="n8n"))
            c.autocommit = True
            cur = c.cursor()
            n = 0
            while not stop.is_set():
                key = f"pkg-{n}-{time.monotonic_ns()}"
                cur.execute("SELECT status FROM outbox_claim_run(%s, 'h', gen_random_uuid(), 300)", (key,))
                cur.execute("SELECT * FROM outbox_enqueue(%s, 'http', %s, %s::jsonb)",
                            (key, sink.url + "/ok", '{"body": {"n": 1}}'))
                produced.append(key)
                n += 1
                stop.wait(0.05)
            c.close()
        except Exception as e:   # reported by the main thread
            errors.append(repr(e))

    def completed(keys):
        icur.execute("SELECT count(*) FROM outbox_effects WHERE idempotency_key = ANY(%s) "
                     "AND state = 'completed'", (keys,))
        return icur.fetchone()[0]

    thread = threading.Thread(target=producer, daemon=True)
    try:
        thread.start()
        wait_for(lambda: len(produced) >= 20 and completed(produced[:20]) == 20, timeout=60,
                 what="the first effects delivered")

        # The prune timer, as documented (enabled above): a run now prunes
        # an effect finished long ago, recorded under the operator login.
        assert box.prop("outbox-prune.timer", "ActiveState") == "active"
        # Five effects created and finished 100 days ago, in a month of
        # their own (prune drops whole months of the history): made as the
        # table owner in one transaction, so no worker sees them open.
        old = ["prune-old-%d" % i for i in range(5)]
        icur.execute(
            "SELECT outbox_history_partitions(now() - interval '100 days', now());"
            "INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
            " SELECT k, 'processing', 'x' FROM unnest(%(k)s::text[]) k;"
            "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, created_at,"
            " available_at) SELECT k, 'http', %(t)s, '{}', now() - interval '100 days',"
            " now() - interval '100 days' FROM unnest(%(k)s::text[]) k;"
            "WITH gone AS (DELETE FROM effect_live WHERE effect_id IN (SELECT effect_id FROM"
            " effect_outbox WHERE idempotency_key = ANY(%(k)s)) RETURNING *)"
            " INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at,"
            " ended_at, state) SELECT effect_id, created_at, 1, 'test', created_at, created_at,"
            " 'completed' FROM gone", {"k": old, "t": sink.url + "/old"})
        box.run("sudo systemctl start outbox-prune.service")
        assert box.prop("outbox-prune.service", "Result") == "success"
        icur.execute("SELECT count(*) FROM outbox_effects WHERE idempotency_key = ANY(%s)", (old,))
        assert icur.fetchone()[0] == 0
        icur.execute("SELECT operator, reason FROM operator_actions WHERE action = 'prune'")
        assert icur.fetchall() == [("outbox_prune", "outbox-prune.timer")]

        # Upgrade, the producer still inserting.  The install leaves the
        # running workers alone (same PIDs, now running a deleted binary)
        # and systemd up to date with the new unit files.
        before = main_pids(box)
        assert all(not exe(box, p).endswith("(deleted)") for p in before.values())
        upgrade = text("upgrade", deb="v2").strip().split("\n")
        assert upgrade[0].startswith("sudo apt-get install"), upgrade
        box.run(upgrade[0])
        v2 = version()
        assert v2 != v1 and v2.startswith(v1), (v1, v2)
        assert main_pids(box) == before
        assert all(exe(box, p).endswith("(deleted)") for p in before.values())
        for u in UNITS + ["outbox-dispatcher.target", "outbox-prune.timer"]:
            assert box.prop(u, "NeedDaemonReload") == "no", u
        box.run("\n".join(upgrade[1:]))
        doc("rolling-restart", timeout=180)
        after = main_pids(box)
        for u in UNITS:
            assert after[u] not in ("0", before[u]), (u, before, after)
            assert exe(box, after[u]) == "/usr/bin/outbox-dispatcher", u
            assert box.prop(u, "ActiveState") == "active"
        n_before_stop = len(produced)
        wait_for(lambda: len(produced) >= n_before_stop + 20, timeout=30, what="more effects after the upgrade")
    finally:
        stop.set()
        thread.join(timeout=30)
    try:
        assert not errors, errors
        keys = produced[5:]
        wait_for(lambda: completed(keys) == len(keys), timeout=90,
                 what=f"all {len(keys)} streamed effects completed")
        got = sink.keys()
        assert len(sink.received()) == len(produced), (len(sink.received()), len(produced))
        assert all(v == 1 for v in got.values()), {k: v for k, v in got.items() if v != 1}
    finally:
        sink.stop()
        insp.close()

    # Remove under a policy that forbids stopping services: the workers
    # and the timer stop all the same, before their binaries go.
    files = box.run("dpkg -L outbox-dispatcher | while read -r f; do [ -d \"$f\" ] || echo \"$f\"; done"
                    ).stdout.split()
    assert "/usr/bin/outbox-dispatcher" in files and "/lib/systemd/system/outbox-prune.timer" in files
    box.put("/usr/sbin/policy-rc.d", b"#!/bin/sh\nexit 101\n")
    box.run("chmod 755 /usr/sbin/policy-rc.d")
    doc("remove", timeout=120)
    for u in UNITS + ["outbox-dispatcher.target", "outbox-prune.timer"]:
        assert box.prop(u, "ActiveState") in ("inactive", ""), u
    assert dispatcher_processes(box) == []

    # Purge: nothing of the package is left, no enablement link, no
    # deb-systemd-helper state; /etc/outbox-dispatcher holds only what the
    # operator wrote.
    doc("purge", timeout=120)
    assert box.run("dpkg-query -W -f '${db:Status-Abbrev}' outbox-dispatcher", check=False).stdout.strip() \
        in ("", "pn")
    left = box.run("for f in " + " ".join(files) + "; do [ ! -e \"$f\" ] || echo \"$f\"; done").stdout.split()
    assert left == [], left
    links = box.run("find /etc/systemd/system /var/lib/systemd/deb-systemd-helper-enabled "
                    "/var/lib/systemd/deb-systemd-helper-masked -name '*outbox*' 2>/dev/null || true").stdout
    assert links.split() == [], links
    assert box.run("systemctl list-unit-files --no-legend 'outbox*'", check=False).stdout.strip() == ""
    mine = box.run("cd /etc/outbox-dispatcher && find . -type f | sort").stdout.split()
    assert mine == ["./credentials/db-conninfo", "./dispatcher.ini", "./prune/conninfo"], mine
    # Nor the prune timer's stamp.
    assert box.run("ls /var/lib/systemd/timers/ 2>/dev/null | grep outbox || true").stdout.strip() == ""

    # A reinstall starts with nothing enabled.
    doc("package-install", deb="v2")
    for u in UNITS + ["outbox-dispatcher.target", "outbox-prune.timer"]:
        assert box.run(f"systemctl is-enabled {u}", check=False).stdout.strip() == "disabled", u
    print(f"package lifecycle under systemd: {time.monotonic() - t0:.1f} s")
    assert time.monotonic() - t0 < 600
