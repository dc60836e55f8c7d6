# SPDX-License-Identifier: ISC
"""The hot path's cached generic plans stay index probes on a queue of
millions (sql/functions/30_dispatcher.sql, 35_claim.sql; docs/design.md,
"Tables").

The workers' functions keep the plans PL/pgSQL caches for their
statements; after five calls a statement may run a generic plan, made
without the call's values, for good.  Here, on 2,000,000 open effects
(and 250,000 finished ones with their history), every statement of
outbox_lease, outbox_claim, outbox_mark_sending, outbox_complete (and the
two it calls, outbox_complete_sending and outbox_complete_rest, which the
workers call themselves) and outbox_reap, and the producer's plain INSERT (with its triggers and the
row policy of a producer login), runs under plan_cache_mode =
force_generic_plan, the plan a cache may settle on, and its plans are read
with auto_explain: none may read effect_live, effect_outbox or any partition
of effect_history sequentially, and the rows are found through their keys
(effect_live_pkey, effect_live_due_idx, effect_outbox_pkey).  The functions
must not carry a plan_cache_mode of their own other than
force_generic_plan (it would override the session's).
"""
import json
import re
import uuid

import psycopg2
import pytest

from outbox_test import kill_switch, plans_of, query, scalar

OPEN = 2_000_000
FINISHED = 250_000
RUNS = 20_000
HOT_PATH = ("outbox_lease", "outbox_claim", "outbox_mark_sending", "outbox_complete",
            "outbox_complete_sending", "outbox_complete_rest", "outbox_reap")
SEQ_SCAN = re.compile(r"Seq Scan on (effect_live|effect_outbox|effect_history\w*)")

pytestmark = pytest.mark.slow


def load(conn):
    """The backlog, written as the table owner in a few statements: without
    triggers (session_replication_role), so the live rows the producer's
    trigger would add are written by the statement after the bodies."""
    query(conn, "SELECT outbox_history_partitions(now() - interval '2 months', "
                "now() + interval '3 months')")
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'big-' || g, 'processing', 'h' FROM generate_series(1, %s) g", (RUNS,))
    query(conn, "SET session_replication_role = replica")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                "created_at, available_at) "
                "SELECT 'big-' || (1 + g %% %s), 'http', "
                "'http://127.0.0.1:9/' || g, '{\"n\": 1}', "
                "now() - interval '1 day' + g * interval '10 microseconds', "
                "now() - interval '1 day' + g * interval '10 microseconds' "
                "FROM generate_series(1, %s) g", (RUNS, OPEN + FINISHED))
    # The oldest are finished (an attempt row and the finishing row each);
    # the rest are due, in the order they were written.
    query(conn, "CREATE TEMP TABLE finished AS SELECT effect_id, created_at FROM effect_outbox "
                "ORDER BY created_at LIMIT %s", (FINISHED,))
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class, provider_status, provider_id) "
                "SELECT effect_id, created_at, 1, gen_random_uuid(), 'w', created_at, 'accepted', "
                "200, 'p' FROM finished")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "state, last_provider_id, provider_status, retry_base) "
                "SELECT effect_id, created_at, 1, 'w', created_at, 'completed', 'p', 200, 0 "
                "FROM finished")
    query(conn, "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at) "
                "SELECT b.effect_id, b.effect_type, b.created_at, b.available_at FROM effect_outbox b "
                "WHERE NOT EXISTS (SELECT 1 FROM finished f WHERE f.effect_id = b.effect_id)")
    query(conn, "RESET session_replication_role")
    query(conn, "ANALYZE workflow_runs, effect_outbox, effect_live, effect_history, effect_calls")
    assert scalar(conn, "SELECT count(*) FROM effect_live") == OPEN


def generic_plans(conn, sql, args):
    query(conn, "SET plan_cache_mode = force_generic_plan")
    try:
        return plans_of(conn, sql, args)
    finally:
        query(conn, "RESET plan_cache_mode")


