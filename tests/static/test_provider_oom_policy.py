# SPDX-License-Identifier: ISC
"""One out-of-memory policy in the providers: every allocation goes
through providers/lib/text.c (text_alloc, text_array, text_realloc,
text_strdup, text_strndup: abort, never NULL), so no provider has an
out-of-memory path of its own to get wrong.  providers/email/ keeps its
own for now and is not checked here."""
import glob
import os
import re

from outbox_test import ROOT

RAW = re.compile(r"(?<![\w.>])(malloc|calloc|realloc|strdup|strndup)\s*\(")
EXEMPT = ("providers/lib/text.c",)


def test_no_raw_allocation_in_providers():
    files = [os.path.relpath(f, ROOT) for f in glob.glob(f"{ROOT}/providers/**/*.c", recursive=True)]
    checked = [f for f in files if not f.startswith("providers/email/") and f not in EXEMPT]
    assert len(checked) > 15, checked       # the glob found the tree
    raw = []
    for f in checked:
        for n, line in enumerate(open(f"{ROOT}/{f}", encoding="utf-8"), 1):
            code = line.split("//")[0]
            if RAW.search(code) and not code.lstrip().startswith(("*", "/*")):
                raw.append(f"{f}:{n}: {line.strip()}")
    assert raw == [], "raw allocations (use lib/text.h):\n" + "\n".join(raw)
