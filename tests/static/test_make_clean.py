# SPDX-License-Identifier: ISC
"""`make clean` removes the default tree (build), the test tree
(build-asan) and any other build-* tree, and BUILD when it names one
elsewhere (`make BUILD=out/x clean`); it refuses a BUILD that would remove
the source tree or more, and it creates nothing (the version header is
written only by the goals that build).  Run on a copy of the Makefile in a
scratch directory, so the real build trees are left alone."""
import os
import shutil
import subprocess

from outbox_test import ROOT


def scratch(tmp_path, dirs):
    shutil.copy(f"{ROOT}/Makefile", tmp_path / "Makefile")
    (tmp_path / "debian").mkdir()
    shutil.copy(f"{ROOT}/debian/changelog", tmp_path / "debian" / "changelog")
    (tmp_path / "keep").mkdir()
    for d in dirs:
        (tmp_path / d / "obj").mkdir(parents=True)
    return tmp_path


def make_clean(tree, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(["make", "-s", *args, "clean"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60)


def left(tree):
    return sorted(p for p in os.listdir(tree) if p not in ("Makefile", "debian"))


def test_default_removes_build_and_build_asan(tmp_path):
    tree = scratch(tmp_path, ["build", "build-asan"])
    r = make_clean(tree)
    assert r.returncode == 0, r.stderr
    assert left(tree) == ["keep"]


def test_custom_build_is_removed(tmp_path):
    tree = scratch(tmp_path, ["build", "build-asan", "build-x", "out/x", "out/y"])
    r = make_clean(tree, "BUILD=build-x")
    assert r.returncode == 0, r.stderr
    assert left(tree) == ["keep", "out"]
    r = make_clean(tree, "BUILD=out/x")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tree / "out")) == ["y"]


def test_clean_creates_nothing(tmp_path):
    tree = scratch(tmp_path, [])
    r = make_clean(tree, "BUILD=elsewhere")
    assert r.returncode == 0, r.stderr
    assert left(tree) == ["keep"]


def test_refuses_a_build_that_is_the_tree_or_above(tmp_path):
    tree = scratch(tmp_path, ["build"])
    for bad in ("", ".", "./", "..", "../", "/"):
        r = make_clean(tree, f"BUILD={bad}")
        assert r.returncode != 0, bad
        assert "refusing" in r.stderr, (bad, r.stderr)
    assert left(tree) == ["build", "keep"]
    assert not os.path.exists(tmp_path.parent / "gen")
