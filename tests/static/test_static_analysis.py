# SPDX-License-Identifier: ISC
"""cppcheck stays clean (the same command as `make cppcheck`)."""
import shutil
import subprocess

import pytest

from outbox_test import ROOT


@pytest.mark.skipif(shutil.which("cppcheck") is None, reason="cppcheck is not installed")
def test_cppcheck_is_clean():
    r = subprocess.run(["make", "-s", "cppcheck"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