def check(plans, what, must_use):
    assert plans.strip(), f"{what}: no plan logged"
    scans = sorted(set(SEQ_SCAN.findall(plans)))
    assert not scans, f"{what} reads {scans} sequentially:\n{plans}"
    for index in must_use:
        assert index in plans, f"{what} does not use {index}:\n{plans}"


def test_hot_path_generic_plans_are_index_probes_at_two_million_rows(conn, login_as):
    own = dict(query(conn, "SELECT proname, coalesce(array_to_string(proconfig, ' '), '') "
                           "FROM pg_proc WHERE proname = ANY (%s)", (list(HOT_PATH),)))
    assert set(own) == set(HOT_PATH)
    for name, config in own.items():
        # force_generic_plan is what the session sets here; anything else
        # would plan some other way than the cache does.
        assert "plan_cache_mode" not in config or "plan_cache_mode=force_generic_plan" in config, \
            f"{name} sets its own plan_cache_mode: {config}"
    kill_switch(conn, True)
    load(conn)
    owner, claimer = str(uuid.uuid4()), str(uuid.uuid4())

    # lease, from the head and from a position
    for after in ((None, None), ("2000-01-01", str(uuid.uuid4()))):
        plans = generic_plans(conn, "SELECT count(*) FROM outbox_lease(%s, 'w', 64, 30, '{http}', "
                                    "true, %s, %s)", (owner, *after))
        check(plans, "outbox_lease", ["effect_live_due_idx", "effect_outbox_pkey"])
    ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM effect_live "
                                     "WHERE lease_owner = %s", (owner,))]
    assert len(ids) == 128

    plans = generic_plans(conn, "SELECT count(*) FROM outbox_mark_sending(%s, %s::uuid[], true, "
                                "'{}', 30, %s)", (owner, ids, str(uuid.uuid4())))
    check(plans, "outbox_mark_sending", ["effect_live_pkey"])

    # complete: half accepted (a DELETE into the history), half retried
    # (an UPDATE in place), one unknown (the late-evidence probe)
    results = [{"effect_id": i, "attempt": 1, "outcome": "accepted", "next_state": "completed",
                "status": 200, "provider_id": "p"} for i in ids[:64]]
    results += [{"effect_id": i, "attempt": 1, "outcome": "retry", "next_state": "pending",
                 "status": 503, "retry_delay_ms": 1000} for i in ids[64:127]]
    results += [{"effect_id": ids[127], "attempt": 1, "outcome": "ambiguous",
                 "next_state": "unknown", "status": None}]
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_complete_sending(%s, 'w', %s)",
                          (owner, json.dumps(results)))
    check(plans, "outbox_complete_sending", ["effect_live_pkey"])
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY (%s::uuid[])",
                  (ids[:64],)) == 0
    # the rest: the unknown one's late answer (not this lease's to apply:
    # the late-evidence probe, the evidence row, the history probe), alone
    # and through outbox_complete with a batch whose other rows apply
    late = [{"effect_id": ids[127], "attempt": 1, "outcome": "accepted",
             "next_state": "completed", "status": 200, "provider_id": "p"}]
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_complete_rest(%s, 'w', %s)",
                          (owner, json.dumps(late)))
    check(plans, "outbox_complete_rest", ["effect_live_pkey", "effect_outbox_pkey"])
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_complete(%s, 'w', %s)",
                          (owner, json.dumps(late)))
    check(plans, "outbox_complete", ["effect_live_pkey"])

    call = str(uuid.uuid4())
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_claim(%s, 'w', 64, 30, '{http}', true, "
                                "'{}', %s)", (claimer, call))
    check(plans, "outbox_claim", ["effect_live_due_idx", "effect_outbox_pkey"])
    claimed = scalar(conn, "SELECT ids::text[] FROM effect_calls WHERE call = %s", (call,))
    assert len(claimed) == 64

    # reap: the claim's worker died; its call and rows are past their lease
    query(conn, "UPDATE effect_live SET lease_expires_at = now() - interval '1 second' "
                "WHERE effect_id = ANY (%s::uuid[])", (claimed,))
    query(conn, "UPDATE effect_calls SET deadline = now() - interval '1 second' WHERE call = %s",
          (call,))
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_reap('r', 500)", None)
    check(plans, "outbox_reap", ["effect_live_pkey"])
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY (%s::uuid[]) "
                        "AND state = 'unknown'", (claimed,)) == 64

    # The producer's plain INSERT, prepared (the generic plan a driver's
    # prepared statement gets), as a producer login: the gate trigger, the
    # row policy, the foreign key check and the live row's trigger.
    producer = login_as("outbox_producer")
    name = scalar(producer, "SELECT current_user")
    query(conn, "PREPARE produce (text, text, text, jsonb) AS INSERT INTO effect_outbox "
                "(idempotency_key, effect_type, target, payload) VALUES ($1, $2, $3, $4)")
    # auto_explain is loaded and set by the superuser; the statement runs
    # as the producer login (SET ROLE: its grants and row policy apply).
    plans_of(conn, "SELECT 1", None)
    query(conn, "SET auto_explain.log_min_duration = 0")
    query(conn, "SET plan_cache_mode = force_generic_plan")
    for n in range(2):
        del conn.notices[:]
        query(conn, f'SET ROLE "{name}"')
        try:
            query(conn, "EXECUTE produce ('big-7', 'http', %s, '{}')", (f"http://127.0.0.1:9/new-{n}",))
        finally:
            query(conn, "RESET ROLE")
        plans = "\n".join(conn.notices)
        assert "Insert on effect_outbox" in plans, plans
        check(plans, "the producer's INSERT", [])
    query(conn, "RESET plan_cache_mode")
    query(conn, "SET auto_explain.log_min_duration = -1")
    query(conn, "DEALLOCATE produce")
    assert scalar(conn, "SELECT count(*) FROM effect_live l JOIN effect_outbox b USING (effect_id) "
                        "WHERE b.target LIKE 'http://127.0.0.1:9/new-%%'") == 2

    # The check sees a scan where there is one (a function's statement
    # with no index to use), so the checks above can fail.
    query(conn, "CREATE FUNCTION pg_temp.planted_scan(p text) RETURNS bigint LANGUAGE plpgsql AS "
                "$$ BEGIN RETURN (SELECT count(*) FROM effect_live l WHERE l.last_error = p); END $$")
    plans = generic_plans(conn, "SELECT pg_temp.planted_scan('x')", None)
    with pytest.raises(AssertionError, match="reads .'effect_live'. sequentially"):
        check(plans, "planted", [])


