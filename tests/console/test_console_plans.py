# SPDX-License-Identifier: ISC
"""Every query of the console's pages is a bounded index walk on a big
database: 10,000,000 finished effects and 2,000,000 live ones, made cheaply
by faking the planner's statistics, not by writing the rows.

A few thousand real rows, spread as the big database's would be (finished
effects over 60 days with their history, live ones over the last day, runs,
operator actions, approvals), are ANALYZEd for their column statistics;
then each table's and index's pg_class.reltuples is scaled to the big size
with relpages left at the real count, so the planner, which multiplies
the recorded density by the table's real pages, sees the big row counts
(autovacuum is off on these tables so nothing re-analyzes them).  Each
console function (sql/functions/45_reads.sql, 46_console.sql, as the
pages call them) is then EXPLAINed through auto_explain, nested
statements included: no Seq Scan on effect_outbox, effect_live,
effect_history's partitions, workflow_runs or operator_actions, and the
statements a page limits end in a Limit.  The overview's chart, an
aggregate over a time window, reads it through the BRIN index; its counts are three walks of at most 20,000 rows each,
whatever the statistics say: run again with every big table's statistics
those of an empty table, they stay index walks under a Limit."""
import re


from outbox_test import plans_of, query, scalar

FINISHED = 10_000_000
LIVE = 2_000_000
RUNS = 1_000_000
ACTIONS = 1_000_000
REAL_FINISHED, REAL_LIVE, REAL_RUNS, REAL_ACTIONS = 6000, 2000, 1000, 1000
BIG = ("effect_outbox", "effect_live", "effect_history", "workflow_runs", "operator_actions")
SEQ_BIG = re.compile(r"Seq Scan on (effect_outbox|effect_live|effect_history\w*|workflow_runs|"
                     r"operator_actions)\b")


def load(conn):
    query(conn, "SELECT outbox_history_partitions(now() - interval '3 months', "
                "now() + interval '1 month')")
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'big-' || lpad(g::text, 7, '0'), CASE WHEN g %% 100 = 0 THEN "
                "'failed_terminal' ELSE 'completed' END, 'h' FROM generate_series(1, %s) g",
          (REAL_RUNS,))
    query(conn, "SET session_replication_role = replica")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                "created_at, available_at) "
                "SELECT 'big-' || lpad((1 + g %% %s)::text, 7, '0'), CASE WHEN g %% 3 = 0 THEN "
                "'email' ELSE 'http' END, 'http://h' || (g %% 7) || '.example/' || g, '{}', t, t "
                "FROM (SELECT g, now() - interval '60 days' + g * (interval '60 days' / %s) AS t "
                "        FROM generate_series(1, %s) g) s", (REAL_RUNS, REAL_FINISHED, REAL_FINISHED))
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, ended_at, outcome_class, provider_status, provider_id, state, "
                "last_provider_id, retry_base) "
                "SELECT effect_id, created_at, 1, gen_random_uuid(), 'w', created_at, "
                "created_at + interval '1 second', 'accepted', 200, 'p', "
                "CASE WHEN right(target, 2) = '50' THEN 'failed' ELSE 'completed' END, 'p', 0 "
                "FROM effect_outbox")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                "created_at, available_at) "
                "SELECT 'big-' || lpad((1 + g %% %s)::text, 7, '0'), 'http', "
                "'http://live.example/' || g, '{}', "
                "now() - interval '1 day' + g * (interval '1 day' / %s), now() "
                "FROM generate_series(1, %s) g", (REAL_RUNS, REAL_LIVE, REAL_LIVE))
    query(conn, "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at, state) "
                "SELECT b.effect_id, b.effect_type, b.created_at, "
                "CASE WHEN right(b.target, 3) = '000' THEN 'infinity' ELSE b.available_at END, "
                "CASE WHEN right(b.target, 3) = '000' THEN 'unknown' ELSE 'pending' END "
                "FROM effect_outbox b WHERE b.target LIKE 'http://live.example/%%'")
    query(conn, "INSERT INTO operator_actions (operator, action, reason, run_key) "
                "SELECT 'op' || (g %% 20), 'requeue', 'r', 'big-0000001' "
                "FROM generate_series(1, %s) g", (REAL_ACTIONS,))
    query(conn, "RESET session_replication_role")
    tables = [r[0] for r in query(
        conn, "SELECT c.oid::regclass::text FROM pg_class c WHERE c.relkind = 'r' AND "
              "(c.relname = ANY(%s) OR c.relname LIKE 'effect_history\\_%%')", (list(BIG),))]
    for t in tables:
        query(conn, f"ALTER TABLE {t} SET (autovacuum_enabled = off)")
        query(conn, f"ANALYZE {t}")
    scale = {"effect_outbox": (FINISHED + LIVE) / (REAL_FINISHED + REAL_LIVE),
             "effect_history": FINISHED / REAL_FINISHED, "effect_live": LIVE / REAL_LIVE,
             "workflow_runs": RUNS / REAL_RUNS, "operator_actions": ACTIONS / REAL_ACTIONS}
    for t in tables:
        base = "effect_history" if t.startswith("effect_history") else t
        # The table and its indexes: reltuples scaled, relpages the real ones.
        query(conn, "UPDATE pg_class SET reltuples = reltuples * %s, "
                    "relpages = greatest(pg_relation_size(oid) / 8192, 1) "
                    "WHERE reltuples > 0 AND (oid = %s::regclass OR oid IN "
                    "(SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass))",
              (scale[base], t, t))
    return tables


