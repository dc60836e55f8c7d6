# SPDX-License-Identifier: ISC
"""scripts/install-deps.sh --build installs what the build needs and
nothing of the test rig: every Build-Depends of debian/control (debhelper
for debhelper-compat), the compiler, and no PostgreSQL server, nginx or
Node.js; an unknown option is refused before anything is installed."""
import os
import re
import subprocess

from outbox_test import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "install-deps.sh")


def build_pkgs():
    text = open(SCRIPT).read()
    return set(re.search(r'BUILD_PKGS="([^"]*)"', text).group(1).split())


def test_build_only_packages_cover_build_depends():
    control = open(os.path.join(ROOT, "debian", "control")).read()
    deps = re.search(r"^Build-Depends:(.*?)^\S", control, re.S | re.M).group(1)
    names = {re.sub(r"\s*\(.*", "", d).strip() for d in deps.split(",") if d.strip()}
    names = {"debhelper" if n == "debhelper-compat" else n for n in names}
    pkgs = build_pkgs()
    assert names <= pkgs, names - pkgs
    assert {"build-essential", "dpkg-dev", "fakeroot", "git"} <= pkgs
    assert not {"postgresql", "nginx-light", "nodejs", "npm", "valgrind"} & pkgs, pkgs
    assert len(pkgs) <= 20, pkgs


def test_an_unknown_option_installs_nothing():
    r = subprocess.run(["sh", SCRIPT, "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr, r.stderr
