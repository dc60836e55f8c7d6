# SPDX-License-Identifier: ISC
"""What sql/102_cost_per_effect.sql and the completion path's SQL
(sql/functions/30_dispatcher.sql) promise while writing less per effect:
the attempts log's one unique index still binds exactly the rows the old
partial one did and serves every lookup by effect and attempt; runs are
updated in place; and two workers finishing the last two effects of one run
still cannot both miss the other's commit.
"""
import json
import threading
import uuid

import psycopg2
import pytest

from outbox_test import connect, kill_switch, query, scalar, wait_for

INSERT_ATTEMPT = ("INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at, "
                  "outcome_class) VALUES (%s, 1, %s, %s, now(), 'accepted')")


def test_attempts_log_has_one_index_besides_its_primary_key(conn):
    names = sorted(r[0] for r in query(conn, "SELECT indexname FROM pg_indexes "
                                             "WHERE tablename = 'effect_attempts'"))
    assert names == ["effect_attempts_call_uq", "effect_attempts_pkey"]


def test_one_row_per_call_of_a_lease_owner_and_nothing_more(conn):
    """Binds what the partial index bound (a worker's row for one attempt of
    one lease owner), and leaves free what it left out: the reaper's rows,
    rows without a lease owner (reconciliation, operators), rows without a
    worker name."""
    e, owner = str(uuid.uuid4()), str(uuid.uuid4())
    query(conn, INSERT_ATTEMPT, (e, owner, "w1"))
    with pytest.raises(psycopg2.errors.UniqueViolation):
        query(conn, INSERT_ATTEMPT, (e, owner, "w2"))
    for worker in ("reaper:a", "reaper:a", "reaper:b"):
        query(conn, INSERT_ATTEMPT, (e, owner, worker))
    for worker in ("w1", "w1", "reconcile:x"):
        query(conn, INSERT_ATTEMPT, (e, None, worker))
    for _ in range(2):
        query(conn, INSERT_ATTEMPT, (e, owner, None))
    query(conn, INSERT_ATTEMPT, (e, str(uuid.uuid4()), "w1"))   # another lease owner
    assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE effect_id = %s", (e,)) == 10


@pytest.mark.parametrize("lookup", [
    # outbox_complete's and outbox_resolve_late_accepted's probe for the
    # reaper's row of an attempt (rows the old partial index did not hold)
    "SELECT 1 FROM effect_attempts a WHERE a.effect_id = %(e)s AND a.attempt = 1 "
    "AND a.lease_owner = %(o)s AND a.worker LIKE 'reaper:%%'",
    # outbox_reconcile_lease: the latest send of the current attempt
    "SELECT max(a.started_at) FROM effect_attempts a WHERE a.effect_id = %(e)s AND a.attempt = 1 "
    "AND a.outcome_class IN ('accepted', 'ambiguous')",
    # outboxctl unknown list: the effect's last attempt row
    "SELECT x.worker FROM effect_attempts x WHERE x.effect_id = %(e)s "
    "ORDER BY x.attempt_id DESC LIMIT 1",
])
def test_every_lookup_by_effect_reads_the_unique_index(conn, lookup):
    query(conn, "INSERT INTO effect_attempts (effect_id, attempt, lease_owner, worker, started_at, "
                "outcome_class) SELECT gen_random_uuid(), 1 + g % 3, gen_random_uuid(), "
                "CASE WHEN g % 10 = 0 THEN 'reaper:r' ELSE 'w' END, now(), 'accepted' "
                "FROM generate_series(1, 20000) g")
    query(conn, "ANALYZE effect_attempts")
    plan = "\n".join(r[0] for r in query(conn, "EXPLAIN " + lookup,
                                         {"e": str(uuid.uuid4()), "o": str(uuid.uuid4())}))
    assert "effect_attempts_call_uq" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_run_updates_stay_on_their_page(conn):
    """workflow_runs keeps room on its pages: completing every run of one
    page in one transaction (a completion batch covers about a page of runs
    written together) rewrites many of them on that page (HOT: no new
    primary-key entry).  With full pages (fillfactor 100) none fits."""
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT 'ff-' || g, 'processing', 'h' FROM generate_series(1, 400) g")
    keys = [r[0] for r in query(conn, "SELECT idempotency_key FROM workflow_runs "
                                      "WHERE (ctid::text::point)[0] = 0")]
    query(conn, "SELECT outbox_advance_runs('{}', %s)", (keys,))   # runs without effects: complete
    stayed, completed = query(conn, "SELECT count(*) FILTER (WHERE (ctid::text::point)[0] = 0), "
                                    "count(*) FILTER (WHERE state = 'completed') "
                                    "FROM workflow_runs WHERE idempotency_key = ANY (%s)", (keys,))[0]
    assert completed == len(keys)
    assert stayed >= len(keys) / 3, f"{stayed} of {len(keys)} runs updated on their own page"


def test_two_workers_finishing_the_last_two_effects_of_a_run_complete_it(db, conn):
    """Worker A records the run's first effect and has not committed yet;
    worker B records the second.  B must wait for A's lock on the run and
    then see A's effect completed: the run completes.  (Without the lock, B
    would read A's effect as still `sending`, A had read B's the same way,
    and the run would stay `processing` for good.)"""
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
        b_pid = scalar(b, "SELECT pg_backend_pid()")
        result = {}
        t = threading.Thread(target=lambda: result.update(
            b=query(b, "SELECT applied FROM outbox_complete(%s, 'b', %s)", (owners[1], batches[1]))))
        t.start()
        wait_for(lambda: scalar(conn, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity "
                                      "WHERE pid = %s", (b_pid,)),
                 timeout=10, what="worker B waiting for the run's lock")
        a.commit()
        t.join(10)
        assert not t.is_alive()
        assert result["b"] == [(True,)]
    finally:
        a.close()
        b.close()
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = 'two-last'") == "completed"
