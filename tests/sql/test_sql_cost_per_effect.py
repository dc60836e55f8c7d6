# SPDX-License-Identifier: ISC
"""What the live queue (sql/105_live_queue.sql) and the completion path's
SQL (sql/functions/30_dispatcher.sql) promise while writing less per
effect: the live rows carry two indexes and the history one (plus a
block-range one) that serves every lookup of an effect's rows; each
provider call is recorded once however often its batch arrives; runs are
updated in place; and a run whose last two effects two workers finish at
once is completed when read.
"""
import json
import re
import threading
import uuid

import psycopg2
import pytest

from outbox_test import connect, enqueue, expire_sending, kill_switch, query, scalar


def indexes(conn, table):
    return sorted(r[0] for r in query(conn, "SELECT indexname FROM pg_indexes "
                                            "WHERE tablename = %s", (table,)))


def test_live_rows_have_two_indexes_and_the_history_one(conn):
    """Each index is an entry every new effect writes: the live row's key
    and its due order, and the history row's (creation time, effect)
    (its block-range index writes a summary per range, not per row).
    The held-rows index is partial: a new row (held_by NULL) adds no entry
    to it, and a claim, which leaves held_by alone, stays HOT.  So is the
    history's index of failing rows: a completion's row adds no entry."""
    assert indexes(conn, "effect_live") == ["effect_live_due_idx", "effect_live_held_idx",
                                            "effect_live_pkey"]
    assert "WHERE (held_by IS NOT NULL)" in scalar(
        conn, "SELECT pg_get_indexdef('effect_live_held_idx'::regclass)")
    assert indexes(conn, "effect_history") == ["effect_history_effect_idx",
                                               "effect_history_ended_brin",
                                               "effect_history_failed_idx"]
    assert "WHERE (state = 'failed'::text)" in scalar(
        conn, "SELECT pg_get_indexdef('effect_history_failed_idx'::regclass)")
    assert scalar(conn, "SELECT amname FROM pg_class c JOIN pg_am a ON a.oid = c.relam "
                        "WHERE c.relname = 'effect_history_ended_brin'") == "brin"


