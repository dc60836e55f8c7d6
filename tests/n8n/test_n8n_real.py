# SPDX-License-Identifier: ISC
"""The n8n kit against a real n8n, in the suite: examples/n8n/check-with-n8n.sh
on n8n's default (`vm`) expression engine, with the n8n that
tests/n8n/npm/package-lock.json pins (installed once per machine with
`npm ci` into a cache folder keyed by the lock's hash; about 5 minutes
when cold, then reused), this build's dispatcher and outboxctl, the local
sink, and every scenario of examples/n8n/check-scenarios.py.

The kit once failed on n8n's default engine while every test without n8n
passed: this is the test that runs where a change can break it.  It never
skips in CI (CI set): an n8n that cannot be installed fails it.  Outside CI,
OUTBOX_N8N_CHECK=skip skips it (a quick local run).
"""
import os
import re
import subprocess

import pytest

from outbox_test import BUILD_DIR, ROOT

CHECK = os.path.join(ROOT, "examples", "n8n", "check-with-n8n.sh")
# The scenarios check-scenarios.py runs on one engine: fewer passed means
# a part of the check did not run.
MIN_SCENARIOS = 33


# Alone, after the parallel part: n8n's start-ups and its npm install load
# both cores for minutes, which would slow the timing-bound tests beside it.
@pytest.mark.exclusive
def test_the_kit_on_a_real_n8n(tmp_path):
    if not os.environ.get("CI") and os.environ.get("OUTBOX_N8N_CHECK") == "skip":
        pytest.skip("OUTBOX_N8N_CHECK=skip (outside CI only)")
    log = tmp_path / "check-with-n8n.log"
    env = dict(os.environ, BUILD_DIR=BUILD_DIR)
    # The check starts its own PostgreSQL; nothing of the suite's server.
    for k in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE"):
        env.pop(k, None)
    with open(log, "w") as out:
        r = subprocess.run(["sh", CHECK, "default"], stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, env=env, cwd=ROOT, timeout=3600)
    text = log.read_text()
    tail = "\n".join(text.splitlines()[-80:])
    summary = re.search(r"^n8n check \(engine vm, n8n's default\): (\d+) passed, (\d+) failed", text, re.M)
    assert r.returncode == 0 and summary, f"check-with-n8n.sh exited {r.returncode}:\n{tail}"
    passed, failed = int(summary.group(1)), int(summary.group(2))
    assert failed == 0 and passed >= MIN_SCENARIOS, f"{passed} passed, {failed} failed:\n{tail}"
    # How long it took, in the test's output (pytest -rA, or the log).
    print("\n".join(l for l in text.splitlines()
                    if l.startswith(("installed n8n", "using the n8n", "n8n check"))))
