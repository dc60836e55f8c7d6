# SPDX-License-Identifier: ISC
"""Producer SQL: claiming runs, the CAS transition, the re-run protocol, and
the direct enqueue/cancel path (sql/functions/20_producer.sql).

Each test names the behaviour it guards; the lease and expiry cases move
time by writing lease_expires_at in the past instead of sleeping.
"""
import hashlib
import json
import threading
import uuid

import psycopg2
import pytest

from outbox_test import connect, kill_switch, make_run, query, scalar

CLAIM = "SELECT status, idempotency_key, state, lease_owner, version, result " \
        "FROM outbox_claim_run(%s, %s, %s, %s)"


def claim(conn, key, payload_hash="h1", owner=None, lease=300):
    owner = owner or str(uuid.uuid4())
    rows = query(conn, CLAIM, (key, payload_hash, owner, lease))
    assert len(rows) == 1, rows
    k = ("status", "idempotency_key", "state", "lease_owner", "version", "result")
    return dict(zip(k, rows[0])), owner


def run_row(conn, key):
    rows = query(conn, "SELECT state, payload_hash, lease_owner::text, lease_expires_at, "
                       "version, result, updated_at FROM workflow_runs WHERE idempotency_key = %s",
                 (key,))
    if not rows:
        return None
    k = ("state", "payload_hash", "lease_owner", "lease_expires_at", "version", "result",
         "updated_at")
    return dict(zip(k, rows[0]))


def expire_lease(conn, key):
    query(conn, "UPDATE workflow_runs SET lease_expires_at = now() - interval '1 second' "
                "WHERE idempotency_key = %s", (key,))


def transition(conn, key, owner, version, state, result=None):
    return query(conn, "SELECT version FROM outbox_transition_run(%s, %s, %s, %s, %s)",
                 (key, owner, version, state, json.dumps(result) if result is not None else None))


# --- ten concurrent deliveries ---------------------------------------------

