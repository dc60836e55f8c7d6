# SPDX-License-Identifier: ISC
"""One out-of-memory policy in the whole tree: every allocation in lib/,
the programs (dispatcher/, outboxctl/, console/) and the providers goes
through lib/text.c (text_alloc, text_array, text_realloc, text_strdup,
text_strndup, and the growing string: abort, never NULL), so no caller
has an out-of-memory path of its own to get wrong, nor a second family
with another behaviour.  Every .c and .h there is read as C: comments,
string and character
literals are blanked first, so prose ("malloc'd") and messages do not
count, while a call split over lines, a call through parentheses
`(malloc)(n)` or a function pointer `= strdup` does.  A library's own
allocations (libesmtp, jansson, libcurl, OpenSSL) are not calls of these
names and are not ours."""
import glob
import os
import re

from outbox_test import ROOT

RAW_NAMES = ("malloc", "calloc", "realloc", "reallocarray", "strdup", "strndup",
             "asprintf", "vasprintf", "aligned_alloc", "posix_memalign")
# The name as an identifier of its own, not a member (b.malloc, o->strdup)
# and not part of a longer name (text_strdup, json_malloc_fn).
RAW = re.compile(r"(?<![\w.])(?<!->)\b(" + "|".join(RAW_NAMES) + r")\b")
# The allocator itself: the one place the C library's calls are made.
EXEMPT = ("lib/text.c",)
DIRS = ("lib", "dispatcher", "outboxctl", "console", "providers")
LITERAL_OR_COMMENT = re.compile(
    r"""//[^\n]*                      # line comment
      | /\*.*?\*/                     # block comment
      | "(?:\\.|[^"\\\n])*"           # string literal
      | '(?:\\.|[^'\\\n])*'           # character literal
      | ^[ \t]*\#[ \t]*include[^\n]*  # an include names a header, not a call
    """, re.S | re.M | re.X)


def code_only(text):
    """text with every comment, literal and include blanked to spaces,
    newlines kept, so that line numbers stay true."""
    return LITERAL_OR_COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def raw_allocations(text):
    """(line, name) of each raw allocation in the C source text."""
    code = code_only(text)
    return [(code.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in RAW.finditer(code)]


def tree_sources():
    files = [f for d in DIRS for f in glob.glob(f"{ROOT}/{d}/**/*.[ch]", recursive=True)]
    return sorted(os.path.relpath(f, ROOT) for f in files)


def test_the_scan_sees_code_and_not_prose():
    """The scanner itself: what it must find and what it must not, so that
    the tree test below cannot pass by blanking too much."""
    found = raw_allocations(
        "p = malloc(n);\n"
        "q = calloc (1,\n n);\n"
        "r = (realloc)(p, 2);\n"
        "char *(*dup)(const char *) = strdup;\n"
        "s = strndup\n(t, 3);\n"
        "if (asprintf(&u, \"%d\", 1) < 0) {}\n")
    assert found == [(1, "malloc"), (2, "calloc"), (4, "realloc"), (5, "strdup"),
                     (6, "strndup"), (8, "asprintf")]
    assert raw_allocations(
        "/* malloc'd, freed by the caller; calloc(1, n) would zero */\n"
        "// strdup(s) here would lose the policy\n"
        "log(\"realloc( failed\"); c = '\\''; d = \"\\\"strdup(\";\n"
        "#include <malloc.h>\n"
        "x = text_strdup(s); y = b.malloc; z = o->strdup(s); my_calloc(1);\n"
        "/* a comment\n   over lines: malloc(n) */\n") == []


def test_no_raw_allocation_in_the_tree():
    files = tree_sources()
    assert set(EXEMPT) <= set(files), "an exemption names no file"
    checked = [f for f in files if f not in EXEMPT]
    # The glob found every folder, the email provider and the headers included.
    assert len(checked) > 80, checked
    assert {"providers/email/message.c", "providers/email/session.c",
            "providers/email/pool.c", "providers/lib/url.h", "lib/util.c",
            "lib/config_read.c", "dispatcher/effect.c", "outboxctl/outboxctl.c",
            "console/main.c"} <= set(checked)
    raw = []
    for f in checked:
        with open(f"{ROOT}/{f}", encoding="utf-8") as fh:
            text = fh.read()
        lines = text.splitlines()
        for n, name in raw_allocations(text):
            raw.append(f"{f}:{n}: {name}: {lines[n - 1].strip()}")
    assert raw == [], "raw allocations (use lib/text.h):\n" + "\n".join(raw)
