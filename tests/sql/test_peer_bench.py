# SPDX-License-Identifier: ISC
"""bench/peer (make bench-peer) at a small scale: graphile-worker installs
from the pinned lockfile (from the cache when warm; an install that did not
finish is never reused), both sides deliver every item exactly once on
both fsync settings, and the table carries what docs/performance.md quotes:
throughput and PostgreSQL CPU per item of each side and their ratios.  No
skip: without npm or the registry the install fails, and so does this."""
import hashlib
import json
import os
import re
import subprocess

from outbox_test import BUILD_DIR

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PEER = os.path.join(ROOT, "bench", "peer")
N = 300


def lock_hash():
    h = hashlib.sha256()
    for name in ("package.json", "package-lock.json"):
        with open(os.path.join(PEER, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def test_an_unfinished_install_is_never_reused(tmp_path):
    # A folder named for the lockfile but without the mark of a finished
    # install, and an npm that cannot install: install.sh must try npm (and
    # fail), not hand out the folder.
    cache = tmp_path / "cache"
    stale = cache / ("graphile-%s" % lock_hash())
    (stale / "node_modules" / "graphile-worker").mkdir(parents=True)
    (cache / ("graphile-%s.partial.1" % lock_hash())).mkdir()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "npm").write_text("#!/bin/sh\necho 'npm: registry unreachable' >&2\nexit 1\n")
    (fake / "npm").chmod(0o755)
    env = dict(os.environ, PEER_CACHE=str(cache), PATH="%s:%s" % (fake, os.environ["PATH"]))
    out = subprocess.run(["sh", os.path.join(PEER, "install.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "npm ci failed" in out.stderr and "registry unreachable" in out.stderr, out.stderr
    assert out.stdout == ""
    assert not (cache / ("graphile-%s.partial.1" % lock_hash())).exists()


def test_bench_peer_small_delivers_exactly_once_and_prints_the_ratios(tmp_path):
    # Warm the cache (a cold machine installs here, or fails loudly).
    inst = subprocess.run(["sh", os.path.join(PEER, "install.sh")], capture_output=True, text=True,
                          timeout=600)
    assert inst.returncode == 0, inst.stderr
    assert os.path.isfile(os.path.join(inst.stdout.strip(), "graphile-worker", "package.json"))
    results = tmp_path / "peer.json"
    env = dict(os.environ, BUILD_DIR=BUILD_DIR, PEER_N=str(N), PEER_ROUNDS="1", PEER_WARMUP="0",
               PEER_FSYNC="off on", PEER_RESULTS=str(results))
    out = subprocess.run(["sh", os.path.join(PEER, "peer.sh")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "graphile-worker from the cache" in out.stderr, out.stderr
    assert "npm ci" not in out.stderr

    ratios = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (off|on) \| (all|producer|none|scoped) \| 1 \| (\d+) \| (\d+) \| ([\d.]+) "
                     r"\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| [\d. ]+ \|$", line)
        if m:
            ratios[m.group(1), m.group(2)] = [float(x) for x in m.groups()[2:]]
    # Every statistics case and the scoped one, under each fsync setting.
    assert set(ratios) == {(f, c) for f in ("off", "on")
                           for c in ("all", "producer", "none", "scoped")}, out.stdout
    assert re.search(r"^worst round: fsync (off|on), statistics (all|producer|none|scoped): "
                     r"throughput [\d.]+x graphile's at [\d.]+x", out.stdout, re.M), out.stdout
    for d_rate, g_rate, rate_ratio, d_cpu, g_cpu, cpu_ratio in ratios.values():
        assert d_rate > 0 and g_rate > 0 and d_cpu > 0 and g_cpu > 0, out.stdout
        assert abs(rate_ratio - d_rate / g_rate) < 0.02 * rate_ratio + 0.01, out.stdout
        assert abs(cpu_ratio - d_cpu / g_cpu) < 0.02 * cpu_ratio + 0.01, out.stdout
    once = re.findall(r"^\| ((?:off|on) (?:all|producer|none|scoped)) \| (dispatcher|graphile) \| \d+ "
                      r"\| [\d.]+ \| [\d.]+ \| \d+ \| (\d+) \| (\d+)/(\d+) \|$", out.stdout, re.M)
    assert sorted((s, side, got, want) for s, side, _, got, want in once) == sorted(
        ("%s %s" % (s, c), side, str(N), str(N)) for s in ("off", "on")
        for c in ("all", "producer", "none", "scoped") for side in ("dispatcher", "graphile")), out.stdout
    assert len({body for _, _, body, _, _ in once}) == 1, "bodies differ between the sides: " + out.stdout

    # The figures behind the table: the server really ran each setting.
    res = json.loads(results.read_text())
    assert res["settings"]["off"]["server"]["fsync"] == "off"
    assert res["settings"]["on"]["server"]["fsync"] == "on"
    assert res["settings"]["on"]["server"]["synchronous_commit"] == "on"
    for s in res["settings"].values():
        assert [p["case"] for p in s["rounds"]] == ["all", "producer", "none", "scoped"]
        for p in s["rounds"]:
            for side in ("dispatcher", "graphile"):
                assert p[side]["n"] == N and p[side]["requests"] == N


class FakeSink:
    def __init__(self, lines):
        self.lines = lines

    def lines_since_mark(self):
        return self.lines


def test_the_exactly_once_check_fails_on_a_duplicate_a_loss_or_an_error(tmp_path, monkeypatch, capsys):
    import importlib.util
    import pytest
    monkeypatch.setenv("BENCH_WORK", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location("peer", os.path.join(PEER, "peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    want = {"k1", "k2", "k3"}
    good = ["1.0 k1 186 200", "1.1 k2 186 200", "1.2 k3 186 200"]
    assert peer.check_sink(FakeSink(good), "t", want)[0::2] == (186, 3)
    for bad, says in ((good + ["1.3 k2 186 200"], "1 keys twice"),
                      (good[:2], "1 missing"),
                      (good[:2] + ["1.2 k3 186 500"], "answered 500"),
                      (good[:2] + ["1.2 k3 190 200"], "different lengths")):
        with pytest.raises(SystemExit):
            peer.check_sink(FakeSink(bad), "t", want)
        assert says in capsys.readouterr().err
