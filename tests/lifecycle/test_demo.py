# SPDX-License-Identifier: ISC
"""The demo (tests/demo.sh, what scripts/demo.sh runs after the build)
shows the truth: every run state it prints is the settled one, the state
that outboxctl and the producer functions report (outbox_settle_runs),
not the row as the producer left it.  ticket-7's two effects end failed
(HTTP 422) and unknown (HTTP 500), so its run is failed_terminal
everywhere the demo prints it; lead-42's effects are all delivered, so it
is completed."""
import os
import re
import subprocess

from outbox_test import BUILD_DIR, ROOT


def sections(text):
    """{title: body} of the demo's '== title' sections."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("== "):
            title = line[3:]
            out[title] = []
        elif title is not None:
            out[title].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def test_the_demo_prints_settled_run_states():
    env = dict(os.environ, BUILD_DIR=BUILD_DIR)
    for k in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPORT_FIXED"):
        env.pop(k, None)
    r = subprocess.run(["sh", "tests/demo.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = sections(r.stdout)
    runs_title = next(t for t in s if t.startswith("runs"))
    runs = dict(re.findall(r"^\s*(\S+)\s*\|\s*(\S+)\s*$", s[runs_title], re.M))
    assert runs.get("ticket-7") == "failed_terminal", s[runs_title]
    assert runs.get("lead-42") == "completed", s[runs_title]
    # The unknown list names the run's state too: the same one.
    unknown = s["unknown effects waiting for an operator"]
    named = re.findall(r"run key:\s+(\S+) \(run (\w+)\)", unknown)
    assert named, unknown
    for key, state in named:
        assert runs.get(key) == state, (key, state, runs)
    assert "demo done" in r.stdout
