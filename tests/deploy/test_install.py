# SPDX-License-Identifier: ISC
"""`make install PREFIX=... DESTDIR=...` puts binaries, plugins, SQL, units
and the example config where the units and the README say."""
import os
import subprocess

from outbox_test import ROOT


def test_make_install_layout(tmp_path):
    dest = tmp_path / "root"
    # A build directory of its own: `install` depends on `all`, and relinking
    # the suite's sanitizer build without its flags would break it for the
    # tests running beside this one.
    r = subprocess.run(["make", "-s", "-j2", "install", f"BUILD={tmp_path / 'build'}",
                        "PREFIX=/opt/outbox", f"DESTDIR={dest}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    p = dest / "opt/outbox"
    for f in ("bin/outbox-dispatcher", "bin/outboxctl",
              "lib/outbox-dispatcher/providers/outbox_http.so",
              "lib/outbox-dispatcher/providers/outbox_email.so",
              "lib/outbox-dispatcher/providers/outbox_crm.so",
              "share/outbox-dispatcher/sql/100_baseline.sql",
              "share/outbox-dispatcher/sql/functions/30_dispatcher.sql",
              "share/outbox-dispatcher/dispatcher.ini.example",
              "lib/systemd/system/outbox-dispatcher@.service",
              "lib/systemd/system/outbox-dispatcher.target",
              "lib/systemd/system/outbox-prune.service", "lib/systemd/system/outbox-prune.timer"):
        assert (p / f).exists(), f
    assert os.access(p / "bin/outbox-dispatcher", os.X_OK)
    unit = (p / "lib/systemd/system/outbox-dispatcher@.service").read_text()
    assert "/opt/outbox/bin/outbox-dispatcher" in unit and "@PREFIX@" not in unit
    creds = dest / "etc/outbox-dispatcher/credentials"
    assert creds.is_dir() and (creds.stat().st_mode & 0o777) == 0o700
    env = dest / "etc/outbox-dispatcher/environment"
    assert "AI_ACTIONS_ENABLED=false" in env.read_text()
    # As the docs say: no secrets in it, readable (0644).
    assert (env.stat().st_mode & 0o777) == 0o644


def test_users_flags_are_added_to_not_replacing_the_builds(tmp_path):
    """make CFLAGS=-O0 CPPFLAGS=... builds: the includes, warnings and
    -Werror the build needs are added to the user's flags; and a header
    change rebuilds what includes it (-MMD -MP)."""
    build = tmp_path / "build"
    r = subprocess.run(["make", "-s", "-j2", f"BUILD={build}", "CFLAGS=-O0 -g",
                        "CPPFLAGS=-DOUTBOX_TEST_CPPFLAG=1", str(build / "outboxctl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    deps = (build / "obj" / "lib" / "util.d").read_text()
    assert "lib/util.h" in deps, deps
    # Nothing to do the second time; a dependency's timestamp moving
    # forward rebuilds the objects that include it.
    r = subprocess.run(["make", "-n", f"BUILD={build}", "CFLAGS=-O0 -g",
                        "CPPFLAGS=-DOUTBOX_TEST_CPPFLAG=1", str(build / "outboxctl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "util.c" not in r.stdout, r.stdout
    r = subprocess.run(["make", "-n", f"BUILD={build}", "CFLAGS=-O0 -g", "-W", "lib/util.h",
                        str(build / "outboxctl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "lib/util.c" in r.stdout, r.stdout
