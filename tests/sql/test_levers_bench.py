# SPDX-License-Identifier: ISC
"""make bench-levers (bench/levers.sh) and make bench-insert
(bench/insert_cost.sh) at a small scale, end to end: the baseline's
outboxctl is built from git (bench/baseline.sh, here of HEAD into a cache
of the test's own) and reused from the cache the second time (the insert
bench runs this tree's outboxctl on both sides), each script
starts its own server, every variant delivers the whole backlog (or inserts
every row as a producer login, its row without a run refused), and the
tables carry the figures and ratios docs/performance.md quotes.  A third
levers variant with JIT forced on inside outbox_complete (extra SQL, the
way a variant is added) must come out dearer than the others: the CPU is
charged to the variant that spent it."""
import os
import re
import subprocess

from outbox_test import BUILD_DIR

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
N = 256
# JIT compiles each statement's expressions: milliseconds of the backend's
# CPU per statement, whatever the schema behind the stable signature.
# The completion the bench calls: outbox_complete_sending where the schema
# has it (the hot completion), outbox_complete before.
BURN = ("DO $$ DECLARE f text; BEGIN "
        "FOREACH f IN ARRAY ARRAY['outbox_complete(uuid, text, jsonb)', "
        "'outbox_complete_sending(uuid, text, jsonb)'] LOOP "
        "CONTINUE WHEN to_regprocedure(f) IS NULL; "
        "EXECUTE 'ALTER FUNCTION ' || f || ' SET jit = on'; "
        "EXECUTE 'ALTER FUNCTION ' || f || ' SET jit_above_cost = 0'; "
        "END LOOP; END $$;\n")


def bench_env(cache, **kw):
    env = dict(os.environ, BUILD_DIR=BUILD_DIR, LEVERS_BASELINE_REF="HEAD", OUTBOX_BASELINE_CACHE=cache)
    env.update(kw)
    return env


