# SPDX-License-Identifier: ISC
"""lib/term_table.h (the code points terminal output escapes) is
what scripts/gen_term_table.py makes of the Unicode data Debian ships
(unicode-data): regenerated, it is the same, byte for byte."""
import os
import subprocess

from outbox_test import ROOT


def test_term_table_is_generated_from_the_unicode_data():
    assert os.path.exists("/usr/share/unicode/UnicodeData.txt"), \
        "install Debian's unicode-data (scripts/install-deps.sh)"
    out = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts/gen_term_table.py")],
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(ROOT, "lib/term_table.h"), encoding="utf-8") as f:
        assert f.read() == out, "run scripts/gen_term_table.py > lib/term_table.h"
