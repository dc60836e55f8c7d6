# SPDX-License-Identifier: ISC
"""The licence: LICENSE is ISC, debian/copyright says so in DEP-5 form, and
every source file the project wrote (C, SQL, shell, Python, the Makefile and
the Debian maintainer scripts) names it in an SPDX line among its first
lines.  Test fixtures (copies of old schemas, fuzz corpora) are exempt."""
import subprocess

from outbox_test import ROOT

EXEMPT_PREFIXES = ("tests/fixtures/", "tests/fuzz/corpus/")
SOURCE_SUFFIXES = (".c", ".h", ".sql", ".sh", ".py")
SOURCE_NAMES = {".ci/run", "Makefile", "debian/postinst", "debian/postrm",
                "debian/prerm", "debian/rules"}
SPDX = "SPDX-License-Identifier: ISC"


def source_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [f for f in out if f and not f.startswith(EXEMPT_PREFIXES)
            and (f.endswith(SOURCE_SUFFIXES) or f in SOURCE_NAMES)]


def test_every_source_file_names_the_licence():
    files = source_files()
    assert len(files) > 150, files          # the listing found the tree
    missing = []
    for f in files:
        with open(f"{ROOT}/{f}", encoding="utf-8", errors="replace") as fh:
            head = [fh.readline() for _ in range(3)]
        if not any(SPDX in line for line in head):
            missing.append(f)
    assert missing == [], "no SPDX line in the first 3 lines: " + ", ".join(missing)


def test_licence_file_and_debian_copyright_say_isc():
    with open(f"{ROOT}/LICENSE") as fh:
        lic = fh.read()
    assert lic.startswith("Copyright (c) 2026 the outbox-dispatcher authors\n"), lic[:80]
    assert "Permission to use, copy, modify, and distribute this software" in lic
    with open(f"{ROOT}/debian/copyright") as fh:
        cp = fh.read()
    assert cp.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
    assert "\nFiles: *\n" in cp and "\nLicense: ISC\n" in cp, cp
    assert "proprietary" not in cp and "All rights reserved" not in cp


def test_migration_checksums_do_not_depend_on_the_licence_line():
    """gen_migrations.sh leaves the SPDX line out of the embedded SQL, so a
    database migrated before the line was added still matches."""
    r = subprocess.run(["sh", "lib/gen_migrations.sh", "sql/100_baseline.sql"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    assert "SPDX" not in r.stdout
    assert '"-- 100_baseline.sql: the tables' in r.stdout.split("static const char sql_0[] = \n", 1)[1][:60]
