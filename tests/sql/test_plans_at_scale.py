# SPDX-License-Identifier: ISC
"""The hot path's cached generic plans stay index probes on a queue of
millions (sql/functions/30_dispatcher.sql, 35_claim.sql; docs/design.md,
"Tables").

The workers' functions keep the plans PL/pgSQL caches for their
statements; after five calls a statement may run a generic plan, made
without the call's values, for good.  Here, on 2,000,000 open effects
(and 250,000 finished ones with their history), every statement of
outbox_lease, outbox_claim, outbox_mark_sending, outbox_complete and
outbox_reap, and the producer's plain INSERT (with its triggers and the
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

import pytest

from outbox_test import kill_switch, plans_of, query, scalar

OPEN = 2_000_000
FINISHED = 250_000
RUNS = 20_000
HOT_PATH = ("outbox_lease", "outbox_claim", "outbox_mark_sending", "outbox_complete", "outbox_reap")
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
    plans = generic_plans(conn, "SELECT count(*) FROM outbox_complete(%s, 'w', %s)",
                          (owner, json.dumps(results)))
    check(plans, "outbox_complete", ["effect_live_pkey"])
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = ANY (%s::uuid[])",
                  (ids[:64],)) == 0

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
