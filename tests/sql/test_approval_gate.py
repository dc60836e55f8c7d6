# SPDX-License-Identifier: ISC
"""The approval gate (sql/functions/10_triggers.sql), exercised as real LOGIN
members of the producer, dispatcher and operator roles.

An effect row is accepted only for a run in `processing`, or approved by
the same transaction (the lease holder's approve-by-exception, an
operator's replacement, or outbox_consume_approval with exactly the
effects the human saw).  Every run state x every insert path: plain
INSERT, outbox_enqueue, outbox_replace, outbox_requeue.
"""
import hashlib
import json
import secrets
import uuid

import psycopg2
import psycopg2.errors
import pytest

from outbox_test import make_run, query, scalar, wait_for

REFUSED = psycopg2.errors.ObjectNotInPrerequisiteState
STATES = ["processing", "awaiting_human", "approved", "completed", "failed_retryable",
          "failed_terminal"]


def run_in(conn, state):
    key = make_run(conn)
    query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s", (state, key))
    return key


def count(conn, key):
    return scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = %s", (key,))


PLAIN = ("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
         "VALUES (%s, 'http', %s, '{}')")
ENQ = "SELECT * FROM outbox_enqueue(%s, 'http', %s, '{}')"


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("path", ["plain", "enqueue"])
def test_producer_insert_paths_per_run_state(conn, login_as, state, path):
    p = login_as("outbox_producer")
    key = run_in(conn, state)
    sql = PLAIN if path == "plain" else ENQ
    if state == "processing":
        query(p, sql, (key, "https://hooks.example/a"))
        assert count(conn, key) == 1
        return
    with pytest.raises(REFUSED) as e:
        query(p, sql, (key, "https://hooks.example/a"))
    assert f'run "{key}" is {state}' in str(e.value)
    assert count(conn, key) == 0


@pytest.mark.parametrize("state", STATES)
def test_operator_plain_insert_is_gated_too(conn, login_as, state):
    o = login_as("outbox_operator")
    key = run_in(conn, state)
    if state == "processing":
        query(o, PLAIN, (key, "https://hooks.example/a"))
    else:
        with pytest.raises(REFUSED):
            query(o, PLAIN, (key, "https://hooks.example/a"))


def test_enqueue_repeat_after_the_run_moved_on_returns_the_existing_effect(conn, login_as):
    p = login_as("outbox_producer")
    key = make_run(conn)
    eid = query(p, ENQ, (key, "https://hooks.example/a"))[0][0]
    query(conn, "UPDATE workflow_runs SET state = 'completed' WHERE idempotency_key = %s", (key,))
    (again, inserted, _, _), = query(p, ENQ, (key, "https://hooks.example/a"))
    assert again == eid and inserted is False
    with pytest.raises(REFUSED):
        query(p, ENQ, (key, "https://hooks.example/b"))


def test_approve_by_exception_in_one_statement_still_enqueues(conn, login_as):
    p = login_as("outbox_producer")
    owner = str(uuid.uuid4())
    assert scalar(p, "SELECT status FROM outbox_claim_run('abe', 'h', %s, 300)", (owner,)) == "claimed"
    rows = query(p, "SELECT e.effect_id FROM outbox_transition_run('abe', %s, 0, 'approved') AS t "
                    "CROSS JOIN LATERAL outbox_enqueue('abe', 'http', 'https://x.example/', '{}') AS e",
                 (owner,))
    assert len(rows) == 1
    # A later statement (another transaction) adds nothing to the approved run.
    with pytest.raises(REFUSED):
        query(p, ENQ, ("abe", "https://x.example/2"))