def test_ten_concurrent_claims_give_exactly_one_lease(db, conn):
    key = "lead-" + uuid.uuid4().hex
    n = 10
    conns = [connect(db) for _ in range(n)]
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def worker(i):
        try:
            owner = str(uuid.uuid4())
            barrier.wait(timeout=30)
            rows = query(conns[i], CLAIM, (key, "same-hash", owner, 300))
            results[i] = (rows[0][0], owner, rows[0][3])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in conns:
        c.close()
    assert not errors, errors

    statuses = sorted(r[0] for r in results)
    assert statuses == ["busy"] * 9 + ["claimed"], statuses
    winner = next(r for r in results if r[0] == "claimed")
    # Only the winner learns a lease owner; the losers never see it.
    assert winner[2] is not None and str(winner[2]) == winner[1]
    assert all(r[2] is None for r in results if r[0] == "busy")

    row = run_row(conn, key)
    assert row["state"] == "processing"
    assert row["lease_owner"] == winner[1]
    assert row["version"] == 0
    assert scalar(conn, "SELECT lease_expires_at > now() FROM workflow_runs "
                        "WHERE idempotency_key = %s", (key,))
    assert scalar(conn, "SELECT count(*) FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == 1
    # Every delivery is counted for the duplicate-delivery figure.
    assert dict(query(conn, "SELECT outcome, count(*) FROM run_claims WHERE idempotency_key = %s "
                            "GROUP BY outcome", (key,))) == {"claimed": 1, "busy": 9}


def test_live_lease_is_busy_and_not_taken_over(conn):
    r1, owner1 = claim(conn, "k-live")
    assert r1["status"] == "claimed" and str(r1["lease_owner"]) == owner1
    before = run_row(conn, "k-live")
    r2, _ = claim(conn, "k-live")
    assert r2["status"] == "busy" and r2["lease_owner"] is None
    assert run_row(conn, "k-live") == before


# --- expired lease, stale owner ----------------------------------------------

def test_expired_lease_is_reclaimed_with_version_bump(conn):
    r1, owner1 = claim(conn, "k-exp")
    assert r1["version"] == 0
    expire_lease(conn, "k-exp")
    r2, owner2 = claim(conn, "k-exp")
    assert r2["status"] == "reclaimed"
    assert r2["version"] == 1
    assert str(r2["lease_owner"]) == owner2 != owner1
    row = run_row(conn, "k-exp")
    assert row["state"] == "processing" and row["lease_owner"] == owner2 and row["version"] == 1
    assert scalar(conn, "SELECT lease_expires_at > now() FROM workflow_runs "
                        "WHERE idempotency_key = 'k-exp'")


def test_failed_retryable_is_reclaimed(conn):
    r1, owner1 = claim(conn, "k-retry")
    assert transition(conn, "k-retry", owner1, 0, "failed_retryable") == [(1,)]
    r2, owner2 = claim(conn, "k-retry")
    assert r2["status"] == "reclaimed" and r2["version"] == 2
    assert run_row(conn, "k-retry")["lease_owner"] == owner2


def test_stale_owner_cas_changes_nothing(conn):
    _, old_owner = claim(conn, "k-cas")
    expire_lease(conn, "k-cas")
    r2, new_owner = claim(conn, "k-cas")
    assert r2["status"] == "reclaimed" and r2["version"] == 1
    before = run_row(conn, "k-cas")

    # The old owner at its old version: lost ownership, no row, no change.
    assert transition(conn, "k-cas", old_owner, 0, "awaiting_human") == []
    # The old owner guessing the new version: still not the owner.
    assert transition(conn, "k-cas", old_owner, 1, "completed") == []
    # The new owner at a stale version: refused too.
    assert transition(conn, "k-cas", new_owner, 0, "failed_terminal") == []
    # Nor can a stale owner renew.
    assert query(conn, "SELECT outbox_renew_run(%s, %s, %s, 300)",
                 ("k-cas", old_owner, 0)) == [(None,)]
    assert run_row(conn, "k-cas") == before

    # The live owner at the current version moves it, once.
    assert transition(conn, "k-cas", new_owner, 1, "failed_retryable",
                      {"why": "provider down"}) == [(2,)]
    assert transition(conn, "k-cas", new_owner, 1, "failed_terminal") == []
    row = run_row(conn, "k-cas")
    assert row["state"] == "failed_retryable" and row["version"] == 2
    assert row["result"] == {"why": "provider down"}


def test_owner_with_expired_lease_cannot_transition(conn):
    _, owner = claim(conn, "k-cas2")
    expire_lease(conn, "k-cas2")
    before = run_row(conn, "k-cas2")
    assert transition(conn, "k-cas2", owner, 0, "completed") == []
    assert run_row(conn, "k-cas2") == before


def test_cas_does_not_move_a_run_that_left_processing(conn):
    """The lease is a processing lease: once the run is awaiting a human
    (or finished), its former owner's CAS cannot move it, even while the
    lease time has not run out."""
    _, owner = claim(conn, "k-left")
    assert transition(conn, "k-left", owner, 0, "awaiting_human") == [(1,)]
    before = run_row(conn, "k-left")
    assert transition(conn, "k-left", owner, 1, "approved") == []
    assert run_row(conn, "k-left") == before


# --- payload hash -------------------------------------------------------------

@pytest.mark.parametrize("situation", ["live", "expired", "failed_retryable"])
def test_same_key_different_payload_is_refused(conn, situation):
    key = "k-mismatch-" + situation
    _, owner = claim(conn, key, payload_hash="hash-A")
    if situation == "expired":
        expire_lease(conn, key)
    elif situation == "failed_retryable":
        assert transition(conn, key, owner, 0, "failed_retryable") == [(1,)]
    before = run_row(conn, key)
    r, _ = claim(conn, key, payload_hash="hash-B")
    assert r["status"] == "payload_mismatch"
    assert r["lease_owner"] is None
    assert run_row(conn, key) == before
    assert run_row(conn, key)["payload_hash"] == "hash-A"


# --- re-run protocol ----------------------------------------------------------

@pytest.mark.parametrize("state", ["awaiting_human", "approved", "completed", "failed_terminal"])
def test_terminal_and_waiting_runs_are_not_rerun(conn, state):
    key = "k-done-" + state
    _, owner = claim(conn, key)
    assert transition(conn, key, owner, 0, state, {"answer": 42}) == [(1,)]
    # Even with the lease expired, a re-run from n8n's history only reports.
    expire_lease(conn, key)
    before = run_row(conn, key)
    r, _ = claim(conn, key)
    assert r["status"] == "done"
    assert r["state"] == state
    assert r["result"] == {"answer": 42}
    assert r["lease_owner"] is None
    assert run_row(conn, key) == before


def test_done_run_reports_current_state_on_duplicate_delivery(conn):
    r1, owner = claim(conn, "k-dup")
    transition(conn, "k-dup", owner, 0, "completed", {"reply": "sent"})
    for _ in range(3):
        r, _ = claim(conn, "k-dup")
        assert (r["status"], r["state"], r["result"]) == ("done", "completed", {"reply": "sent"})
    assert dict(query(conn, "SELECT outcome, count(*) FROM run_claims "
                            "WHERE idempotency_key = 'k-dup' GROUP BY outcome")) == \
        {"claimed": 1, "done": 3}


def test_claim_rejects_missing_arguments(conn):
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        claim(conn, "", "h")
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        claim(conn, "k", "h", lease=0)
    assert scalar(conn, "SELECT count(*) FROM workflow_runs") == 0


# --- enqueue, cancel, effect key ------------------------------------------------

ENQ = "SELECT effect_id, inserted, state, available_at FROM outbox_enqueue(%s, %s, %s, %s, %s, %s)"


def test_enqueue_twice_returns_the_same_effect(conn):
    key = make_run(conn)
    p = json.dumps({"body": {"n": 1}})
    (id1, ins1, st1, _), = query(conn, ENQ, (key, "http", "https://x.example/a", p, None, 0))
    (id2, ins2, st2, _), = query(conn, ENQ, (key, "http", "https://x.example/a", p, None, 0))
    assert ins1 is True and ins2 is False
    assert id1 == id2
    assert st1 == st2 == "pending"
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = %s",
                  (key,)) == 1


