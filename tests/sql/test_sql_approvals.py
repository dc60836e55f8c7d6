# SPDX-License-Identifier: ISC
"""Approvals (sql/functions/20_producer.sql): only the token's SHA-256 is stored, a
token is consumed once, and consuming it moves the run and enqueues the
effects in one transaction or not at all.
"""
import hashlib
import json
import secrets
import threading
import uuid

import psycopg2
import pytest

from outbox_test import connect, query, scalar

EFFECTS = [
    {"effect_type": "email", "target": "lead@example.com",
     "payload": {"from": "sales@example.com", "subject": "Re: your request", "text": "Hi"},
     "metadata": {"workflow_version": "w1", "model": "m-1"}},
    {"effect_type": "http", "target": "https://crm.example/notes",
     "payload": {"body": {"note": "replied"}}, "metadata": {"workflow_version": "w1"}},
]

CONSUME = "SELECT idempotency_key, decision, effect_id, effect_type, target " \
          "FROM outbox_consume_approval(%s, %s, %s)"


def token_pair():
    token = secrets.token_urlsafe(32)   # 256 bits of randomness
    return token, hashlib.sha256(token.encode()).digest()


def awaiting(conn, key=None, effects=None, decisions=("approve", "reject"), expires=3600):
    """Claim a run and move it to awaiting_human with an approval; returns
    (key, raw token, token hash)."""
    key = key or "run-" + uuid.uuid4().hex[:10]
    owner = str(uuid.uuid4())
    st, = query(conn, "SELECT status FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner))[0]
    assert st == "claimed"
    token, h = token_pair()
    rows = query(conn, "SELECT approval_id, expires_at, version FROM outbox_create_approval("
                       "%s, %s, 0, %s, %s, %s, %s, %s, %s)",
                 (key, owner, psycopg2.Binary(h), list(decisions), expires,
                  json.dumps(EFFECTS if effects is None else effects), "ops@example.com",
                  json.dumps({"draft": "Hi"})))
    assert len(rows) == 1 and rows[0][2] == 1, rows
    return key, token, h


def consume(conn, h, decision="approve", approver="alice@example.com"):
    return query(conn, CONSUME, (psycopg2.Binary(h), decision, approver))


def snapshot(conn, key):
    return (query(conn, "SELECT * FROM approvals WHERE idempotency_key = %s ORDER BY approval_id",
                  (key,)),
            query(conn, "SELECT * FROM workflow_runs WHERE idempotency_key = %s", (key,)),
            query(conn, "SELECT * FROM outbox_effects WHERE idempotency_key = %s ORDER BY effect_id",
                  (key,)))


def n_effects(conn, key=None):
    if key is None:
        return scalar(conn, "SELECT count(*) FROM outbox_effects")
    return scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = %s", (key,))


def approval(conn, key):
    rows = query(conn, "SELECT consumed_at, decision, approver_subject FROM approvals "
                       "WHERE idempotency_key = %s", (key,))
    assert len(rows) == 1
    return dict(zip(("consumed_at", "decision", "approver_subject"), rows[0]))


def run_state(conn, key):
    return scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,))


# --- storage ------------------------------------------------------------------

def test_only_the_sha256_of_the_token_is_stored(conn):
    key, token, h = awaiting(conn)
    stored = scalar(conn, "SELECT token_hash FROM approvals WHERE idempotency_key = %s", (key,))
    assert bytes(stored) == hashlib.sha256(token.encode()).digest()
    # The raw token is nowhere in the approval, the run or the outbox,
    # neither as text nor hex-encoded.
    for table in ("approvals", "workflow_runs", "outbox_effects", "run_claims"):
        dump = scalar(conn, f"SELECT coalesce(string_agg(t::text, ' '), '') FROM {table} t")
        assert token not in dump, table
        assert token.encode().hex() not in dump, table