def approval(conn, key, effects):
    owner = str(uuid.uuid4())
    assert scalar(conn, "SELECT status FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner)) == "claimed"
    token = secrets.token_urlsafe(32)
    h = hashlib.sha256(token.encode()).digest()
    query(conn, "SELECT * FROM outbox_create_approval(%s, %s, 0, %s, ARRAY['approve','reject'], "
                "3600, %s)", (key, owner, psycopg2.Binary(h), json.dumps(effects)))
    return owner, h


EFFECT = {"effect_type": "http", "target": "https://crm.example/notes", "payload": {"n": 1}}


def test_the_reviews_bypass_awaiting_human_and_rejected(conn, login_as):
    """As the producer, create an approval, then INSERT an
    effect; and again after the approval is rejected."""
    p = login_as("outbox_producer")
    owner, h = approval(p, "bypass", [EFFECT])
    for sql in (PLAIN, ENQ):
        with pytest.raises(REFUSED) as e:
            query(p, sql, ("bypass", "https://evil.example/"))
        assert 'run "bypass" is awaiting_human' in str(e.value)
    query(p, "SELECT * FROM outbox_consume_approval(%s, 'reject', 'bob')", (psycopg2.Binary(h),))
    for sql in (PLAIN, ENQ):
        with pytest.raises(REFUSED) as e:
            query(p, sql, ("bypass", "https://evil.example/"))
        assert 'run "bypass" is failed_terminal' in str(e.value)
    assert count(conn, "bypass") == 0


def test_consume_approval_enqueues_exactly_what_the_human_saw(conn, login_as):
    p = login_as("outbox_producer")
    _, h = approval(p, "ok", [EFFECT])
    # In the consuming transaction, nothing else may ride along.
    p.autocommit = False
    try:
        rows = query(p, "SELECT effect_id FROM outbox_consume_approval(%s, 'approve', 'alice')",
                     (psycopg2.Binary(h),))
        assert len(rows) == 1
        with pytest.raises(REFUSED) as e:
            query(p, PLAIN, ("ok", "https://evil.example/"))
        assert "approved by a human for its proposed effects only" in str(e.value)
    finally:
        p.rollback()
        p.autocommit = True
    assert count(conn, "ok") == 0
    rows = query(p, "SELECT effect_id FROM outbox_consume_approval(%s, 'approve', 'alice')",
                 (psycopg2.Binary(h),))
    assert len(rows) == 1 and count(conn, "ok") == 1
    with pytest.raises(REFUSED):
        query(p, PLAIN, ("ok", "https://evil.example/"))


def test_failed_terminal_cancels_pending_effects(conn, login_as):
    p = login_as("outbox_producer")
    owner = str(uuid.uuid4())
    scalar(p, "SELECT status FROM outbox_claim_run('ft', 'h', %s, 300)", (owner,))
    eid = query(p, ENQ, ("ft", "https://x.example/"))[0][0]
    assert query(p, "SELECT * FROM outbox_transition_run('ft', %s, 0, 'failed_terminal')", (owner,))
    st, cls, err = query(conn, "SELECT state, last_error_class, last_error FROM outbox_effects "
                               "WHERE effect_id = %s", (eid,))[0]
    assert (st, cls) == ("failed", "cancelled") and "failed_terminal" in err
    # And a rejection cancels what was enqueued before the approval.
    owner = str(uuid.uuid4())
    scalar(p, "SELECT status FROM outbox_claim_run('rj', 'h', %s, 300)", (owner,))
    early = query(p, ENQ, ("rj", "https://x.example/early"))[0][0]
    token = hashlib.sha256(b"t").digest()
    query(p, "SELECT * FROM outbox_create_approval('rj', %s, 0, %s, ARRAY['reject'], 60, '[]')",
          (owner, psycopg2.Binary(token)))
    query(p, "SELECT * FROM outbox_consume_approval(%s, 'reject', 'bob')", (psycopg2.Binary(token),))
    assert query(conn, "SELECT state, last_error FROM outbox_effects WHERE effect_id = %s",
                 (early,))[0] == ("failed", "cancelled: rejected by bob")


def failed_effect(conn, state):
    """A failed effect whose run is then put in `state`."""
    key = make_run(conn)
    eid = scalar(conn, PLAIN + " RETURNING effect_id", (key, "https://x.example/f"))
    # Finished: the live row goes, the history row that finishes it comes.
    query(conn, "WITH gone AS (DELETE FROM effect_live WHERE effect_id = %s RETURNING *) "
                "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "state, last_error_class, retry_base) "
                "SELECT effect_id, created_at, attempts, 'test', now(), 'failed', 'terminal', "
                "retry_base FROM gone", (eid,))
    query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s", (state, key))
    return key, eid


