# SPDX-License-Identifier: ISC
"""Docs that cite and docs that are cited agree: every citation of a
section of a document in the repository's code, SQL, tests and docs (a
path to a .md file, or a markdown link to one, then the section's title
in double quotes, across comment line breaks) names a heading that exists
in that document, and nothing refers to work sessions or issue numbers, which a
reader of the project does not have.  Test fixtures (copies of old schemas)
are exempt: they are the past as it was written."""
import os
import re
import subprocess

from outbox_test import ROOT

EXEMPT_PREFIXES = ("tests/fixtures/", "tests/fuzz/corpus/")
TEXT_SUFFIXES = (".c", ".h", ".sql", ".sh", ".py", ".md", ".example", ".ini", ".service",
                 ".target", ".8")

# A path to a markdown file, an optional link target, an optional comma,
# then the quoted section title.
CITATION = re.compile(r'((?:[\w./-]*/)?[\w-]+\.md)(?:\]\([^)]*\))?,?\s"([^"]+)"')
# A comment line break inside a citation: newline, indent, comment leader.
COMMENT_BREAK = re.compile(r"\n[ \t]*(?:--|//|\*|#|;)?[ \t]*")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [f for f in out if f and not f.startswith(EXEMPT_PREFIXES)
            and (f.endswith(TEXT_SUFFIXES) or f in ("Makefile", ".ci/run"))]


def headings(path):
    with open(path, encoding="utf-8") as fh:
        return {re.sub(r"^#+\s*", "", line).strip().replace("`", "")
                for line in fh if line.startswith("#")}


def resolve(citing, cited):
    """The cited document's path: as written from the root, or relative to
    the citing file's folder (docs/scaling.md citing performance.md)."""
    for base in ("", os.path.dirname(citing)):
        path = os.path.normpath(os.path.join(ROOT, base, cited))
        if os.path.isfile(path):
            return path
    return None


def names_heading(title, heads):
    """A heading is named by its whole title or by the part before its colon
    ("Asking the provider" for "Asking the provider: reconciliation ...")."""
    title = title.replace("`", "")
    return title in heads or any(h.split(":")[0] == title for h in heads)


def citations():
    found = []
    for f in tracked_text_files():
        with open(f"{ROOT}/{f}", encoding="utf-8", errors="replace") as fh:
            text = COMMENT_BREAK.sub(" ", fh.read())
        for m in CITATION.finditer(text):
            found.append((f, m.group(1), m.group(2)))
    return found


def test_every_cited_section_exists():
    found = citations()
    cited_files = {c for _, c, _ in found}
    assert "docs/performance.md" in cited_files and "docs/design.md" in cited_files, found
    bad = []
    for f, cited, title in found:
        path = resolve(f, cited)
        if path is None:
            bad.append(f"{f}: {cited} does not exist")
        elif not names_heading(title, headings(path)):
            bad.append(f'{f}: {cited} has no section "{title}"')
    assert bad == [], "\n".join(bad)


def test_nothing_refers_to_work_sessions_or_issue_numbers():
    out = subprocess.run(["git", "grep", "-nIiE", "session [0-9]|issue [0-9]"], cwd=ROOT,
                         capture_output=True, text=True).stdout.splitlines()
    hits = [line for line in out if not line.startswith(EXEMPT_PREFIXES)]
    assert hits == [], "\n".join(hits)
