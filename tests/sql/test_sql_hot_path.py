# SPDX-License-Identifier: ISC
"""The hot path's SQL (sql/functions/30_dispatcher.sql), outbox_complete's
two paths: the usual batch and the leftovers (lease lost, a batch delivered
twice): one attempts row per call, applied or not, and a repeated batch
adds none.
"""
import json
import uuid

from outbox_test import expire_sending, kill_switch, query, scalar


def lease(conn, owner, n):
    return [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                      "'{http}', true)", (owner, n))]


def mark(conn, owner, ids):
    return query(conn, "SELECT effect_id::text, attempts FROM outbox_mark_sending(%s, %s::uuid[], "
                       "true, '{}', 30, %s)", (owner, ids, str(uuid.uuid4())))


def outcomes(ids, attempt=1, outcome="accepted", next_state="completed"):
    return json.dumps([{"effect_id": i, "attempt": attempt, "outcome": outcome,
                        "next_state": next_state, "retry_delay_ms": 0, "status": 200,
                        "provider_id": "p-" + i[:8]} for i in ids])


def complete(conn, owner, results):
    return query(conn, "SELECT effect_id::text, applied, state, resolved FROM outbox_complete(%s, 'w', %s)",
                 (owner, results))


def add_effects(conn, n, label):
    """n pending effects, one run each."""
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (label, n))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s || g, 'http', 'http://127.0.0.1:9/', '{}' FROM generate_series(1, %s) g",
          (label, n))


def test_complete_usual_batch_and_leftovers(conn):
    """One batch with an element whose CAS applies and one whose lease was
    lost (the reaper made it `unknown`, and it is not this attempt's late
    evidence: outcome retry): one attempts row each, applied true/false;
    the same batch delivered again adds no row and still says applied for
    the first."""
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    add_effects(conn, 2, "mix-")
    ids = lease(conn, owner, 2)
    assert [a for _, a in mark(conn, owner, ids)] == [1, 1]
    ok, lost = ids
    # The lost one's lease expired while sending: the reaper gives it up.
    expire_sending(conn, [lost])
    assert [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_reap('r', 10)")] == [lost]
    batch = json.loads(outcomes([ok]))
    batch += json.loads(outcomes([lost], outcome="retry", next_state="pending"))
    first = {r[0]: r[1:] for r in complete(conn, owner, json.dumps(batch))}
    assert first == {ok: (True, "completed", None), lost: (False, None, None)}
    again = {r[0]: r[1:] for r in complete(conn, owner, json.dumps(batch))}
    assert again == first
    rows = query(conn, "SELECT effect_id::text, attempt, outcome_class, cas_applied, provider_id "
                       "FROM effect_attempts WHERE worker = 'w' ORDER BY cas_applied DESC")
    assert rows == [(ok, 1, "accepted", True, "p-" + ok[:8]), (lost, 1, "retry", False, "p-" + lost[:8])]
    assert query(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (lost,))[0][0] == "unknown"
    # The run's state follows from its effects when it is read (settled).
    key = scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (ok,))
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == "processing"
    query(conn, "SELECT outbox_settle_runs(ARRAY[%s])", (key,))
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == "completed"