# ---- plans that do not follow the statistics --------------------------------
# The cached plan of a hot statement is made from whatever pg_class and
# pg_statistic say when it is made, and kept until an ANALYZE of one of its
# tables.  A queue that drained and was analyzed says "no rows" however
# many arrive after; a plan made while the queue was empty says the same.
# Under such statistics key probes became walks of the whole queue (the ids
# matched effect_live_due_idx's second column; a full walk of the primary
# key fed a nested loop).  Each case below makes the catalog say one thing
# about a queue of 2,000,000 rows and runs every hot statement with
# auto_explain's actual row and buffer counts: none may scan sequentially,
# make a bitmap, hash or merge join, or touch more than a batch's worth.
# The same holds while scopes are set: the scoped lease, the scopes'
# verdict and the hold of the mark, called from the hot path or alone.

STALE_BOUND_ROWS = 5_000       # rows any node of a hot statement may pass
STALE_BOUND_BUFFERS = 30_000   # buffers one hot statement may touch (a walk of the queue: > 400,000)
FORBIDDEN = re.compile(r"(Seq Scan|Bitmap Heap Scan|Bitmap Index Scan|Hash Join|Merge Join)")
NODE_ROWS = re.compile(r"\(actual rows=(\d+) loops=(\d+)\)")
REMOVED = re.compile(r"Rows Removed by (?:Filter|Join Filter): (\d+)")
BUFFERS = re.compile(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?")


def set_statistics(conn, table, how):
    """What the catalog says of table: 'analyzed' (a real ANALYZE now),
    'empty' (what ANALYZE of the drained table wrote: no rows on its pages,
    no column statistics) or 'never' (a table never analyzed or vacuumed)."""
    if how == "analyzed":
        query(conn, f"ANALYZE {table}")
        return
    query(conn, "DELETE FROM pg_statistic WHERE starelid = %s::regclass", (table,))
    query(conn, "UPDATE pg_class SET reltuples = %s, relallvisible = 0, "
                "relpages = CASE WHEN %s THEN 0 ELSE pg_relation_size(oid) / 8192 END "
                "WHERE oid = %s::regclass", (-1 if how == "never" else 0, how == "never", table))


def analyzed_plans(conn, sql, args):
    query(conn, "LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "auto_explain.log_level = notice", "client_min_messages = notice",
                    "auto_explain.log_analyze = on", "auto_explain.log_buffers = on",
                    "auto_explain.log_timing = off"):
        query(conn, "SET " + setting)
    del conn.notices[:]
    rows = query(conn, sql, args)
    query(conn, "SET auto_explain.log_min_duration = -1")
    return "\n".join(conn.notices), rows


def check_bounded(text, what):
    """Each statement's plan in text: no forbidden node, every node and
    filter within the bound, the statement's buffers within theirs."""
    assert text.strip(), f"{what}: no plan logged"
    for plan in text.split("plan:\n")[1:]:
        head = plan.splitlines()[0][:100]
        if "outbox_" in head and "FROM outbox_" in head:
            continue        # the caller's SELECT: its counts are the function's
        bad = FORBIDDEN.findall(plan)
        assert not bad, f"{what}: {bad} in\n{plan}"
        for rows, loops in NODE_ROWS.findall(plan):
            assert int(rows) * int(loops) <= STALE_BOUND_ROWS, f"{what}: a node passes " \
                f"{rows} x {loops} rows in\n{plan}"
        for removed in REMOVED.findall(plan):
            assert int(removed) <= STALE_BOUND_ROWS, f"{what}: a walk past {removed} rows in\n{plan}"
        touched = BUFFERS.search(plan)
        if touched:
            n = sum(int(x or 0) for x in touched.groups())
            assert n <= STALE_BOUND_BUFFERS, f"{what}: {n} buffers in\n{plan}"


def hot_round(c, owner, what):
    """One worker's round on c: claim, lease, mark, renew, complete (finished,
    retried, unknown), release, unclaim, and a reaper pass over a claim whose
    worker died; each statement's plan checked."""
    def run(name, sql, args=None):
        text, rows = analyzed_plans(c, sql, args)
        check_bounded(text, f"{what}: {name}")
        return rows

    call = str(uuid.uuid4())
    claimed = [r[0] for r in run("outbox_claim", "SELECT effect_id::text FROM outbox_claim(%s, 'w', "
                                 "50, 30, '{http}', true, '{}', %s)", (owner, call))]
    assert len(claimed) == 50, what
    leased = [r[0] for r in run("outbox_lease", "SELECT effect_id::text FROM outbox_lease(%s, 'w', "
                                "50, 30, '{http}', true)", (owner,))]
    assert len(leased) == 50, what
    marked = run("outbox_mark_sending", "SELECT effect_id::text FROM outbox_mark_sending(%s, "
                 "%s::uuid[], true, '{}', 30, %s, NULL::text[]) WHERE NOT blocked",
                 (owner, leased[:40], str(uuid.uuid4())))
    assert len(marked) == 40, what
    run("outbox_renew", "SELECT count(*) FROM outbox_renew(%s, %s::uuid[], 30, 300)",
        (owner, leased[:40]))
    run("outbox_release", "SELECT outbox_release(%s, %s::uuid[])", (owner, leased[40:]))
    run("outbox_unclaim", "SELECT outbox_unclaim(%s, %s::uuid[], %s, true)",
        (owner, claimed[40:], call))
    results = [{"effect_id": i, "attempt": 1, "outcome": "accepted", "next_state": "completed",
                "status": 200, "provider_id": "p"} for i in leased[:20]]
    results += [{"effect_id": i, "attempt": 1, "outcome": "retry", "next_state": "pending",
                 "status": 503, "retry_delay_ms": 1000} for i in leased[20:39]]
    results += [{"effect_id": leased[39], "attempt": 1, "outcome": "ambiguous",
                 "next_state": "unknown", "status": None}]
    done = run("outbox_complete_sending", "SELECT effect_id, state FROM "
               "outbox_complete_sending(%s, 'w', %s)", (owner, json.dumps(results)))
    assert len(done) == 40, what
    # The unknown one's late answer: what the usual batch leaves to the rest.
    late = [{"effect_id": leased[39], "attempt": 1, "outcome": "accepted",
             "next_state": "completed", "status": 200, "provider_id": "p"}]
    rest = run("outbox_complete_rest", "SELECT effect_id, applied FROM outbox_complete_rest(%s, "
               "'w', %s)", (owner, json.dumps(late)))
    assert len(rest) == 1, what
    # The claim's worker died: its rows and call are past their lease.
    query(c, "UPDATE effect_live SET lease_expires_at = now() - interval '1 second' "
             "WHERE effect_id = ANY (%s::uuid[])", (claimed[:40],))
    query(c, "UPDATE effect_calls SET deadline = now() - interval '1 second' WHERE call = %s",
          (call,))
    reaped = run("outbox_reap", "SELECT effect_id FROM outbox_reap('r', 500)")
    assert len(reaped) >= 40, what


LIMITED_BURST = 5
NO_ID = "00000000-0000-0000-0000-000000000000"


def scoped_round(conn, c, owner, what):
    """One worker's round on c while scopes are set (by conn): a pause on a
    host no row uses, so that the lease and the claim go through
    outbox_lease_scoped, and a limit on a host the worker's provider
    connects to for half the rows it marks, so that the mark runs
    outbox_scope_sort and outbox_scope_hold; then each scoped function
    called by itself (a caller without the hot path's settings).  Each
    statement's plan checked; the scopes cleared at the end, the rows they
    deferred due again."""
    def run(name, sql, args=None):
        text, rows = analyzed_plans(c, sql, args)
        check_bounded(text, f"{what}, scoped: {name}")
        return rows

    query(conn, "SELECT count(*) FROM outbox_scope_pause('host', 'paused.example', true, 't', 't')")
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', 0.001, %s, 't', 't')",
          (LIMITED_BURST,))
    leased = [r[0] for r in run("outbox_lease", "SELECT effect_id::text FROM outbox_lease(%s, 'w', "
                                "50, 30, '{http}', true)", (owner,))]
    assert len(leased) == 50, what
    claimed = run("outbox_claim", "SELECT effect_id::text, leased_only FROM outbox_claim(%s, 'w', "
                  "50, 30, '{http}', true, '{}', %s, p_lease_if_scoped => true)",
                  (owner, str(uuid.uuid4())))
    assert len(claimed) == 50 and all(only for _, only in claimed), what
    claimed = [i for i, _ in claimed]
    direct = [r[0] for r in run("outbox_lease_scoped", "SELECT effect_id::text FROM "
                                "outbox_lease_scoped(%s, 'w', 50, 30, '{http}', '-infinity', %s, "
                                "67108864)", (owner, NO_ID))]
    assert len(direct) == 50, what
    # A worker that checks the hosts: no due row's URL names a scoped host,
    # so its claim stays one statement, the host-checked one.
    checked_call = str(uuid.uuid4())
    checked = run("outbox_claim, hosts checked", "SELECT effect_id::text, leased_only "
                  "FROM outbox_claim(%s, 'w', 50, 30, '{http}', true, '{}', %s, "
                  "p_lease_if_scoped => true, p_type_hosts => '{NULL}')", (owner, checked_call))
    assert len(checked) == 50 and not any(only for _, only in checked), what
    # A limit on the rows' own host, with a token for each: the claim draws
    # on its bucket in the same statement.
    query(conn, "SELECT outbox_scope_limit('host', '127.0.0.1', 1000, 1000, 't', 't')")
    drawn_call = str(uuid.uuid4())
    drawn = run("outbox_claim, a limit drawn on", "SELECT effect_id::text, leased_only "
                "FROM outbox_claim(%s, 'w', 50, 30, '{http}', true, '{}', %s, "
                "p_lease_if_scoped => true, p_type_hosts => '{NULL}')", (owner, drawn_call))
    assert len(drawn) == 50 and not any(only for _, only in drawn), what
    assert scalar(conn, "SELECT tokens FROM outbox_scopes WHERE value = '127.0.0.1'") < 951, what
    query(conn, "SELECT outbox_scope_limit('host', '127.0.0.1', NULL, NULL, 't', 't')")

    # The provider connects to limited.example for the first 20 rows: the
    # burst's worth goes, the rest is deferred; the other 20 go.
    hosts = ["limited.example"] * 20 + [None] * 20
    marked = run("outbox_mark_sending", "SELECT effect_id::text, attempts, blocked, held_by "
                 "FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s, %s::text[])",
                 (owner, leased[:40], str(uuid.uuid4()), hosts))
    held = [i for i, _, blocked, by in marked if blocked and by == "host:limited.example"]
    sent = [(i, a) for i, a, blocked, _ in marked if not blocked]
    assert len(held) == 20 - LIMITED_BURST and len(sent) == 20 + LIMITED_BURST, (what, marked)

    # The limit's bucket is spent: every limited row is deferred.
    sorted_ = run("outbox_scope_sort", "SELECT effect_id::text, held_by, held_until::text "
                  "FROM outbox_scope_sort(%s::uuid[], %s::text[])", (claimed[:40], hosts))
    verdicts = {i: by for i, by, _ in sorted_}
    assert len(sorted_) == 40 and all(verdicts[i] == "host:limited.example" for i in claimed[:20]) \
        and all(verdicts[i] is None for i in claimed[20:40]), (what, sorted_)
    until = [u for _, by, u in sorted_ if by]
    parked = run("outbox_scope_hold", "SELECT effect_id::text FROM outbox_scope_hold(%s, "
                 "%s::uuid[], %s::uuid[], %s::text[], %s::timestamptz[])",
                 (owner, claimed[:40], [i for i, by, _ in sorted_ if by],
                  ["host:limited.example"] * len(until), until))
    assert sorted(r[0] for r in parked) == sorted(claimed[:20]), what

    results = [{"effect_id": i, "attempt": a, "outcome": "accepted", "next_state": "completed",
                "status": 200, "provider_id": "p"} for i, a in sent]
    done = run("outbox_complete", "SELECT effect_id, applied FROM outbox_complete(%s, 'w', %s)",
               (owner, json.dumps(results)))
    assert len(done) == len(sent) and all(a for _, a in done), what
    run("outbox_release", "SELECT outbox_release(%s, %s::uuid[])",
        (owner, leased[40:] + claimed[20:] + direct))
    run("outbox_unclaim", "SELECT outbox_unclaim(%s, %s::uuid[], %s, true)",
        (owner, [i for i, _ in checked], checked_call))
    run("outbox_unclaim", "SELECT outbox_unclaim(%s, %s::uuid[], %s, true)",
        (owner, [i for i, _ in drawn], drawn_call))
    query(conn, "SELECT outbox_scope_limit('host', 'limited.example', NULL, NULL, 't', 't')")
    query(conn, "SELECT count(*) FROM outbox_scope_pause('host', 'paused.example', false, 't', 't')")
    assert not scalar(conn, "SELECT scoped FROM outbox_control WHERE id = 1"), what


