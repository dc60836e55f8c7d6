# SPDX-License-Identifier: ISC
"""The documented deployment, walked under a real systemd (PID 1 of its own
namespaces, tests/systemd/sdbox.sh), the way a new operator would.

Every shell command comes from docs/running-a-fleet.md: the blocks marked
<!-- systemd-test: NAME --> are read from the file and run as they are,
inside the box, with only the database's address and the webhook host
replaced (host=db.internal -> this test's PostgreSQL, hooks.internal ->
127.0.0.1) and a `sudo` that just runs its command (the box is root).  So
the docs cannot drift from what is tested.

What it proves: make install + daemon-reload (the tree is a copy-on-write
view inside the box: the docs' `make` leaves it untouched); a login granted only
outbox_dispatcher; three instances enabled from one config file while the
database is down: up (READY=1, never restarted by the start timeout) but
not ready (STATUS=, /healthz 503, outbox_ready 0) until it answers;
every effect delivered exactly once to a local sink; SIGKILL -> restart;
a stopped loop (SIGSTOP) -> watchdog restart; `systemctl reload` of a
valid file (with the credential) succeeds, of a broken one fails, the
worker keeping its config; stopping the fleet drains an in-flight send; the
unit's `systemd-analyze security` exposure <= 2.0; the docs' journalctl
command.  Everything it started is stopped by PID (the box by its PID 1).
"""
import os
import re
import sys
import time
import urllib.request

import psycopg2
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "servers"))

from outbox_test import wait_for  # noqa: E402

from boxes import Box, Postgres, doc_blocks, healthz  # noqa: E402

INSTANCES = (1, 2, 3)
BASE_PORT = 9464          # [metrics] listen of the shipped example

pytestmark = [
    pytest.mark.exclusive,   # the whole machine: ports 9464.., a second PostgreSQL, a build
    pytest.mark.skipif(os.geteuid() != 0, reason="boots systemd in namespaces: needs root"),
]


@pytest.fixture
def box(shipped_port):
    # The box shares the machine's network: its workers listen on 9464...
    b = Box()
    yield b
    b.close()


@pytest.fixture
def pg():
    p = Postgres()
    yield p
    p.close()