def test_create_approval_refuses_anything_but_a_32_byte_hash(conn):
    key = "run-rawtoken"
    owner = str(uuid.uuid4())
    query(conn, "SELECT * FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner))
    token = secrets.token_urlsafe(32)
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        query(conn, "SELECT * FROM outbox_create_approval(%s, %s, 0, %s, ARRAY['approve'], "
                    "60, '[]')", (key, owner, psycopg2.Binary(token.encode())))
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert run_state(conn, key) == "processing"


def test_create_approval_by_a_stale_owner_creates_nothing(conn):
    key = "run-stale"
    owner = str(uuid.uuid4())
    query(conn, "SELECT * FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner))
    _, h = token_pair()
    rows = query(conn, "SELECT * FROM outbox_create_approval(%s, %s, 0, %s, ARRAY['approve'], "
                       "60, '[]')", (key, str(uuid.uuid4()), psycopg2.Binary(h)))
    assert rows == []
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert run_state(conn, key) == "processing"


# --- peek -----------------------------------------------------------------------

def test_peek_shows_without_changing_anything(conn):
    key, token, h = awaiting(conn)
    before = snapshot(conn, key)
    rows = query(conn, "SELECT * FROM outbox_peek_approval(%s)", (psycopg2.Binary(h),))
    assert len(rows) == 1
    k, decisions, expires_at, audience, effects, state = rows[0]
    assert (k, decisions, audience, state) == (key, ["approve", "reject"], "ops@example.com",
                                               "awaiting_human")
    assert effects == EFFECTS
    # Peeking twice is the same; nothing was consumed, moved or enqueued.
    assert query(conn, "SELECT * FROM outbox_peek_approval(%s)", (psycopg2.Binary(h),)) == rows
    assert snapshot(conn, key) == before
    # The page cannot learn the hash back.
    with conn.cursor() as cur:
        cur.execute("SELECT * FROM outbox_peek_approval(%s)", (psycopg2.Binary(h),))
        cols = [d[0] for d in cur.description]
    assert "token_hash" not in cols and "approval_id" not in cols
    # A wrong token shows nothing.
    assert query(conn, "SELECT * FROM outbox_peek_approval(%s)",
                 (psycopg2.Binary(token_pair()[1]),)) == []


def test_peek_shows_nothing_once_used_or_expired(conn):
    key, _, h = awaiting(conn)
    consume(conn, h)
    assert query(conn, "SELECT * FROM outbox_peek_approval(%s)", (psycopg2.Binary(h),)) == []
    key2, _, h2 = awaiting(conn)
    query(conn, "UPDATE approvals SET expires_at = now() - interval '1 second' "
                "WHERE idempotency_key = %s", (key2,))
    assert query(conn, "SELECT * FROM outbox_peek_approval(%s)", (psycopg2.Binary(h2),)) == []


# --- consume: approve -------------------------------------------------------------

def test_approve_enqueues_effects_in_the_same_transaction(conn):
    key, _, h = awaiting(conn)
    rows = consume(conn, h, "approve", "alice@example.com")
    assert len(rows) == 2
    assert {(r[0], r[1], r[3], r[4]) for r in rows} == {
        (key, "approve", "email", "lead@example.com"),
        (key, "approve", "http", "https://crm.example/notes")}
    effects = query(conn, "SELECT effect_id, state, approved_by, metadata, payload, created_at "
                          "FROM outbox_effects WHERE idempotency_key = %s ORDER BY effect_type",
                    (key,))
    assert {e[0] for e in effects} == {r[2] for r in rows}
    assert all(e[1] == "pending" and e[2] == "alice@example.com" for e in effects)
    assert effects[0][3] == EFFECTS[0]["metadata"] and effects[0][4] == EFFECTS[0]["payload"]
    a = approval(conn, key)
    assert a["decision"] == "approve" and a["approver_subject"] == "alice@example.com"
    assert run_state(conn, key) == "approved"
    # One transaction: now() is the same for the consumed approval, the run
    # update and every inserted effect.
    run_updated = scalar(conn, "SELECT updated_at FROM workflow_runs WHERE idempotency_key = %s",
                         (key,))
    assert a["consumed_at"] == run_updated == effects[0][5] == effects[1][5]


def test_consume_then_rollback_leaves_nothing(db, conn):
    """The caller's transaction is the unit: rolled back, nothing of the
    consume survives (the token is still usable)."""
    key, _, h = awaiting(conn)
    c = psycopg2.connect(db)
    try:
        assert len(consume(c, h)) == 2
        c.rollback()
    finally:
        c.close()
    assert approval(conn, key)["consumed_at"] is None
    assert run_state(conn, key) == "awaiting_human"
    assert n_effects(conn, key) == 0
    assert len(consume(conn, h)) == 2


def test_token_is_consumed_once(conn):
    key, _, h = awaiting(conn)
    assert len(consume(conn, h, "approve", "alice@example.com")) == 2
    after_first = snapshot(conn, key)
    # A second consume (replayed link, double click, another approver)
    # returns nothing and enqueues nothing, whatever the decision.
    assert consume(conn, h, "approve", "alice@example.com") == []
    assert consume(conn, h, "reject", "mallory@example.com") == []
    assert snapshot(conn, key) == after_first
    assert n_effects(conn, key) == 2
    # The token itself is spent, not only the run's state: even with the
    # run awaiting a human again (a later approval round), the old token
    # does nothing.
    query(conn, "UPDATE workflow_runs SET state = 'awaiting_human' WHERE idempotency_key = %s",
          (key,))
    again = snapshot(conn, key)
    assert consume(conn, h, "reject", "mallory@example.com") == []
    assert consume(conn, h, "approve", "mallory@example.com") == []
    assert snapshot(conn, key) == again
    assert approval(conn, key)["approver_subject"] == "alice@example.com"


def test_concurrent_consumes_enqueue_once(db, conn):
    key, _, h = awaiting(conn)
    n = 6
    conns = [connect(db) for _ in range(n)]
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def worker(i):
        try:
            barrier.wait(timeout=30)
            results[i] = consume(conns[i], h, "approve", f"approver-{i}")
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in conns:
        c.close()
    assert not errors, errors
    assert sorted(len(r) for r in results) == [0] * (n - 1) + [2]
    assert n_effects(conn, key) == 2


# --- consume: nothing happens ---------------------------------------------------------

def assert_nothing_consumed(conn, key, before):
    assert snapshot(conn, key) == before
    assert approval(conn, key)["consumed_at"] is None
    assert n_effects(conn, key) == 0


def test_expired_token_consumes_nothing(conn):
    key, _, h = awaiting(conn)
    query(conn, "UPDATE approvals SET expires_at = now() - interval '1 second' "
                "WHERE idempotency_key = %s", (key,))
    before = snapshot(conn, key)
    assert consume(conn, h) == []
    assert consume(conn, h, "reject") == []
    assert_nothing_consumed(conn, key, before)
    assert run_state(conn, key) == "awaiting_human"


@pytest.mark.parametrize("decision", ["reject", "delete", "", "APPROVE"])
def test_decision_not_allowed_consumes_nothing(conn, decision):
    key, _, h = awaiting(conn, decisions=("approve",))
    before = snapshot(conn, key)
    assert consume(conn, h, decision) == []
    assert_nothing_consumed(conn, key, before)
    # The token is still good for an allowed decision.
    assert len(consume(conn, h, "approve")) == 2


@pytest.mark.parametrize("state", ["processing", "approved", "completed", "failed_retryable",
                                   "failed_terminal"])
def test_run_not_awaiting_human_consumes_nothing(conn, state):
    key, _, h = awaiting(conn)
    query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s", (state, key))
    before = snapshot(conn, key)
    assert consume(conn, h, "approve") == []
    assert consume(conn, h, "reject") == []
    assert_nothing_consumed(conn, key, before)
    assert run_state(conn, key) == state


def test_unknown_token_consumes_nothing(conn):
    key, _, _ = awaiting(conn)
    before = snapshot(conn, key)
    assert consume(conn, token_pair()[1]) == []
    assert consume(conn, b"\x00" * 32) == []
    assert_nothing_consumed(conn, key, before)


def test_approver_must_be_named(conn):
    key, _, h = awaiting(conn)
    before = snapshot(conn, key)
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        consume(conn, h, "approve", "")
    assert_nothing_consumed(conn, key, before)


# --- reject -----------------------------------------------------------------------------

def test_reject_fails_the_run_and_enqueues_nothing(conn):
    key, _, h = awaiting(conn)
    rows = consume(conn, h, "reject", "bob@example.com")
    assert rows == [(key, "reject", None, None, None)]
    state, reason = query(conn, "SELECT state, failure_reason FROM workflow_runs "
                                "WHERE idempotency_key = %s", (key,))[0]
    assert state == "failed_terminal"
    assert "bob@example.com" in reason
    a = approval(conn, key)
    assert a["decision"] == "reject" and a["approver_subject"] == "bob@example.com"
    assert a["consumed_at"] is not None
    assert n_effects(conn, key) == 0
    # Rejected is final: the token is spent.
    assert consume(conn, h, "approve") == []
    assert n_effects(conn, key) == 0


def test_approve_with_no_effects_completes_the_run(conn):
    key, _, h = awaiting(conn, effects=[])
    assert consume(conn, h, "approve") == [(key, "approve", None, None, None)]
    assert run_state(conn, key) == "completed"
    assert approval(conn, key)["consumed_at"] is not None
    assert n_effects(conn, key) == 0


# --- a failing step rolls everything back --------------------------------------------------

def test_create_approval_refuses_colliding_effects(conn):
    dup = [EFFECTS[0], dict(EFFECTS[0], payload={"text": "other"})]
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        awaiting(conn, key="run-dup", effects=dup)
    assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert run_state(conn, "run-dup") == "processing"


def test_failure_while_enqueuing_rolls_back_the_consume(conn):
    key, _, h = awaiting(conn)
    # An approval whose effects collide on (effect_type, target), so the
    # INSERT into outbox_effects fails after the token was marked consumed
    # and the run was set approved (written directly: creating it through
    # the function is refused, see above).
    dup = [EFFECTS[0], dict(EFFECTS[0], payload={"text": "other"})]
    query(conn, "UPDATE approvals SET proposed_effects = %s WHERE idempotency_key = %s",
          (json.dumps(dup), key))
    before = snapshot(conn, key)
    with pytest.raises(psycopg2.errors.UniqueViolation):
        consume(conn, h, "approve")
    assert_nothing_consumed(conn, key, before)
    assert run_state(conn, key) == "awaiting_human"
    assert n_effects(conn) == 0


def test_failure_on_a_later_effect_rolls_back_earlier_ones(conn):
    key, _, h = awaiting(conn)
    # The second effect's payload is SQL NULL: the first row goes in, the
    # second violates NOT NULL, and the first must not survive.
    bad = [EFFECTS[0], {"effect_type": "http", "target": "https://crm.example/x"}]
    query(conn, "UPDATE approvals SET proposed_effects = %s WHERE idempotency_key = %s",
          (json.dumps(bad), key))
    before = snapshot(conn, key)
    with pytest.raises(psycopg2.errors.NotNullViolation):
        consume(conn, h, "approve")
    assert_nothing_consumed(conn, key, before)
    assert run_state(conn, key) == "awaiting_human"