def test_hot_path_plans_hold_whatever_the_statistics_say(conn, db):
    kill_switch(conn, True)
    tables = ("effect_live", "effect_outbox", "effect_calls")
    for t in tables:
        query(conn, f"ALTER TABLE {t} SET (autovacuum_enabled = off)")
    query(conn, "ANALYZE effect_live, effect_outbox, effect_calls")

    # A worker's session whose plans were made while the queue was empty:
    # a few rows go through every statement, then the 2,000,000 arrive.
    early = psycopg2.connect(db)
    early.autocommit = True
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "VALUES ('small', 'processing', 'h')")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT 'small', 'http', 'http://127.0.0.1:9/s' || g, '{}' "
                "FROM generate_series(1, 2000) g")
    for _ in range(6):          # past PL/pgSQL's first calls: the cached plan from here on
        hot_round(early, str(uuid.uuid4()), "while empty")
        scoped_round(conn, early, str(uuid.uuid4()), "while empty")
    # (No ANALYZE from here: the plans stay cached as they were made.)
    query(conn, "DELETE FROM effect_live")
    query(conn, "DELETE FROM effect_calls")
    load_live_only(conn)
    assert scalar(conn, "SELECT reltuples FROM pg_class WHERE oid = 'effect_live'::regclass") <= 0
    hot_round(early, str(uuid.uuid4()), "plans cached while the queue was empty")
    scoped_round(conn, early, str(uuid.uuid4()), "plans cached while the queue was empty")
    early.close()

    cases = [
        ("analyzed while empty", {"effect_live": "empty", "effect_outbox": "empty",
                                  "effect_calls": "empty"}),
        ("never analyzed", {"effect_live": "never", "effect_outbox": "never",
                            "effect_calls": "never"}),
        ("only the producer's table analyzed", {"effect_live": "empty", "effect_outbox": "analyzed",
                                                "effect_calls": "empty"}),
        ("only the live queue analyzed", {"effect_live": "analyzed", "effect_outbox": "empty",
                                          "effect_calls": "analyzed"}),
        ("every table analyzed", {"effect_live": "analyzed", "effect_outbox": "analyzed",
                                  "effect_calls": "analyzed"}),
    ]
    for what, case in cases:
        for t, how in case.items():
            set_statistics(conn, t, how)
        c = psycopg2.connect(db)    # a session with no plan cached yet
        c.autocommit = True
        try:
            for _ in range(2):
                hot_round(c, str(uuid.uuid4()), what)
                scoped_round(conn, c, str(uuid.uuid4()), what)
        finally:
            c.close()

    # The check sees a walk where there is one: a key probe the planner
    # turns into a walk of the queue, as the hot statements were before.
    set_statistics(conn, "effect_live", "empty")
    query(conn, "CREATE FUNCTION pg_temp.walk(p uuid[]) RETURNS bigint LANGUAGE plpgsql "
                "SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS "
                "$$ BEGIN RETURN (SELECT count(*) FROM effect_live l "
                "WHERE l.effect_id = ANY (p) AND l.attempts >= 0); END $$")
    text, _ = analyzed_plans(conn, "SELECT pg_temp.walk(ARRAY(SELECT effect_id FROM effect_live "
                                   "ORDER BY effect_id DESC LIMIT 20))", None)
    with pytest.raises(AssertionError):
        check_bounded(text, "planted")


def load_live_only(conn):
    """2,000,000 due rows in one statement (bodies and live rows), as the
    table owner without triggers."""
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'big-' || g, 'processing', 'h' FROM generate_series(1, %s) g", (RUNS,))
    query(conn, "SET session_replication_role = replica")
    query(conn, "WITH b AS (INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                "payload, created_at, available_at) "
                "SELECT 'big-' || (1 + g %% %s), 'http', 'http://127.0.0.1:9/' || g, '{\"n\": 1}', "
                "now() - interval '1 day' + g * interval '10 microseconds', "
                "now() - interval '1 day' + g * interval '10 microseconds' "
                "FROM generate_series(1, %s) g "
                "RETURNING effect_id, effect_type, created_at, available_at) "
                "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at) "
                "SELECT effect_id, effect_type, created_at, available_at FROM b", (RUNS, OPEN))
    query(conn, "RESET session_replication_role")