@pytest.mark.parametrize("state", STATES + ["rejected"])
@pytest.mark.parametrize("path", ["replace", "requeue"])
def test_operator_paths_per_run_state(conn, login_as, state, path):
    o = login_as("outbox_operator")
    key, eid = failed_effect(conn, "failed_terminal" if state == "rejected" else state)
    if state == "rejected":
        query(conn, "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, "
                    "expires_at, consumed_at, decision) VALUES (%s, %s, ARRAY['reject'], now(), "
                    "now(), 'reject')", (key, psycopg2.Binary(hashlib.sha256(key.encode()).digest())))
    if path == "replace":
        sql, args = ("SELECT status FROM outbox_replace(%s, %s, 'op', 'fix')",
                     (eid, key + "-new"))
    else:
        sql, args = "SELECT applied FROM outbox_requeue(%s, 'op', 'retry')", (eid,)
    if state in ("awaiting_human", "rejected"):
        with pytest.raises(REFUSED) as e:
            query(o, sql, args)
        assert f'run "{key}"' in str(e.value)
        assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == "failed"
        assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    else:
        assert scalar(o, sql, args) in ("created", True)


def test_requeue_failed_since_skips_rejected_runs(conn, login_as):
    o = login_as("outbox_operator")
    key, eid = failed_effect(conn, "failed_terminal")
    query(conn, "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, "
                "expires_at, consumed_at, decision) VALUES (%s, %s, ARRAY['reject'], now(), "
                "now(), 'reject')", (key, psycopg2.Binary(hashlib.sha256(b"x").digest())))
    _, ok = failed_effect(conn, "failed_terminal")
    rows = query(o, "SELECT effect_id::text FROM outbox_requeue_failed_since(now() - interval '1 hour', "
                    "'op', 'bulk')")
    assert rows == [(str(ok),)]


# --- cancel: who may, and who did -------------------------------------------------------

def test_cancel_is_limited_and_records_the_db_role(conn, login_as):
    p = login_as("outbox_producer")
    o = login_as("outbox_operator")
    owner = str(uuid.uuid4())
    scalar(p, "SELECT status FROM outbox_claim_run('c1', 'h', %s, 300)", (owner,))
    due = [query(p, ENQ, ("c1", f"https://x.example/{i}"))[0][0] for i in range(3)]
    window = query(p, "SELECT * FROM outbox_enqueue('c1', 'http', 'https://x.example/w', '{}', "
                      "NULL, 600)")[0][0]
    # Someone else's due effect: refused, whatever actor name is given.
    with pytest.raises(psycopg2.errors.InsufficientPrivilege) as e:
        query(p, "SELECT outbox_cancel(%s, 'x', 'operator:alice')", (due[0],))
    assert "lease holder" in str(e.value)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(p, "SELECT outbox_cancel(%s, %s, 'x', 'n8n')", (due[0], str(uuid.uuid4())))
    # The lease holder, the operator, and anyone inside the window may.
    assert scalar(p, "SELECT outbox_cancel(%s, %s, 'mine', 'n8n')", (due[0], owner)) is True
    assert scalar(o, "SELECT outbox_cancel(%s, 'ops', 'alice')", (due[1],)) is True
    assert scalar(p, "SELECT outbox_cancel(%s, 'window', 'n8n')", (window,)) is True
    roles = dict(query(conn, "SELECT effect_id::text, db_role FROM operator_actions "
                             "WHERE action = 'cancel'"))
    p_role = scalar(p, "SELECT session_user")
    o_role = scalar(o, "SELECT session_user")
    assert roles == {str(due[0]): p_role, str(due[1]): o_role, str(window): p_role}


def test_producer_cannot_read_lease_owners(conn, login_as):
    p = login_as("outbox_producer")
    d = login_as("outbox_dispatcher")
    make_run(conn, "lo")
    for c, sql in ((p, "SELECT lease_owner FROM workflow_runs"),
                   (p, "SELECT lease_owner FROM outbox_effects"),
                   (d, "SELECT lease_owner FROM outbox_effects")):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(c, sql)
    assert scalar(p, "SELECT state FROM workflow_runs WHERE idempotency_key = 'lo'") == "processing"


# --- the dispatcher records only what it leased -----------------------------------------

def leased_sending(conn, owner, n=1):
    key = make_run(conn)
    ids = [scalar(conn, PLAIN + " RETURNING effect_id", (key, f"https://x.example/{i}"))
           for i in range(n)]
    # As a claim leaves them: the live rows sending under one call.
    call = str(uuid.uuid4())
    query(conn, "UPDATE effect_live SET state = 'sending', attempts = 1, lease_owner = %s, "
                "lease_expires_at = now() + interval '1 hour', sending_since = now(), "
                "mark_token = %s WHERE effect_id = ANY (%s::uuid[])",
          (owner, call, [str(i) for i in ids]))
    query(conn, "INSERT INTO effect_calls (call, lease_owner, worker, ids, deadline) "
                "VALUES (%s, %s, 'w1', %s::uuid[], now() + interval '1 hour')",
          (call, owner, [str(i) for i in ids]))
    return ids