def test_console_pages_are_bounded_at_scale(conn):
    load(conn)
    # the planner believes the big sizes
    plan = query(conn, "EXPLAIN (FORMAT JSON) SELECT * FROM effect_live")[0][0]
    assert plan[0]["Plan"]["Plan Rows"] >= LIVE * 0.9, plan
    plan = query(conn, "EXPLAIN (FORMAT JSON) SELECT * FROM effect_outbox")[0][0]
    assert plan[0]["Plan"]["Plan Rows"] >= (FINISHED + LIVE) * 0.9, plan
    some = scalar(conn, "SELECT effect_id::text FROM effect_outbox ORDER BY created_at "
                        "OFFSET %s LIMIT 1", (REAL_FINISHED // 2,))
    # (name, the statement as the page runs it, must show a Limit)
    pages = [
        ("banner: switch", "SELECT * FROM outbox_read_switch()", False),
        ("banner: scopes", "SELECT * FROM outbox_read_scopes(false)", False),
        ("banner: database", "SELECT * FROM outbox_console_database()", False),
        ("overview: ages", "SELECT * FROM outbox_console_ages()", True),
        ("overview: counts", "SELECT * FROM outbox_console_counts()", True),
        ("overview: chart", "SELECT * FROM outbox_console_minutes(3)", False),
        ("effects", "SELECT * FROM outbox_console_effects(now() - interval '24 hours', now() + "
                    "interval '1 minute', NULL, NULL, NULL, NULL, NULL, NULL, NULL, 50, 20000)", True),
        ("effects: failed http", "SELECT * FROM outbox_console_effects(now() - interval "
                                 "'24 hours', now(), 'failed', 'http', NULL, NULL, NULL, NULL, "
                                 "NULL, 50)", True),
        ("effects: host and error", "SELECT * FROM outbox_console_effects(now() - interval "
                                    "'24 hours', now(), NULL, NULL, 'h3.example', NULL, NULL, "
                                    "'timeout', NULL, 50, 20000)", True),
        ("effects: walk end", "SELECT outbox_console_walk_floor(now() - interval '24 hours', "
                              "now(), NULL, 20000)", True),
        ("effects: run key", "SELECT * FROM outbox_console_effects(now() - interval '24 hours', "
                             "now(), NULL, NULL, NULL, 'big-0000007', NULL, NULL, NULL, 50)", True),
        ("effect", f"SELECT * FROM outbox_read_effect('{some}')", False),
        ("effect: history", f"SELECT * FROM outbox_read_effect_history('{some}')", False),
        ("unknown", "SELECT * FROM outbox_read_unknown()", True),
        ("approvals", "SELECT * FROM outbox_console_approvals()", True),
        ("runs", "SELECT * FROM outbox_console_runs(NULL, NULL, 50)", True),
        ("runs: a state", "SELECT * FROM outbox_console_runs('failed_terminal', NULL, 50)", True),
        ("runs: next window", "SELECT outbox_console_runs_window_end('big-0000500')", True),
        ("run", "SELECT * FROM outbox_console_run_effects('big-0000007')", True),
        ("audit", "SELECT * FROM outbox_console_audit(NULL, NULL, 50)", True),
        ("audit: an operator", "SELECT * FROM outbox_console_audit('op3', NULL, 50)", True),
        ("controls", "SELECT * FROM outbox_console_control_history(200)", True),
    ]
    # A month with no row is read as what it is, an empty heap.
    empty = {r[0] for r in query(conn, "SELECT c.relname FROM pg_inherits i "
                                       "JOIN pg_class c ON c.oid = i.inhrelid "
                                       "WHERE i.inhparent = 'effect_history'::regclass "
                                       "AND c.reltuples <= 0")}
    # The chart is bounded by a time window, not by a Limit: it reads the
    # window through each month's BRIN index, never a month whole (the
    # window's own month neither: at some dates of a month the planner
    # chose that for an older one too).
    window_reads = {}
    bad = []
    for name, sql, limited in pages:
        plans = plans_of(conn, sql, None)
        assert plans.strip(), f"{name}: no plan logged"
        scans = sorted(set(SEQ_BIG.findall(plans)) - empty - window_reads.get(name, set()))
        if scans:
            bad.append(f"{name} reads {scans} sequentially:\n{plans}")
        elif limited and "Limit" not in plans:
            bad.append(f"{name}: no Limit in its plan:\n{plans}")
    assert not bad, "\n\n".join(bad)


def test_overview_counts_stay_walks_under_stale_statistics(conn):
    """The overview's counts keep their plan when the statistics say the
    big tables are empty (analyzed before a burst) or were never taken:
    three index walks under a Limit, each counted row one probe of
    effect_outbox's primary key; no sequential scan, no hash join over
    the backlog."""
    tables = load(conn)
    for case in ("empty", "never"):
        for t in tables:
            if case == "empty":
                query(conn, "UPDATE pg_class SET reltuples = 0, relpages = 0 WHERE oid = %s::regclass "
                            "OR oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass)",
                      (t, t))
            else:
                query(conn, "UPDATE pg_class SET reltuples = -1 WHERE oid = %s::regclass OR oid IN "
                            "(SELECT indexrelid FROM pg_index WHERE indrelid = %s::regclass)", (t, t))
                query(conn, "DELETE FROM pg_statistic WHERE starelid = %s::regclass", (t,))
        plans = plans_of(conn, "SELECT * FROM outbox_console_counts()", None)
        assert not SEQ_BIG.findall(plans), f"{case}:\n{plans}"
        assert "Hash Join" not in plans and "Merge Join" not in plans, f"{case}:\n{plans}"
        assert plans.count("Limit") >= 3, f"{case}:\n{plans}"
        assert "effect_live_due_idx" in plans and "effect_outbox_pkey" in plans, f"{case}:\n{plans}"
