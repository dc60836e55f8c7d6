#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""The record docs/console/SCREENSHOTS keeps: the SHA-256 of every source
that draws the console's pages (console/*.c but main.c, which draws none:
it serves them) and of every screenshot in docs/console/.  Written by
scripts/console-screenshots.sh right after it regenerates the
screenshots; tests/static/test_console_screenshots.py recomputes it, so a
change to a page's template without new screenshots fails there."""
import glob
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record():
    paths = sorted(p for p in glob.glob(os.path.join(ROOT, "console", "*.c"))
                   if os.path.basename(p) != "main.c")
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "console", "*.png")))
    lines = ["# the page sources and the screenshots taken of them: scripts/console-screenshots.sh"]
    for p in paths:
        with open(p, "rb") as f:
            lines.append(f"{hashlib.sha256(f.read()).hexdigest()}  {os.path.relpath(p, ROOT)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(record())