def test_documented_fleet_under_real_systemd(box, pg):
    from http_sink import Sink
    t0 = time.monotonic()
    blocks = doc_blocks()
    for name in ("install", "database", "host", "enable", "kill-switch", "reload", "stop", "journal"):
        assert name in blocks, f"docs/running-a-fleet.md has no <!-- systemd-test: {name} --> block"

    def doc(name, **kw):
        text = blocks[name].replace("host=db.internal", f"host=127.0.0.1 port={pg.port}")
        text = text.replace("hooks.internal", "127.0.0.1")
        return box.run(text, **kw)

    # Install, migrate, roles, host files: as documented.
    doc("install", env={"MAKEFLAGS": "-j2"}, timeout=600)
    doc("database")
    doc("host")
    assert box.run("stat -c %a /etc/outbox-dispatcher/environment").stdout.strip() == "644"

    sink = Sink().start()
    conn = None
    try:
        # The database is down when the fleet starts: every worker is up
        # (READY=1 once its first attempt failed, so the start timeout
        # never restarts it and resets its alerts' `for:`), not ready, and
        # says why: STATUS=, /healthz 503, outbox_ready 0.
        pg.stop()
        enabling = box.popen(blocks["enable"])
        units = [f"outbox-dispatcher@{i}.service" for i in INSTANCES]
        out, err = enabling.communicate(timeout=90)
        assert enabling.returncode == 0, out + err
        for u in units:
            assert box.prop(u, "ActiveState") == "active", u
            assert box.prop(u, "StatusText").startswith("up, not ready: database unreachable"), \
                box.prop(u, "StatusText")
        pids = {u: box.prop(u, "MainPID") for u in units}
        for i in INSTANCES:
            code, why = healthz(BASE_PORT + i - 1)
            assert code == 503 and "database unreachable" in why, (code, why)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{BASE_PORT + i - 1}/metrics",
                                             timeout=5).read().decode()
            assert "\noutbox_ready 0\n" in metrics and "\noutbox_db_up 0\n" in metrics
            # Nothing measured: no unknown figure (not a 0 that would look
            # like a drop to OutboxUnknownRising).
            assert "\noutbox_unknown_effects " not in metrics
        pg.start()
        for i in INSTANCES:
            wait_for(lambda: healthz(BASE_PORT + i - 1) == (200, "ok"), timeout=60,
                     what=f"instance {i} /healthz on {BASE_PORT + i - 1}")
        for u in units:
            wait_for(lambda: box.prop(u, "StatusText").startswith("ready"), timeout=30,
                     what=f"{u} STATUS= ready")
            assert box.prop(u, "MainPID") == pids[u], "restarted while the database was down"

        # Sends: the kill switch on (host half in the environment file,
        # fleet half with outboxctl as an operator login), then rows from a
        # producer login, each delivered exactly once.
        doc("kill-switch")
        conn = psycopg2.connect(pg.dsn(user="n8n"))      # the producer's login
        conn.autocommit = True
        cur = conn.cursor()
        insp = psycopg2.connect(pg.dsn())                 # the test's own reads
        insp.autocommit = True
        icur = insp.cursor()

        def produce(n, path):
            keys = []
            for k in range(n):
                key = f"sd-{path.strip('/').replace('/', '-')}-{k}-{time.monotonic_ns()}"
                cur.execute("SELECT status FROM outbox_claim_run(%s, 'h', gen_random_uuid(), 300)", (key,))
                cur.execute("SELECT * FROM outbox_enqueue(%s, 'http', %s, %s::jsonb)",
                            (key, sink.url + path, '{"body": {"n": 1}}'))
                keys.append(key)
            return keys

        def states(keys):
            icur.execute("SELECT state, count(*) FROM outbox_effects WHERE idempotency_key = ANY(%s) "
                         "GROUP BY 1", (keys,))
            return dict(icur.fetchall())

        keys = produce(30, "/ok")
        wait_for(lambda: states(keys) == {"completed": 30}, timeout=60, what="30 effects completed")
        counts = sink.count()
        assert len(sink.received()) == 30 and all(v == 1 for v in sink.keys().values()), counts
        icur.execute("SELECT DISTINCT worker FROM effect_attempts")
        host = box.run("hostname").stdout.strip()
        assert {r[0] for r in icur.fetchall()} <= {f"{host}-{i}" for i in INSTANCES}

        # SIGKILL: systemd restarts the instance; it serves again.
        u1 = units[0]
        pid = box.prop(u1, "MainPID")
        box.run(f"systemctl kill -s SIGKILL {u1}")
        wait_for(lambda: box.prop(u1, "MainPID") not in ("0", pid) and box.prop(u1, "ActiveState") == "active",
                 timeout=60, what="restart after SIGKILL")
        wait_for(lambda: healthz(BASE_PORT) == (200, "ok"), timeout=30, what="@1 healthy after SIGKILL")

        # A stopped loop: the watchdog (shortened to 3 s by a drop-in)
        # aborts and restarts it.
        u2 = units[1]
        box.run(f"mkdir -p /etc/systemd/system/{u2}.d && printf '[Service]\\nWatchdogSec=3\\n' > "
                f"/etc/systemd/system/{u2}.d/watchdog.conf && systemctl daemon-reload && systemctl restart {u2}")
        pid = box.prop(u2, "MainPID")
        assert box.prop(u2, "WatchdogUSec") == "3s"
        box.run(f"kill -STOP {pid}")
        wait_for(lambda: box.prop(u2, "MainPID") not in ("0", pid) and box.prop(u2, "ActiveState") == "active",
                 timeout=60, what="watchdog restart after SIGSTOP")
        assert "watchdog" in box.run(f"journalctl -u {u2} -o cat --no-pager").stdout.lower()

        # A valid file reloads (the worker reads the credential itself).
        pid = box.prop(u1, "MainPID")
        r = doc("reload", check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "config reloaded" in box.run(f"journalctl -u {u1} -o cat --no-pager").stdout
        # A broken file on reload is refused; the worker keeps running.
        box.run("cp /etc/outbox-dispatcher/dispatcher.ini /run/good.ini && "
                "printf '\\n[dispatcher]\\nlease_seconds = many\\n' >> /etc/outbox-dispatcher/dispatcher.ini")
        # The reload fails visibly: the worker refuses the file, systemctl
        # exits non-zero, the worker keeps its config.
        r = doc("reload", check=False)
        assert r.returncode != 0, r.stdout + r.stderr
        assert "lease_seconds" in box.run(f"journalctl -u {u1} -o cat --no-pager").stdout
        assert box.prop(u1, "MainPID") == pid and box.prop(u1, "ActiveState") == "active"
        assert box.prop(u1, "StatusText").startswith("reload failed; running with the old config"), \
            box.prop(u1, "StatusText")
        box.run("cp /run/good.ini /etc/outbox-dispatcher/dispatcher.ini")

        # Stop drains: a send in flight when the fleet stops is finished and
        # recorded, not left to the reaper; the documented stop waits for it.
        slow = produce(1, "/delay/3000")
        wait_for(lambda: states(slow) == {"sending": 1}, timeout=30, what="a slow send in flight")
        doc("stop")
        assert states(slow) == {"completed": 1}, states(slow)
        for u in units:
            assert box.prop(u, "ActiveState") == "inactive", u

        # The unit's sandbox, rated by systemd itself.
        r = box.run(f"systemd-analyze security {u1}", check=False)
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
        assert m and float(m.group(1)) <= 2.0, r.stdout + r.stderr

        # The docs' journalctl command: one JSON object per attempt.
        out = doc("journal").stdout
        attempts = [line for line in out.splitlines() if '"event"' in line]
        assert len(attempts) >= 31 and all('"attempt"' in a for a in attempts), out[-2000:]
        assert time.monotonic() - t0 < 600
    finally:
        if conn:
            conn.close()
            insp.close()
        sink.stop()
