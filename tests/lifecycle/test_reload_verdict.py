# SPDX-License-Identifier: ISC
"""`outbox-dispatcher --reload PID` (the unit's ExecReload=): SIGHUP to the
worker, then its verdict from $RUNTIME_DIRECTORY/reload: exit 0 for a
config the worker applied, 1 for one it refused (it keeps the old one and
goes on serving), with the worker's reason on stderr."""
import os
import subprocess

from outbox_test import BUILD_DIR, Dispatcher, wait_for

DAEMON = os.path.join(BUILD_DIR, "outbox-dispatcher")


def reload(pid, env):
    return subprocess.run([DAEMON, "--reload", str(pid)], capture_output=True, text=True, env=env,
                          timeout=90)


def test_reload_waits_for_the_workers_verdict(db, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = dict(os.environ, RUNTIME_DIRECTORY=str(run))
    w = Dispatcher(db, tmp_path, {}, env={"RUNTIME_DIRECTORY": str(run)}).start()
    try:
        # Written once the worker's config is loaded, which may come after
        # start() returns: awaited, then read.
        wait_for(lambda: (run / "reload").exists() and (run / "reload").read_text().endswith("\n"),
                 what="the worker's first verdict")
        assert (run / "reload").read_text() == "0 ok started\n"
        # A valid file (another log level): applied.
        with open(w.config_path, "a") as f:
            f.write("\n[log]\nlevel = debug\n")
        r = reload(w.proc.pid, env)
        assert r.returncode == 0, r.stderr
        assert "config reloaded" in r.stderr
        assert (run / "reload").read_text() == "1 ok config reloaded\n"
        # A broken one: refused, the worker keeps running with the old one.
        good = open(w.config_path).read()
        with open(w.config_path, "a") as f:
            f.write("\n[dispatcher]\nlease_seconds = many\n")
        r = reload(w.proc.pid, env)
        assert r.returncode == 1, r.stderr
        assert "lease_seconds" in r.stderr, r.stderr
        assert (run / "reload").read_text().startswith("2 failed ")
        assert w.proc.poll() is None
        wait_for(lambda: any(e.get("event") == "reload_failed" for e in w.events()), what="reload_failed")
        open(w.config_path, "w").write(good)
        assert reload(w.proc.pid, env).returncode == 0
        # No runtime directory, no PID: a usage error, nothing signalled.
        r = reload(w.proc.pid, {k: v for k, v in env.items() if k != "RUNTIME_DIRECTORY"})
        assert r.returncode == 2 and "RUNTIME_DIRECTORY" in r.stderr, r.stderr
        assert reload("x", env).returncode == 2
        assert (run / "reload").read_text().startswith("3 ok ")
    finally:
        w.stop()
