# SPDX-License-Identifier: ISC
"""The chaos run's quick mode as part of the regular suite:
5,000 effects of every kind, four workers, SIGKILLs, SIGSTOPs past the
lease, PostgreSQL restarts, backend terminations, kill-switch flips and
broken SIGHUPs, then every invariant checked (tests/chaos/chaos.py).

It runs tests/chaos/run.sh, which starts a PostgreSQL server of its own:
the run restarts its server, which must not disturb the other suites.
"""
import os
import re
import signal
import subprocess

import pytest

from outbox_test import BUILD_DIR, ROOT

BOUND_S = 150     # CHAOS_SECONDS: chaos, drain and checks
HARD_S = 330      # the whole script, PostgreSQL start and stop included


# Run alone, not beside the parallel suites: it has a PostgreSQL server of
# its own, but it loads the machine (four workers, three servers, restarts)
# and its timing (leases, SIGSTOP windows) must not starve the other tests.
@pytest.mark.exclusive
def test_chaos_quick_mode_holds_every_invariant(tmp_path):
    env = dict(os.environ, CHAOS_QUICK="1", CHAOS_SECONDS=str(BOUND_S),
               BUILD_DIR=os.path.relpath(BUILD_DIR, ROOT))
    env.pop("PGPORT_FIXED", None)
    env.pop("CHAOS_EFFECTS", None)
    out = tmp_path / "chaos.out"
    with open(out, "w") as f:
        p = subprocess.Popen(["sh", os.path.join(ROOT, "tests", "chaos", "run.sh")], cwd=ROOT, env=env,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=HARD_S)
        except subprocess.TimeoutExpired:
            # run.sh and chaos.py stop the fleet and PostgreSQL on SIGTERM.
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise AssertionError(f"the quick chaos run overran {HARD_S}s:\n{out.read_text()[-3000:]}")
    text = out.read_text()
    summary = re.findall(r"^(\d+) passed, (\d+) failed$", text, re.M)
    failed = [line for line in text.splitlines() if line.startswith("FAIL ")]
    assert summary, f"no summary line; exit {rc}:\n{text[-4000:]}"
    assert rc == 0 and summary[-1][1] == "0", \
        "chaos invariants failed:\n" + "\n".join(failed) + "\n\n" + text[-3000:]
    assert int(summary[-1][0]) >= 10, "every invariant was checked"
