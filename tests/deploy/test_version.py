# SPDX-License-Identifier: ISC
"""Each build says what it is: debian/changelog's version and, in a git
checkout, + git<commits>.g<hash> (.dirty with uncommitted changes), the
same in `outbox-dispatcher --version`, `outboxctl --version` and a live
worker's /metrics (outbox_build_info{version}); the package carries it as
its Version (tests/deploy/test_package.py)."""
import os
import re
import subprocess
import urllib.request

from outbox_test import BUILD_DIR, ROOT, free_port, wait_for

PATTERN = r"(\d+\.\d+\.\d+)(\+git(\d+)\.g([0-9a-f]{9})(\.dirty)?)?"


def test_the_binaries_say_which_commit_they_were_built_from(dispatchers):
    out = subprocess.run([os.path.join(BUILD_DIR, "outbox-dispatcher"), "--version"],
                         capture_output=True, text=True, check=True).stdout
    m = re.fullmatch(r"outbox-dispatcher " + PATTERN + r"\n", out)
    assert m, out
    version = out.split()[1]
    changelog = open(os.path.join(ROOT, "debian", "changelog")).readline()
    assert m.group(1) == re.match(r"\S+ \(([^)+]+)", changelog).group(1)
    if os.path.exists(os.path.join(ROOT, ".git")):
        assert m.group(2), f"a build from a git checkout names its commit: {out}"
        # A commit of this repository's history, counted from its root.
        rev = subprocess.run(["git", "rev-parse", m.group(4) + "^{commit}"], cwd=ROOT,
                             capture_output=True, text=True)
        assert rev.returncode == 0, rev.stderr
        count = subprocess.run(["git", "rev-list", "--count", m.group(4)], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        assert m.group(3) == count
    ctl = subprocess.run([os.path.join(BUILD_DIR, "outboxctl"), "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert re.fullmatch(rf"outboxctl {re.escape(version)} \(schema \d+\)\n", ctl), ctl
    port = free_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"}})
    text = wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                   timeout=5).read().decode(), what="/metrics")
    assert f'\noutbox_build_info{{version="{version}"}} 1\n' in text, text[:2000]
