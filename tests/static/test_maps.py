# SPDX-License-Identifier: ISC
"""The maps a reader starts from stay true: every source file of the daemon,
of outboxctl and of the library they share (the Makefile's DAEMON_SRC,
CTL_SRC and LIB_SRC: dispatcher/, outboxctl/, lib/) has a row in the Layout
tables of docs/architecture.md, every file of the worker (a daemon file that
includes worker_internal.h) is in worker_internal.h's list of the worker's
files, and neither map names a file that is not built."""
import glob
import os
import re

from outbox_test import ROOT


def makefile_sources(var):
    """The files of one of the Makefile's source lists (continuation lines
    joined; a $(wildcard ...) expanded the way make would)."""
    with open(f"{ROOT}/Makefile") as fh:
        text = fh.read().replace("\\\n", " ")
    m = re.search(rf"^{var}\s*:=(.*)$", text, re.M)
    assert m, f"no {var} in the Makefile"
    value = m.group(1)
    wild = re.search(r"\$\(wildcard ([^)]+)\)", value)
    if wild:
        return sorted(os.path.relpath(p, ROOT)
                      for p in glob.glob(f"{ROOT}/{wild.group(1)}"))
    return value.split()


MAPPED = ("dispatcher/", "outboxctl/", "lib/")


def mapped_c(files):
    """The .c files of the mapped folders: the worker's, outboxctl's, lib/'s."""
    return {f for f in files if f.startswith(MAPPED) and f.endswith(".c")}


LAYOUT_DOC = "docs/architecture.md"


def layout_paths():
    """Paths named in the first column of the tables of the Layout section
    of docs/architecture.md (its subsections, one per program or library,
    included); a bare name after a path is in that path's folder
    (`lib/config.c`, `config_read.c`)."""
    with open(f"{ROOT}/{LAYOUT_DOC}") as fh:
        doc = fh.read()
    m = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", doc, re.M | re.S)
    assert m, f"no Layout section in {LAYOUT_DOC}"
    paths = set()
    for line in m.group(1).splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                folder = os.path.dirname(name)
                paths.add(name)
            else:
                paths.add(f"{folder}/{name}" if folder else name)
    return paths


def worker_list():
    """The file names in worker_internal.h's opening comment: one per line,
    `name.c` (or .h) followed by what it owns."""
    with open(f"{ROOT}/dispatcher/worker_internal.h") as fh:
        head = fh.read().split("*/", 2)[1]
    return {f"dispatcher/{n}" for n in re.findall(r"^ \*   (\w+\.[ch]) ", head, re.M)}


def includes_worker_internal(path):
    with open(f"{ROOT}/{path}") as fh:
        return '#include "worker_internal.h"' in fh.read()


def test_makefile_lists_are_read():
    daemon = makefile_sources("DAEMON_SRC")
    assert "dispatcher/worker.c" in daemon and "dispatcher/wire.c" in daemon, daemon
    assert "lib/util.c" in makefile_sources("LIB_SRC")
    assert "outboxctl/outboxctl.c" in makefile_sources("CTL_SRC")
    # One folder per program: the worker's list holds no file of the others.
    assert not any(f.startswith(("dispatcher/outboxctl", "dispatcher/util")) for f in daemon), daemon


def test_every_daemon_and_outboxctl_file_is_in_the_layout():
    built = mapped_c(makefile_sources("DAEMON_SRC") + makefile_sources("LIB_SRC")
                     + makefile_sources("CTL_SRC"))
    layout = layout_paths()
    missing = sorted(built - layout)
    assert missing == [], f"not in {LAYOUT_DOC}'s Layout: " + ", ".join(missing)
    stale = sorted(p for p in mapped_c(layout) if p not in built)
    assert stale == [], f"{LAYOUT_DOC}'s Layout names files that are not built: " + ", ".join(stale)


def test_every_worker_file_is_in_worker_internal_h_list():
    daemon = mapped_c(makefile_sources("DAEMON_SRC"))
    worker_files = {f for f in daemon if includes_worker_internal(f)}
    assert {"dispatcher/worker.c", "dispatcher/lease.c"} <= worker_files, worker_files
    listed = worker_list()
    missing = sorted(worker_files - listed)
    assert missing == [], "not in worker_internal.h's list: " + ", ".join(missing)
    stale = sorted(p for p in mapped_c(listed) if p not in daemon)
    assert stale == [], "worker_internal.h lists files that are not built: " + ", ".join(stale)


PROGRAMS = ("dispatcher", "outboxctl", "console")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def include_owner(folder, name):
    """The folder a quoted include of a file in folder resolves to, the way
    the compiler searches: the file's own folder, then -Ilib, -Iproviders;
    version.h is generated into the build tree."""
    for d in (folder, "lib", "providers"):
        if os.path.exists(f"{ROOT}/{d}/{name}"):
            return os.path.dirname(f"{d}/{name}")
    return "build" if name == "version.h" else None


def test_a_program_includes_its_own_headers_and_lib_only():
    """One folder per program: a program's files include their own folder's
    headers, lib/'s and provider.h (the plugin interface), never another
    program's or the plugins' helpers (providers/lib/); lib/ includes only
    lib/ and provider.h, so that every program can link it."""
    allowed = {p: {p, "lib", "providers", "build"} for p in PROGRAMS}
    allowed["lib"] = {"lib", "providers"}
    seen, wrong = 0, []
    for folder, ok in allowed.items():
        for path in sorted(glob.glob(f"{ROOT}/{folder}/*.[ch]")):
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            for name in INCLUDE.findall(text):
                seen += 1
                owner = include_owner(folder, name)
                rel = os.path.relpath(path, ROOT)
                if owner is None:
                    wrong.append(f"{rel}: {name} (not found)")
                elif owner not in ok or (owner == "providers" and name != "provider.h"):
                    wrong.append(f"{rel}: {name} ({owner}/)")
    assert seen > 150, seen          # the scan read the tree's includes
    assert wrong == [], "includes across folders:\n" + "\n".join(wrong)


def test_the_scan_of_includes_sees_a_crossing():
    assert include_owner("outboxctl", "worker.h") is None
    assert include_owner("dispatcher", "outboxctl.h") is None
    assert include_owner("outboxctl", "lib/netrules.h") == "providers/lib"
    assert include_owner("dispatcher", "util.h") == "lib"
    assert include_owner("lib", "provider.h") == "providers"