def test_one_row_per_call_however_often_its_batch_arrives(conn):
    """No unique index binds the history any more: the completion itself
    records a call once.  A batch with an applied element and one whose
    lease the reaper took, delivered three times: one row for the applied
    call; the reaper's row and one evidence row for the other."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    ok, lost = sorted(str(enqueue(conn, "http", f"http://127.0.0.1:9/{n}", {})) for n in "ab")
    query(conn, "UPDATE effect_live SET available_at = '-infinity'")
    ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_claim(%s, 'w', 2, 30, "
                                     "'{http}', true, '{}', %s)", (owner, str(uuid.uuid4())))]
    assert sorted(ids) == [ok, lost]
    expire_sending(conn, [lost])
    query(conn, "UPDATE effect_live SET lease_expires_at = now() + interval '30 seconds' "
                "WHERE effect_id = %s", (ok,))
    assert [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_reap('r', 10)")] == [lost]
    batch = json.dumps([{"effect_id": i, "attempt": 1, "outcome": "accepted",
                         "next_state": "completed", "status": 200, "provider_id": "p"}
                        for i in (ok, lost)])
    for _ in range(3):
        query(conn, "SELECT * FROM outbox_complete(%s, 'w', %s)", (owner, batch))
    rows = query(conn, "SELECT effect_id::text, worker, cas_applied, resolution FROM effect_attempts")
    # The lost one's acceptance is late evidence of the attempt the reaper
    # gave up on: it resolves the effect.
    assert sorted(rows) == sorted([(ok, "w", True, None), (lost, "reaper:r", True, None),
                                   (lost, "w", True, "late_accepted")]), rows
    assert dict(query(conn, "SELECT effect_id::text, state FROM outbox_effects")) == \
        {ok: "completed", lost: "completed"}


@pytest.mark.parametrize("lookup", [
    # outbox_complete's and outbox_resolve_late_accepted's probe for the
    # reaper's row of an attempt (rows the old partial index did not hold)
    "SELECT 1 FROM effect_history a WHERE a.effect_id = %(e)s AND a.created_at = %(c)s "
    "AND a.attempt = 1 AND a.lease_owner = %(o)s AND a.worker LIKE 'reaper:%%'",
    # outbox_reconcile_lease: the latest send of the current attempt
    "SELECT max(a.started_at) FROM effect_history a WHERE a.effect_id = %(e)s "
    "AND a.created_at = %(c)s AND a.attempt = 1 AND a.outcome_class IN ('accepted', 'ambiguous')",
    # an effect's finishing row (outbox_effect_state, the outbox_effects view)
    "SELECT h.state FROM effect_history h WHERE h.effect_id = %(e)s AND h.created_at = %(c)s "
    "AND h.state IS NOT NULL ORDER BY h.history_id DESC LIMIT 1",
])
def test_every_lookup_by_effect_reads_the_unique_index(conn, lookup):
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class) SELECT gen_random_uuid(), now(), 1 + g % 3, "
                "gen_random_uuid(), CASE WHEN g % 10 = 0 THEN 'reaper:r' ELSE 'w' END, now(), "
                "'accepted' FROM generate_series(1, 20000) g")
    query(conn, "ANALYZE effect_history")
    plan = "\n".join(r[0] for r in query(conn, "EXPLAIN " + lookup,
                                         {"e": str(uuid.uuid4()), "o": str(uuid.uuid4()),
                                          "c": scalar(conn, "SELECT now()")}))
    # The partition's own copy of effect_history_effect_idx.
    assert re.search(r"Index (Only )?Scan.* using effect_history_\w+_created_at_effect_id_idx", plan), plan
    assert "Seq Scan" not in plan, plan


def test_run_updates_stay_on_their_page(conn):
    """workflow_runs keeps room on its pages: settling every run of one page
    in one transaction (a reader settles the runs it reads together)
    rewrites many of them on that page (HOT: no new primary-key entry).
    With full pages (fillfactor 100) none fits."""
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'ff-' || g, 'processing', 'h' FROM generate_series(1, 400) g")
    keys = [r[0] for r in query(conn, "SELECT idempotency_key FROM workflow_runs "
                                      "WHERE (ctid::text::point)[0] = 0")]
    # One effect each, finished: its live row gone, its history row completed.
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT k, 'http', 'http://127.0.0.1:9/', '{}' FROM unnest(%s::text[]) k", (keys,))
    query(conn, "WITH gone AS (DELETE FROM effect_live RETURNING effect_id, created_at) "
                "INSERT INTO effect_history (effect_id, created_at, attempt, started_at, state) "
                "SELECT effect_id, created_at, 1, now(), 'completed' FROM gone")
    assert scalar(conn, "SELECT outbox_settle_runs(%s)", (keys,)) == len(keys)
    stayed, completed = query(conn, "SELECT count(*) FILTER (WHERE (ctid::text::point)[0] = 0), "
                                    "count(*) FILTER (WHERE state = 'completed') "
                                    "FROM workflow_runs WHERE idempotency_key = ANY (%s)", (keys,))[0]
    assert completed == len(keys)
    assert stayed >= len(keys) / 3, f"{stayed} of {len(keys)} runs updated on their own page"


def test_two_workers_finishing_the_last_two_effects_of_a_run_complete_it(db, conn):
    """Worker A records the run's first effect and has not committed yet;
    worker B records the second.  Neither touches the run (its state is
    settled when read), so B does not wait for A; once both have committed,
    the run reads completed.  (Had each completion decided the run from the
    other's uncommitted effect, both would have seen one still `sending`
    and the run would have stayed `processing` for good.)"""
    kill_switch(conn, True)
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "VALUES ('two-last', 'processing', 'h')")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT 'two-last', 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, 2) g")
    owners, batches = [str(uuid.uuid4()), str(uuid.uuid4())], []
    for owner in owners:
        (eid,), = query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', 1, 30, '{http}', true)",
                        (owner,))
        (_, attempt), = query(conn, "SELECT effect_id, attempts FROM outbox_mark_sending(%s, %s::uuid[], "
                                    "true, '{}', 30, %s)", (owner, [eid], str(uuid.uuid4())))
        batches.append(json.dumps([{"effect_id": eid, "attempt": attempt, "outcome": "accepted",
                                    "next_state": "completed", "status": 200}]))
    a = psycopg2.connect(db)                      # not autocommit: holds its locks
    b = connect(db)
    try:
        query(a, "SELECT * FROM outbox_complete(%s, 'a', %s)", (owners[0], batches[0]))
        result = {}
        t = threading.Thread(target=lambda: result.update(
            b=query(b, "SELECT applied FROM outbox_complete(%s, 'b', %s)", (owners[1], batches[1]))))
        t.start()
        t.join(10)
        assert not t.is_alive(), "worker B waited for worker A"
        assert result["b"] == [(True,)]
        # A still open: the run is not complete yet, whoever reads it.
        query(conn, "SELECT outbox_settle_runs(ARRAY['two-last'])")
        assert scalar(conn, "SELECT state FROM workflow_runs "
                            "WHERE idempotency_key = 'two-last'") == "processing"
        a.commit()
    finally:
        a.close()
        b.close()
    query(conn, "SELECT outbox_settle_runs(ARRAY['two-last'])")
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = 'two-last'") == "completed"
