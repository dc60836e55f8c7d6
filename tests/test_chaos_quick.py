"""The chaos run's quick mode as part of the regular suite (issue 6):
5,000 effects of every kind, four workers, SIGKILLs, SIGSTOPs past the
lease, PostgreSQL restarts, backend terminations, kill-switch flips and
broken SIGHUPs, then every invariant checked (tests/chaos/chaos.py).

It runs tests/chaos/run.sh, which starts a PostgreSQL server of its own:
the run restarts its server, which must not disturb the other suites.
"""
import os
import re
import subprocess

from outbox_test import BUILD_DIR, ROOT

BOUND_S = 150     # CHAOS_SECONDS: chaos, drain and checks
HARD_S = 330      # the whole script, PostgreSQL start and stop included


def test_chaos_quick_mode_holds_every_invariant(tmp_path):
    env = dict(os.environ, CHAOS_QUICK="1", CHAOS_SECONDS=str(BOUND_S),
               BUILD_DIR=os.path.relpath(BUILD_DIR, ROOT))
    env.pop("PGPORT_FIXED", None)
    env.pop("CHAOS_EFFECTS", None)
    out = tmp_path / "chaos.out"
    with open(out, "w") as f:
        r = subprocess.run(["sh", os.path.join(ROOT, "tests", "chaos", "run.sh")], cwd=ROOT, env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=HARD_S)
    text = out.read_text()
    summary = re.findall(r"^(\d+) passed, (\d+) failed$", text, re.M)
    failed = [line for line in text.splitlines() if line.startswith("FAIL ")]
    assert summary, f"no summary line; exit {r.returncode}:\n{text[-4000:]}"
    assert r.returncode == 0 and summary[-1][1] == "0", \
        "chaos invariants failed:\n" + "\n".join(failed) + "\n\n" + text[-3000:]
    assert int(summary[-1][0]) >= 10, "every invariant was checked"
