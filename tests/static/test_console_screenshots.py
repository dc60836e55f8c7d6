# SPDX-License-Identifier: ISC
"""docs/console/*.png are of the pages as they are drawn now:
docs/console/SCREENSHOTS records the SHA-256 of the sources that draw the
pages and of the screenshots, and scripts/console-screenshots.sh writes it
right after taking them.  A page's source changed (or a screenshot
replaced) without the script run fails here."""
import os
import subprocess

from outbox_test import ROOT


def test_screenshots_are_of_the_current_pages():
    out = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "console_shots_record.py")],
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(ROOT, "docs", "console", "SCREENSHOTS")) as f:
        recorded = f.read()
    assert recorded == out, ("the console's pages changed since docs/console/*.png were taken: "
                             "run scripts/console-screenshots.sh and commit the screenshots "
                             "with docs/console/SCREENSHOTS")
