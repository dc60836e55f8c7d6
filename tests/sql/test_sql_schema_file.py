# SPDX-License-Identifier: ISC
"""The SQL's current shape as a reader sees it: sql/schema.sql (generated
by `make schema`) is exactly what a fresh install's schema dumps as, on any
day (the monthly history partitions are written once, as a template, and
checked apart), laid out for reading (tables with their explanations, then
views, functions, grants), and every statement of the worker's table (dispatcher/worker_sql.c) passes its
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


def schema_dump(db):
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "schema_dump.py"),
                        dsn_for(db)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


def kept_schema():
    with open(os.path.join(ROOT, "sql", "schema.sql")) as f:
        return f.read()


def test_schema_file_is_what_a_fresh_install_has(fresh_db):
    r = schema_dump(fresh_db)
    kept = kept_schema()
    assert "CREATE VIEW public.outbox_effects" in r.stdout
    assert "CREATE TABLE public.effect_live" in r.stdout
    assert "outbox_claim(" in r.stdout
    diff = list(difflib.unified_diff(kept.splitlines(), r.stdout.splitlines(),
                                     "sql/schema.sql", "fresh install", lineterm="", n=1))
    assert kept == r.stdout, "sql/schema.sql is stale; run `make schema`:\n" + "\n".join(diff[:80])


def test_schema_file_does_not_depend_on_the_month(fresh_db):
    """A database whose history has other months' partitions (one made in
    another month, or years of them) dumps as the same file: the months
    are not in it."""
    c = psycopg2.connect(dsn_for(fresh_db))
    c.autocommit = True
    try:
        made = query(c, "SELECT outbox_history_partitions('2031-11-15 12:00+00', '2032-03-02 00:00+00')")
        assert made[0][0] == 5, made
        got = schema_dump(fresh_db).stdout
    finally:
        c.close()
    assert not re.search(r"effect_history_\d{6}", got), "a month's partition is in the dump"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", got), "a date is in the dump"
    assert got.count("CREATE TABLE public.effect_history_YYYYMM (") == 1
    assert got == kept_schema(), "a database with other months dumps differently"


def test_a_fresh_install_has_this_month_and_the_next_three(fresh_db):
    """What the schema file leaves out is checked here: the monthly
    partitions a fresh install made are the months from the one migrate
    ran in up to three months later (UTC), each bounded by its month, with
    the same columns, indexes and owner as the history's default partition."""
    c = psycopg2.connect(dsn_for(fresh_db))
    try:
        query(c, "SET TIME ZONE 'UTC'")
        expected = [m for (m,) in query(c, """
            SELECT to_char(m AT TIME ZONE 'UTC', 'YYYYMM')
              FROM schema_migrations s,
                   generate_series(date_trunc('month', s.applied_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC',
                                   s.applied_at + interval '3 months', interval '1 month') m
             WHERE s.version = 105 AND m < s.applied_at + interval '3 months' ORDER BY 1""")]
        parts = query(c, """
            SELECT c.relname, pg_get_expr(c.relpartbound, c.oid),
                   (SELECT count(*) FROM pg_index i WHERE i.indrelid = c.oid),
                   (SELECT count(*) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0
                                                         AND NOT a.attisdropped),
                   c.relowner = p.relowner
              FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
              JOIN pg_class p ON p.oid = h.inhparent
             WHERE h.inhparent = 'effect_history'::regclass ORDER BY 1""")
    finally:
        c.close()
    assert len(expected) in (3, 4), expected
    by_name = {p[0]: p[1:] for p in parts}
    default = by_name.pop("effect_history_default")
    assert default[0] == "DEFAULT"
    assert sorted(by_name) == [f"effect_history_{m}" for m in expected], (sorted(by_name), expected)
    for name, (bound, nindex, ncols, same_owner) in by_name.items():
        y, m = int(name[-6:-2]), int(name[-2:])
        ny, nm = (y + 1, 1) if m == 12 else (y, m + 1)
        assert re.fullmatch(rf"FOR VALUES FROM \('{y:04d}-{m:02d}-01 00:00:00\+00'\) "
                            rf"TO \('{ny:04d}-{nm:02d}-01 00:00:00\+00'\)", bound), (name, bound)
        assert (nindex, ncols, same_owner) == default[1:], (name, nindex, ncols, default)


def test_the_schema_file_reads_tables_first_with_their_explanations():
    """Tables (each with its COMMENT ON), then views, then functions, then
    grants; every table and view of a fresh install is explained."""
    kept = kept_schema()
    first = {what: kept.index(marker) for what, marker in (
        ("table", "CREATE TABLE public."), ("view", "CREATE VIEW public."),
        ("function", "CREATE FUNCTION public."), ("grant", "\nGRANT "))}
    assert first["table"] < first["view"] < first["function"] < first["grant"], first
    assert kept.rindex("CREATE TABLE public.") < first["view"]
    assert kept.rindex("CREATE FUNCTION public.") < first["grant"]
    assert kept.index("CREATE TABLE public.effect_outbox (") < kept.index("CREATE TABLE public.approvals (")
    for table in re.findall(r"^CREATE TABLE public\.(\w+) ", kept, re.M):
        if table == "effect_history_YYYYMM":
            continue
        at = kept.index(f"COMMENT ON TABLE public.{table} IS"), kept.index(f"CREATE TABLE public.{table} (")
        assert at[1] < at[0] < first["view"], table
    for view in re.findall(r"^CREATE VIEW public\.(\w+) ", kept, re.M):
        assert f"COMMENT ON VIEW public.{view} IS" in kept, view


def test_every_table_and_view_has_a_comment(conn):
    """The explanations are in the database (\\d+, pg_dump), not only in
    the migrations' comments: a table or view without one is named here."""
    missing = query(conn, """
        SELECT c.relname FROM pg_class c
         WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
           AND NOT c.relispartition AND obj_description(c.oid, 'pg_class') IS NULL
         ORDER BY 1""")
    assert missing == [], f"no COMMENT ON (sql/functions/90_comments.sql): {missing}"


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