def result(eid, outcome="accepted", next_state="completed"):
    return {"effect_id": str(eid), "attempt": 1, "outcome": outcome, "next_state": next_state,
            "provider_id": "p-1"}


def test_dispatcher_cannot_add_attempts_for_effects_it_never_leased(conn, login_as):
    d = login_as("outbox_dispatcher")
    holder, stranger = str(uuid.uuid4()), str(uuid.uuid4())
    eid, = leased_sending(conn, holder)
    rows = query(d, "SELECT applied FROM outbox_complete(%s, 'evil', %s)",
                 (stranger, json.dumps([result(eid)])))
    assert rows == [(False,)]
    assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE effect_id = %s", (eid,)) == 0
    # A stranger cannot resolve it after the reaper moved the row either...
    query(conn, "UPDATE effect_live SET lease_expires_at = now() - interval '1 second' "
                "WHERE effect_id = %s", (eid,))
    query(conn, "UPDATE effect_calls SET deadline = now() - interval '1 second' "
                "WHERE %s = ANY (ids)", (eid,))
    assert query(d, "SELECT state FROM outbox_reap('r', 10)") == [("unknown",)]
    rows = query(d, "SELECT applied FROM outbox_complete(%s, 'evil', %s)",
                 (stranger, json.dumps([result(eid)])))
    assert rows == [(False,)]
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == "unknown"
    # ...while the holder's late acceptance is evidence that resolves it.
    rows = query(d, "SELECT applied FROM outbox_complete(%s, 'w1', %s)",
                 (holder, json.dumps([result(eid)])))
    assert rows == [(True,)]
    assert query(conn, "SELECT worker, outcome_class, cas_applied, resolution FROM effect_attempts "
                       "WHERE effect_id = %s ORDER BY attempt_id", (eid,)) == \
        [("reaper:r", "ambiguous", True, None), ("w1", "accepted", True, "late_accepted")]
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == "completed"


@pytest.mark.parametrize("name", ["", "HTTP", "a b", "x" * 33, "../x", "http\n"])
def test_register_providers_refuses_odd_names(conn, login_as, name):
    d = login_as("outbox_dispatcher")
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        query(d, "SELECT outbox_register_providers(%s, '{}')", ([name],))
    query(d, "SELECT outbox_register_providers(ARRAY['http', 'crm_v2'], '{}')")


def test_a_bulk_insert_never_scans_the_effects_from_an_empty_table(conn, login_as):
    """The insert's row checks run plans cached for the session.  None may
    scan effect_outbox: a plan made while the table was empty (just vacuumed,
    as a new database is) would scan it for every row as it grows, and a
    bulk insert would cost the square of its rows."""
    p = login_as("outbox_producer")
    n = 300
    owner = str(uuid.uuid4())
    assert scalar(p, "SELECT count(*) FROM generate_series(1, %s) g, "
                     "LATERAL outbox_claim_run('bulk-' || g, 'h', %s::uuid, 300) c "
                     "WHERE c.status = 'claimed'", (n, owner)) == n
    query(conn, "VACUUM ANALYZE effect_outbox")
    stats = ("SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0), n_tup_ins FROM pg_stat_user_tables "
             "WHERE relname = 'effect_outbox'")

    def counters():
        query(conn, "SELECT pg_stat_clear_snapshot()")
        return query(conn, stats)[0]
    seq0, idx0, ins0 = counters()
    # The first rows plan the gate's statements on the empty table; the
    # rest run those plans on a table that grows.
    query(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
             "SELECT 'bulk-' || g, 'http', 'https://x.example/', '{}' FROM generate_series(1, %s) g",
          (n,))
    query(p, "SELECT pg_stat_force_next_flush()")
    query(p, "SELECT 1")
    seq1, idx1, _ = wait_for(lambda: (lambda c: c if c[2] - ins0 >= n else None)(counters()),
                             what="the producer's inserts counted")
    assert seq1 - seq0 < 5, (seq1 - seq0, idx1 - idx0)