def test_enqueue_with_delay_is_not_due_yet(conn):
    key = make_run(conn)
    (eid, ins, _, _), = query(conn, ENQ, (key, "http", "https://x.example/a", "{}", None, 600))
    assert ins
    assert scalar(conn, "SELECT available_at > now() + interval '590 seconds' "
                        "FROM outbox_effects WHERE effect_id = %s", (eid,))


def test_cancel_pending_effect(conn):
    key = make_run(conn)
    (eid, _, _, _), = query(conn, ENQ, (key, "http", "https://x.example/a", "{}", None, 600))
    assert scalar(conn, "SELECT outbox_cancel(%s, %s, %s)", (eid, "customer changed mind", "ops")) \
        is True
    state, err, cls, done = query(conn, "SELECT state, last_error, last_error_class, "
                                        "completed_at IS NOT NULL FROM outbox_effects "
                                        "WHERE effect_id = %s", (eid,))[0]
    assert state == "failed"
    assert err.startswith("cancelled")
    assert "customer changed mind" in err
    assert cls == "cancelled" and done
    # The run does not wait forever for an effect that will never be sent.
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == "failed_terminal"
    assert query(conn, "SELECT operator, reason FROM operator_actions "
                       "WHERE action = 'cancel' AND effect_id = %s", (eid,)) == \
        [("ops", "customer changed mind")]
    # A second cancel finds nothing pending.
    assert scalar(conn, "SELECT outbox_cancel(%s)", (eid,)) is False


def claim_one(conn, owner):
    """The next due http effect claimed by owner (moved to `sending`)."""
    kill_switch(conn, True)
    return query(conn, "SELECT effect_id, attempts + 1 FROM outbox_claim(%s, 'w', 1, 30, '{http}', "
                       "true, '{}', %s)", (owner, str(uuid.uuid4())))[0]


def drive_to(conn, state):
    """The one effect enqueued moved to `state` by the workers' own functions."""
    owner = str(uuid.uuid4())
    eid, attempt = claim_one(conn, owner)
    if state != "sending":
        outcome = {"completed": "accepted", "unknown": "ambiguous", "pending": "retry"}[state]
        query(conn, "SELECT * FROM outbox_complete(%s, 'w', %s)",
              (owner, json.dumps([{"effect_id": str(eid), "attempt": attempt, "outcome": outcome,
                                   "next_state": state, "status": 200, "retry_delay_ms": 0}])))
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == state


@pytest.mark.parametrize("state", ["sending", "completed", "unknown"])
def test_cancel_refuses_non_pending_effect(conn, state):
    key = make_run(conn)
    (eid, _, _, _), = query(conn, ENQ, (key, "http", "https://x.example/a", "{}", None, 0))
    drive_to(conn, state)
    before = query(conn, "SELECT * FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert scalar(conn, "SELECT outbox_cancel(%s)", (eid,)) is False
    assert query(conn, "SELECT * FROM outbox_effects WHERE effect_id = %s", (eid,)) == before
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s",
                  (key,)) == "processing"
    assert scalar(conn, "SELECT count(*) FROM operator_actions") == 0


def test_cancel_of_unknown_effect_is_false(conn):
    assert scalar(conn, "SELECT outbox_cancel(%s)", (str(uuid.uuid4()),)) is False


def expected_effect_key(key, effect_type, target):
    return hashlib.sha256(f"{key}\n{effect_type}\n{target}".encode()).hexdigest()


def test_effect_key_differs_per_effect_and_is_stable(conn):
    key = make_run(conn)
    a = query(conn, ENQ, (key, "http", "https://x.example/a", "{}", None, 0))[0][0]
    b = query(conn, ENQ, (key, "email", "someone@example.com", "{}", None, 0))[0][0]
    c = query(conn, ENQ, (key, "http", "https://x.example/b", "{}", None, 0))[0][0]
    keys = dict(query(conn, "SELECT effect_id, effect_key FROM outbox_effects "
                            "WHERE idempotency_key = %s", (key,)))
    assert len(set(keys.values())) == 3
    assert keys[a] == expected_effect_key(key, "http", "https://x.example/a")
    assert keys[b] == expected_effect_key(key, "email", "someone@example.com")
    assert keys[c] == expected_effect_key(key, "http", "https://x.example/b")
    # Stable across attempts, leases and state changes of the same effect.
    for state in ("pending", "sending"):     # a retry, then the second attempt's claim
        # a first in the due order (the others are due too)
        query(conn, "UPDATE effect_live SET available_at = '-infinity' WHERE effect_id = %s", (a,))
        drive_to(conn, state)
        assert scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s",
                      (a,)) == keys[a]
    assert scalar(conn, "SELECT attempts FROM outbox_effects WHERE effect_id = %s", (a,)) == 2
    # The same (key, type, target) in another run key gets another effect key.
    other = make_run(conn)
    d = query(conn, ENQ, (other, "http", "https://x.example/a", "{}", None, 0))[0][0]
    assert scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (d,)) != keys[a]
