# SPDX-License-Identifier: ISC
"""The SQL's current shape as a reader sees it: sql/schema.sql (generated
by `make schema`) is exactly what a fresh install's schema dumps as, and
every statement of the worker's table (dispatcher/worker_sql.c) passes its
SQL function as many arguments as the function takes, with a parameter
count that matches its text."""
import difflib
import os
import re
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import ROOT, admin_dsn, dsn_for, query, run_ctl


@pytest.fixture
def fresh_db():
    """An empty database migrated by outboxctl: a fresh install (not the
    suite's template, whose roles are the tests')."""
    admin = psycopg2.connect(admin_dsn())
    admin.autocommit = True
    name = "schema_" + uuid.uuid4().hex[:12]
    query(admin, f"CREATE DATABASE {name}")
    try:
        r = run_ctl(["--db", dsn_for(name), "migrate"])
        assert r.returncode == 0, r.stderr
        yield name
    finally:
        query(admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


def test_schema_file_is_what_a_fresh_install_has(fresh_db):
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "schema_dump.py"),
                        dsn_for(fresh_db)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(ROOT, "sql", "schema.sql")) as f:
        kept = f.read()
    assert "CREATE VIEW public.outbox_effects" in r.stdout
    assert "CREATE TABLE public.effect_live" in r.stdout
    assert "outbox_claim(" in r.stdout
    diff = list(difflib.unified_diff(kept.splitlines(), r.stdout.splitlines(),
                                     "sql/schema.sql", "fresh install", lineterm="", n=1))
    assert kept == r.stdout, "sql/schema.sql is stale; run `make schema`:\n" + "\n".join(diff[:80])


def worker_statements():
    """(enum name, function or label, text, nparams) of each worker_sql[] entry."""
    with open(os.path.join(ROOT, "dispatcher", "worker_sql.c")) as f:
        src = f.read()
    table = src[src.index("worker_sql[SQL_STATEMENTS] = {"):]
    out = []
    for m in re.finditer(r'\[(SQL_\w+)\] = \{ "([^"]*)",(.*?), (\d+) \},', table, re.S):
        parts = re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(3))
        macro = None if parts else m.group(3).strip()
        out.append((m.group(1), m.group(2), "".join(parts), int(m.group(4)), macro))
    return out


def test_worker_table_is_read():
    got = worker_statements()
    names = [g[0] for g in got]
    assert {"SQL_LEASE", "SQL_CLAIM", "SQL_MARK_SENDING", "SQL_COMPLETE"} <= set(names), names
    with open(os.path.join(ROOT, "dispatcher", "worker_sql.h")) as f:
        h = f.read()
    block = h[h.index("enum worker_stmt {"):]
    enum = re.findall(r"^\s*(SQL_\w+),", block[:block.index("};")], re.M)
    assert sorted(names) == sorted(e for e in enum if e != "SQL_STATEMENTS"), (names, enum)


def test_each_worker_statement_passes_its_functions_arguments(conn):
    procs = {}
    for name, nargs, ndefaults in query(
            conn, "SELECT proname, pronargs, pronargdefaults FROM pg_proc "
                  "WHERE pronamespace = 'public'::regnamespace"):
        procs.setdefault(name, []).append((nargs, ndefaults))
    bad = []
    for enum, label, text, nparams, macro in worker_statements():
        if macro:       # a statement shared with outboxctl (migrate.h): no parameters
            if nparams != 0:
                bad.append(f"{enum}: {macro} takes no parameters, the table says {nparams}")
            continue
        used = sorted({int(n) for n in re.findall(r"\$(\d+)", text)})
        if used != list(range(1, nparams + 1)):
            bad.append(f"{enum}: the text uses ${used}, the table says {nparams} parameters")
        call = re.search(rf"\b{re.escape(label)}\(([^)]*)\)", text)
        if label not in procs:
            # Not a function of ours ("gauges", "schema version"): plain SQL.
            if call or label.startswith("outbox_"):
                bad.append(f"{enum}: no function {label} in a fresh install")
            continue
        if call is None:
            bad.append(f"{enum}: the text does not call {label}()")
            continue
        passed = len([a for a in call.group(1).split(",") if a.strip()])
        if not any(n - d <= passed <= n for n, d in procs[label]):
            bad.append(f"{enum}: {label}() takes {procs[label]} (arguments, defaults), "
                       f"the statement passes {passed}")
        if passed != nparams:
            bad.append(f"{enum}: passes {passed} arguments to {label}() but declares {nparams}")
    assert bad == [], "\n".join(bad)
