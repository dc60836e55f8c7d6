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
MIN_SCENARIOS = 35


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


FAKE_NPM = """#!/bin/sh
# A stand-in npm: records the call, builds a node_modules as far as it
# gets, then fails or succeeds as FAKE_NPM_RESULT says.
echo "$@" >> "$FAKE_NPM_CALLS"
mkdir -p node_modules/.bin
if [ "$FAKE_NPM_RESULT" = ok ]; then
    printf '#!/bin/sh\\necho 1.123.81\\n' > node_modules/.bin/n8n
    chmod +x node_modules/.bin/n8n
    exit 0
fi
echo "npm ERR! network: the registry went away" >&2
exit 1
"""


def test_the_n8n_install_is_kept_only_when_complete(tmp_path):
    """The cache folder appears only after a complete `npm ci` (built
    beside it, renamed into place); a failed one leaves nothing that a
    later run would reuse, and a complete one is reused without npm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    cache, calls = tmp_path / "cache", tmp_path / "calls"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", N8N_CACHE=str(cache),
               FAKE_NPM_CALLS=str(calls))
    env.pop("N8N_BIN", None)

    def install(result):
        return subprocess.run(["sh", CHECK, "install"], env=dict(env, FAKE_NPM_RESULT=result),
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    r = install("fail")
    assert r.returncode != 0 and "npm ci of n8n 1.123.81 failed" in r.stderr, r
    assert "the registry went away" in r.stderr
    assert list(cache.iterdir()) == [], list(cache.iterdir())
    r = install("ok")
    assert r.returncode == 0, r
    homes = [p.name for p in cache.iterdir()]
    assert len(homes) == 1 and re.fullmatch(r"n8n-[0-9a-f]{16}", homes[0]), homes
    assert (cache / homes[0] / "node_modules" / ".bin" / "n8n").exists()
    assert calls.read_text().split("\n")[:2] == ["ci --no-audit --no-fund --loglevel=error"] * 2
    r = install("fail")
    assert r.returncode == 0 and "not reinstalled" in r.stdout, r
    assert len(calls.read_text().splitlines()) == 2, "npm ran again for an installed lock"
