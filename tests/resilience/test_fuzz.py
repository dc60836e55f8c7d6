# SPDX-License-Identifier: ISC
"""The libFuzzer targets (tests/fuzz/) as part of the regular suite.

tests/fuzz/run.sh builds fuzz_config and fuzz_payload with clang
(-fsanitize=fuzzer,address,undefined) and runs each for FUZZ_SECONDS over
the seed corpus kept in tests/fuzz/corpus/.  Any crash, sanitizer report,
leak or failed oracle makes it exit non-zero and print the reproducer.
Skipped only when clang is not installed.
"""
import os
import shutil
import subprocess

import pytest

from outbox_test import ROOT

SECONDS = int(os.environ.get("FUZZ_SECONDS", "10"))


@pytest.mark.skipif(shutil.which(os.environ.get("CLANG", "clang")) is None,
                    reason="clang is not installed (apt-get install clang)")
def test_fuzz_targets_run_clean(tmp_path):
    env = dict(os.environ, FUZZ_SECONDS=str(SECONDS), FUZZ_BUILD=str(tmp_path / "fuzz"))
    # The suite's sanitizer settings are for the dispatcher's own binaries.
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        env.pop(k, None)
    r = subprocess.run(["sh", os.path.join(ROOT, "tests", "fuzz", "run.sh")], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600 + 4 * SECONDS)
    print(r.stdout)
    assert r.returncode != 2, "fuzz targets did not build:\n" + r.stdout[-4000:]
    assert r.returncode == 0, "fuzzing found a problem:\n" + r.stdout[-8000:]
    assert "fuzz: all targets clean" in r.stdout
    for target in ("fuzz_config", "fuzz_payload"):
        assert f"fuzz: {target}: clean" in r.stdout
