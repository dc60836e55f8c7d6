# SPDX-License-Identifier: ISC
"""The reads of sql/functions/45_reads.sql and 46_console.sql (outboxctl's
and the web console's pages) stay bounded on a long history: on HISTORY finished effects
spread over two months (and LIVE open ones), none reads a partition of
effect_history sequentially, status counts the finished effects of its
window through the history's end-time index, and the reads by effect and
the unknown list are index probes, and the failed effects are a walk of
the history's index of failing rows.

The figures default to 1,000,000 finished and 200,000 open effects, so the
suite stays quick on a small machine; OUTBOX_SCALE_HISTORY=10000000
OUTBOX_SCALE_LIVE=2000000 run it at full scale (docs/performance.md).
"""
import os
import re
import time

import pytest

from outbox_test import plans_of, query, scalar

HISTORY = int(os.environ.get("OUTBOX_SCALE_HISTORY", "1000000"))
LIVE = int(os.environ.get("OUTBOX_SCALE_LIVE", "200000"))
SEQ_HISTORY = re.compile(r"Seq Scan on (effect_history\w*|effect_outbox)")

pytestmark = pytest.mark.slow


def load(conn):
    """HISTORY finished effects created over the last 60 days, each with its
    attempt and its finishing row (one in 50 failed), LIVE open ones of
    the last day (one in 1,000 unknown), written without triggers."""
    query(conn, "SELECT outbox_history_partitions(now() - interval '3 months', "
                "now() + interval '1 month')")
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'big-' || g, 'processing', 'h' FROM generate_series(1, 1000) g")
    query(conn, "SET session_replication_role = replica")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                "created_at, available_at) "
                "SELECT 'big-' || (1 + g %% 1000), CASE WHEN g %% 3 = 0 THEN 'email' ELSE 'http' END, "
                "'http://h' || (g %% 7) || '.example/' || g, '{\"n\": 1}', t, t "
                "FROM (SELECT g, now() - interval '60 days' + (g * (interval '60 days' / %s)) AS t "
                "        FROM generate_series(1, %s) g) s", (HISTORY, HISTORY))
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, ended_at, outcome_class, provider_status, provider_id, state, "
                "last_provider_id, retry_base) "
                "SELECT effect_id, created_at, 1, gen_random_uuid(), 'w', created_at, "
                "created_at + interval '1 second', 'accepted', 200, 'p', "
                "CASE WHEN right(target, 2) = '50' THEN 'failed' ELSE 'completed' END, 'p', 0 "
                "FROM effect_outbox")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                "created_at, available_at) "
                "SELECT 'big-' || (1 + g %% 1000), 'http', 'http://live.example/' || g, '{}', "
                "now() - interval '1 day' + g * (interval '1 day' / %s), now() "
                "FROM generate_series(1, %s) g", (LIVE, LIVE))
    query(conn, "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at, state) "
                "SELECT b.effect_id, b.effect_type, b.created_at, "
                "CASE WHEN right(b.target, 3) = '000' THEN 'infinity' ELSE b.available_at END, "
                "CASE WHEN right(b.target, 3) = '000' THEN 'unknown' ELSE 'pending' END "
                "FROM effect_outbox b WHERE b.target LIKE 'http://live.example/%%'")
    query(conn, "RESET session_replication_role")
    query(conn, "ANALYZE workflow_runs, effect_outbox, effect_live, effect_history")


def timed(conn, sql, args=None):
    t = time.monotonic()
    query(conn, sql, args)
    return (time.monotonic() - t) * 1000


def test_reads_are_bounded_on_a_long_history(conn):
    load(conn)
    assert scalar(conn, "SELECT count(*) FROM effect_live") == LIVE
    some = scalar(conn, "SELECT effect_id::text FROM effect_outbox ORDER BY created_at "
                        "OFFSET %s LIMIT 1", (HISTORY // 2,))
    reads = {
        "outbox_read_status": ("SELECT * FROM outbox_read_status()", None, ["ended"]),
        "outbox_read_unknown": ("SELECT * FROM outbox_read_unknown()", None,
                                ["effect_live_due_idx"]),
        "outbox_read_effect": ("SELECT * FROM outbox_read_effect(%s)", (some,),
                               ["effect_outbox_pkey"]),
        "outbox_read_effect_history": ("SELECT * FROM outbox_read_effect_history(%s)", (some,),
                                       ["effect_outbox_pkey", "effect_id"]),
        # The console's pages (sql/functions/46_console.sql).
        "outbox_console_counts": ("SELECT * FROM outbox_console_counts()", None, ["ended"]),
        "outbox_console_ages": ("SELECT * FROM outbox_console_ages()", None,
                                ["effect_live_due_idx"]),
        "outbox_console_minutes": ("SELECT * FROM outbox_console_minutes(3)", None, ["ended"]),
        "outbox_console_effects": (
            "SELECT * FROM outbox_console_effects(now() - interval '24 hours', now(), NULL, NULL, "
            "NULL, NULL, NULL, NULL, NULL, 50)", None, ["effect_outbox_pkey"]),
        "outbox_console_effects (failed)": (
            "SELECT * FROM outbox_console_effects(now() - interval '24 hours', now(), 'failed', "
            "'http', NULL, NULL, NULL, NULL, NULL, 50)", None,
            ["effect_outbox_pkey"]),
        "outbox_console_effects (run key)": (
            "SELECT * FROM outbox_console_effects(now() - interval '24 hours', now(), NULL, NULL, "
            "NULL, 'big-7', NULL, NULL, NULL, 50)", None, []),
        "outbox_console_run_effects": ("SELECT * FROM outbox_console_run_effects('big-7')", None,
                                       []),
        "outbox_console_runs": ("SELECT * FROM outbox_console_runs(NULL, NULL, 50)", None, []),
        "outbox_console_audit": ("SELECT * FROM outbox_console_audit(NULL, NULL, 50)", None, []),
        "outbox_console_control_history": (
            "SELECT * FROM outbox_console_control_history(50)", None, []),
    }
    # A month with no row yet is read as what it is, an empty heap.
    empty = {r[0] for r in query(conn, "SELECT c.relname FROM pg_inherits i "
                                       "JOIN pg_class c ON c.oid = i.inhrelid "
                                       "WHERE i.inhparent = 'effect_history'::regclass "
                                       "AND c.relpages = 0")}
    times = {}
    for name, (sql, args, must_use) in reads.items():
        plans = plans_of(conn, sql, args)
        assert plans.strip(), f"{name}: no plan logged"
        scans = sorted(set(SEQ_HISTORY.findall(plans)) - empty)
        assert not scans, f"{name} reads {scans} sequentially:\n{plans}"
        for index in must_use:
            assert index in plans, f"{name} does not use {index}:\n{plans}"
        if name == "outbox_console_effects (failed)":
            # The history's failing rows, each partition's part of
            # effect_history_failed_idx walked newest first.
            assert re.search(r"Index (Only )?Scan Backward using effect_history_\d{6}_effect_id_idx",
                             plans), plans
        times[name] = min(timed(conn, sql, args) for _ in range(3))
    st = query(conn, "SELECT completed, failed, unknown FROM outbox_read_status()")[0]
    # One day of sixty: about a sixtieth of the history.
    assert 0 < st[0] < HISTORY / 30 and st[2] == LIVE // 1000
    report = os.environ.get("OUTBOX_SCALE_REPORT")
    if report:
        with open(report, "w") as f:
            f.write(f"history {HISTORY}, live {LIVE}: read times (ms, best of 3)\n")
            for k, t in times.items():
                f.write(f"{k}\t{t:.1f}\n")
