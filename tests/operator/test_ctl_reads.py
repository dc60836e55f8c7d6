# SPDX-License-Identifier: ISC
"""outboxctl reads through the functions of sql/functions/45_reads.sql and
knows no table: its statements are a named table (outboxctl/outboxctl_sql.c)
whose calls pass each function as many arguments as it takes; its columns
are read by name, never by a bare number; `unknown show` tells an effect's
history; `status` counts the finished effects of a window, not the whole
history; outbox_viewer may call the reads and nothing else."""
import json
import os
import re

import psycopg2
import pytest

from effect_arrange import arrange
from outbox_test import ROOT, ctl, fails, make_run, enqueue, ok, query

CTL_FILES = sorted(f for f in os.listdir(os.path.join(ROOT, "outboxctl"))
                   if f.startswith("outboxctl") and f.endswith(".c"))
TABLES = ("effect_live", "effect_history", "effect_outbox", "effect_calls", "outbox_control",
          "outbox_scopes", "outbox_scope_status", "outbox_effects", "effect_attempts",
          "workflow_runs", "operator_actions", "outbox_providers", "pg_inherits", "approvals")


def read(name):
    with open(os.path.join(ROOT, "outboxctl", name)) as f:
        return f.read()


def code_strings(src):
    """The C string literals of a source, comments left out."""
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.findall(r'"((?:[^"\\]|\\.)*)"', src)


def ctl_statements():
    """(enum, function, text, nparams) of each ctl_sql[] entry."""
    src = read("outboxctl_sql.c")
    macros = dict(re.findall(r'#define (\w+)\((?:col)\) (.*)', src))
    table = src[src.index("ctl_sql[CTL_SQL_STATEMENTS] = {"):]
    out = []
    for m in re.finditer(r'\[(CTL_SQL_\w+)\] = \{ "([^"]*)",(.*?), (\d+) \},', table, re.S):
        body = m.group(3)
        # The time and in-flight macros expand to text without parameters.
        body = re.sub(r'\b(UTC|UTC_MS)\("[^"]*"\)', '"t"', body)
        body = body.replace("IN_FLIGHT_COLUMNS", '"cols"')
        out.append((m.group(1), m.group(2), "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', body)),
                    int(m.group(4))))
    assert macros, "the time macros are where this test expects them"
    return out


def test_ctl_statement_table_matches_its_names():
    got = ctl_statements()
    h = read("outboxctl_sql.h")
    block = h[h.index("enum ctl_stmt {"):]
    enum = re.findall(r"^\s*(CTL_SQL_\w+),", block[:block.index("};")], re.M)
    assert sorted(g[0] for g in got) == sorted(e for e in enum if e != "CTL_SQL_STATEMENTS")
    assert len(got) >= 20


def test_each_ctl_statement_passes_its_functions_arguments(conn):
    procs = {}
    for name, nargs, ndefaults in query(
            conn, "SELECT proname, pronargs, pronargdefaults FROM pg_proc "
                  "WHERE pronamespace IN ('public'::regnamespace, 'pg_catalog'::regnamespace)"):
        procs.setdefault(name, []).append((nargs, ndefaults))
    bad = []
    for enum, label, text, nparams in ctl_statements():
        used = sorted({int(n) for n in re.findall(r"\$(\d+)", text)})
        if used != list(range(1, nparams + 1)):
            bad.append(f"{enum}: the text uses ${used}, the table says {nparams} parameters")
        call = re.search(rf"\b{re.escape(label)}\((.*)\)", text)
        if label not in procs:
            bad.append(f"{enum}: no function {label} in a fresh install")
            continue
        if call is None:
            bad.append(f"{enum}: the text does not call {label}()")
            continue
        # Top-level commas of the call's argument list.
        depth, args, cur = 0, [], ""
        for ch in call.group(1):
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            if ch == "," and depth == 0:
                args.append(cur)
                cur = ""
            else:
                cur += ch
        args.append(cur)
        passed = len([a for a in args if a.strip()])
        if not any(n - d <= passed <= n for n, d in procs[label]):
            bad.append(f"{enum}: {label}() takes {procs[label]} (arguments, defaults), "
                       f"the statement passes {passed}")
    assert bad == [], "\n".join(bad)