def test_bench_levers_small_builds_the_baseline_and_charges_each_variant_its_cpu(tmp_path):
    cache = str(tmp_path / "cache")
    burn = tmp_path / "burn.sql"
    burn.write_text(BURN)
    env = bench_env(cache, LEVERS_N=str(N), LEVERS_BATCHES="16 128",
                    LEVERS_EXTRA_VARIANTS="jit=%s:%s" % (os.path.join(BUILD_DIR, "outboxctl"), burn))
    out = subprocess.run(["sh", os.path.join(ROOT, "bench", "levers.sh")], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert "baseline: building outboxctl of HEAD (%s)" % head in out.stderr, out.stderr
    assert os.access(os.path.join(cache, head, "outboxctl"), os.X_OK)
    assert os.listdir(os.path.join(cache, head)) == ["outboxctl"]
    again = subprocess.run(["sh", os.path.join(ROOT, "bench", "baseline.sh"), "HEAD"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == os.path.join(cache, head, "outboxctl")
    assert "from %s" % os.path.join(cache, head) in again.stderr and "building" not in again.stderr

    tables = re.findall(r"^rows per call: (\d+) \(\d+ calls per variant\)[^\n]*\n\|[^\n]*\n\|---[^\n]*\n"
                        r"((?:\|[^\n]*\n)+)", out.stdout, re.M)
    assert [b for b, _ in tables] == ["16", "128"], out.stdout
    for batch, body in tables:
        rows = {}
        for line in body.splitlines():
            m = re.match(r"\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| \*\*([\d.]+)\*\* \| ([\d.]+) "
                         r"\| (\d+) \| (\d+) / (\d+|-) / (\d+|-) \|$", line)
            assert m, line
            # Runs and attempts rows are read from workflow_runs and
            # effect_attempts where the schema has them ('-' where not).
            assert m.group(9) in (str(N), "-") and m.group(10) in (str(N), "-"), line
            rows[m.group(1)] = [float(x) for x in m.groups()[1:7]] + [int(m.group(8)), m.group(9), m.group(10)]
        assert list(rows) == ["baseline", "current", "jit"], out.stdout
        base = rows["baseline"][3]
        for name, (claim, complete, vacuum, total, ratio, wal, done, runs, attempts) in rows.items():
            assert done == N, (name, out.stdout)
            assert claim > 0 and complete > 0 and wal > 0, (name, out.stdout)
            assert abs(claim + complete + vacuum - total) < 0.2, (name, out.stdout)
            assert abs(ratio - total / base) < 0.01 + 0.01 * ratio, (name, out.stdout)
        # Same schema, same work: the JIT variant alone pays for its compiles.
        assert rows["jit"][3] > 1.5 * max(rows["baseline"][3], rows["current"][3]), out.stdout
    m = re.search(r"^ratio current/baseline: 16: ([\d.]+) 128: ([\d.]+) \(WAL 16: ([\d.]+) 128: ([\d.]+)\)$",
                  out.stdout, re.M)
    assert m, out.stdout
    # Identical schemas write identical WAL per effect, near enough.
    assert all(0.9 < float(w) < 1.1 for w in m.groups()[2:]), out.stdout


def test_bench_insert_small_inserts_as_a_producer_login(tmp_path):
    # This tree's outboxctl on both sides: the baseline's build is the test above's.
    ctl = os.path.join(BUILD_DIR, "outboxctl")
    env = bench_env(str(tmp_path / "cache"), INSERT_N="200", INSERT_ROUNDS="1", INSERT_BULK="50", INSERT_CHUNK="40",
                    INSERT_VARIANTS="baseline=%s current=%s" % (ctl, ctl))
    out = subprocess.run(["sh", os.path.join(ROOT, "bench", "insert_cost.sh")], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(tmp_path / "cache"), "nothing to build with INSERT_VARIANTS given"
    assert "as ins_producer;" in out.stdout, out.stdout
    rounds = re.findall(r"^(single|bulk) round 1: baseline ([\d.]+) µs, (\d+) B; current ([\d.]+) µs, (\d+) B "
                        r"per row \(a row without its run refused: SQLSTATE (\w+)\)$", out.stdout, re.M)
    assert [r[0] for r in rounds] == ["single", "bulk"], out.stdout
    for way, b_us, b_wal, c_us, c_wal, refused in rounds:
        assert float(b_us) > 0 and float(c_us) > 0 and int(b_wal) > 0 and int(c_wal) > 0, out.stdout
        assert refused == "42501", out.stdout
    table = re.findall(r"^\| (single|bulk, 50 rows per statement) \| (baseline|current) \| 1 x 200 "
                       r"\| ([\d.]+) \([\d.]+-[\d.]+\) \| ([\d.]+) \| (\d+) \|$", out.stdout, re.M)
    assert [(w, v) for w, v, _, _, _ in table] == [
        ("single", "baseline"), ("single", "current"),
        ("bulk, 50 rows per statement", "baseline"), ("bulk, 50 rows per statement", "current")], out.stdout
    m = re.search(r"^insert ratio current/baseline: single: ([\d.]+) bulk: ([\d.]+) "
                  r"\(the rounds': single [\d.]+; bulk [\d.]+\)$", out.stdout, re.M)
    assert m, out.stdout
    us = {(w.split(",")[0], v): float(x) for w, v, x, _, _ in table}
    assert abs(float(m.group(1)) - us[("single", "current")] / us[("single", "baseline")]) < 0.011
    assert abs(float(m.group(2)) - us[("bulk", "current")] / us[("bulk", "baseline")]) < 0.011


def test_baseline_refuses_a_ref_that_is_no_commit(tmp_path):
    out = subprocess.run(["sh", os.path.join(ROOT, "bench", "baseline.sh"), "no-such-ref-anywhere"],
                         env=dict(os.environ, OUTBOX_BASELINE_CACHE=str(tmp_path)), capture_output=True,
                         text=True, timeout=30)
    assert out.returncode != 0 and out.stdout == ""
    assert "no-such-ref-anywhere is not a commit of this repository" in out.stderr, out.stderr
    assert os.listdir(tmp_path) == []