def test_outboxctl_names_no_table_and_reads_columns_by_name():
    bad = []
    for name in CTL_FILES:
        src = read(name)
        for s in code_strings(src):
            if not re.search(r"\bSELECT\b|\bFROM\b|\bJOIN\b", s):
                continue        # a message or a help text, not SQL
            s = re.sub(r"'[^']*'", "''", s)     # a channel name is no table
            for t in TABLES:
                if re.search(rf"\b{t}\b", s):
                    bad.append(f"{name}: names {t}: {s[:80]}")
        for m in re.finditer(r"PQgetvalue\(\w+, \w+, (\d+)\)", src):
            bad.append(f"{name}: a column by number: {m.group(0)}")
        if name not in ("outboxctl.c",) and re.search(r"\bPQexec(Params)?\(", src):
            bad.append(f"{name}: runs a statement of its own, not one of outboxctl_sql.c")
        if name not in ("outboxctl_sql.c", "outboxctl.c") and re.search(r"\bctl_exec(_rc)?\(", src):
            bad.append(f"{name}: runs SQL text, not a named statement")
    assert bad == [], "\n".join(bad)


def new_effect(conn, target="https://sink.example/a"):
    key = make_run(conn)
    query(conn, "UPDATE workflow_runs SET state = 'processing' WHERE idempotency_key = %s", (key,))
    eid = str(enqueue(conn, "http", target, {"n": 1}, key=key))
    query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key = %s", (key,))
    return eid


def test_outboxctl_unknown_show_tells_the_history(db, conn):
    eid = new_effect(conn, target="https://sink.example/\u202eevil")
    arrange(conn, eid, "unknown", attempts=1, last_error_class="ambiguous",
            last_error="timeout after the request was sent")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class, provider_status, error_text) SELECT effect_id, "
                "created_at, 1, gen_random_uuid(), 'w7', now(), 'ambiguous', 504, "
                "'gateway timeout' FROM effect_outbox WHERE effect_id = %s", (eid,))
    out = ok(ctl(db, "unknown", "show", eid)).stdout
    assert f"{eid}: unknown" in out
    assert "ambiguous worker w7 status 504: gateway timeout" in out
    assert "\u202e" not in out and "\\u202e" in out.lower().replace("\\u202E", "\\u202e")
    j = json.loads(ok(ctl(db, "unknown", "show", eid, "--json")).stdout)
    assert j["state"] == "unknown" and j["target"] == "https://sink.example/\u202eevil"
    last = j["history"][-1]
    assert last["worker"] == "w7" and last["provider_status"] == 504
    assert last["outcome_class"] == "ambiguous" and last["error_text"] == "gateway timeout"
    fails(ctl(db, "unknown", "show", "00000000-0000-4000-8000-000000000000"), 1, "no effect")
    fails(ctl(db, "unknown", "show", "nope"), 2, "not a UUID")


def test_status_counts_the_finished_effects_of_its_window(db, conn):
    recent, old, old_failed = new_effect(conn), new_effect(conn), new_effect(conn)
    arrange(conn, recent, "completed", completed_at="SQL:now() - interval '1 hour'")
    arrange(conn, old, "completed", completed_at="SQL:now() - interval '3 days'")
    arrange(conn, old_failed, "failed", completed_at="SQL:now() - interval '2 days'")
    st = json.loads(ok(ctl(db, "status", "--json")).stdout)
    assert st["counts"]["completed"] == 1 and st["counts"]["failed"] == 0
    assert st["finished_window_hours"] == 24
    assert "finished in the last 24 hours" in ok(ctl(db, "status")).stdout


READS = ["outbox_read_switch()", "outbox_read_status()", "outbox_read_unknown()",
         "outbox_read_scopes(false)", "outbox_read_reconcile_start()",
         "outbox_read_history_months()",
         "outbox_read_effect('00000000-0000-4000-8000-000000000000')",
         "outbox_read_effect_history('00000000-0000-4000-8000-000000000000')"]


def test_the_viewer_calls_the_reads_and_nothing_else(db, conn, login_as):
    new_effect(conn)
    v = login_as("outbox_viewer")
    for call in READS:
        query(v, f"SELECT * FROM {call}")
    for sql in ("SELECT count(*) FROM effect_live", "SELECT count(*) FROM effect_history",
                "SELECT count(*) FROM effect_outbox", "SELECT * FROM outbox_effects",
                "SELECT * FROM outbox_control", "SELECT * FROM outbox_scope_status",
                "SELECT outbox_settle_unknown_runs()",
                "SELECT * FROM outbox_kill_switch_set(false, 'v', 'r')",
                "SELECT * FROM outbox_requeue('00000000-0000-4000-8000-000000000000', 'v', 'r')"):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(v, sql)
