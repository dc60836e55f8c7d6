# SPDX-License-Identifier: ISC
"""Least-privilege roles (sql/100_baseline.sql, sql/101_gate_and_evidence.sql), exercised by logging in as
real LOGIN members of each group role.

Roles are cluster-wide: each test creates uniquely named login roles and
drops them at the end.
"""
import json
import threading
import uuid

import psycopg2
import psycopg2.errors
import pytest

from outbox_test import kill_switch, make_run, query, scalar, wait_for

DENIED = psycopg2.errors.InsufficientPrivilege


def denied(c, sql, args=None):
    with pytest.raises(DENIED):
        query(c, sql, args)


def refused(c, sql, args=None):
    """A write through a read view (refused by the view itself or by the
    missing grant), or of a state column the producer's table does not
    have (the state lives in effect_live)."""
    with pytest.raises((DENIED, psycopg2.errors.FeatureNotSupported,
                        psycopg2.errors.ObjectNotInPrerequisiteState,
                        psycopg2.errors.UndefinedColumn)):
        query(c, sql, args)


# Every direct write to the tables an effect lives in (sql/105_live_queue.sql).
TABLE_WRITES = [
    "UPDATE effect_live SET state = 'unknown' WHERE effect_id = %(e)s",
    "UPDATE effect_live SET lease_owner = gen_random_uuid(), "
    "lease_expires_at = now() + interval '1 hour' WHERE effect_id = %(e)s",
    "DELETE FROM effect_live WHERE effect_id = %(e)s",
    "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at) "
    "VALUES (gen_random_uuid(), 'http', now(), now())",
    "UPDATE effect_outbox SET target = 'https://elsewhere.example/' WHERE effect_id = %(e)s",
    "DELETE FROM effect_outbox WHERE effect_id = %(e)s",
    "INSERT INTO effect_history (effect_id, created_at, attempt, started_at, state) "
    "VALUES (%(e)s, now(), 1, now(), 'completed')",
    "INSERT INTO effect_calls (call, lease_owner, ids, deadline) "
    "VALUES (gen_random_uuid(), gen_random_uuid(), ARRAY[%(e)s]::uuid[], now())",
]


def pending_effect(conn):
    key = make_run(conn)
    eid = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                       "VALUES (%s, 'http', 'https://x.example/', '{}') RETURNING effect_id", (key,))
    return key, eid


# --- producer -------------------------------------------------------------------

def test_producer_cannot_change_effect_states(conn, login_as):
    p = login_as("outbox_producer")
    key, eid = pending_effect(conn)
    before = query(conn, "SELECT * FROM outbox_effects WHERE effect_id = %s", (eid,))
    refused(p, "UPDATE outbox_effects SET state = 'completed' WHERE effect_id = %s", (eid,))
    refused(p, "UPDATE outbox_effects SET lease_owner = gen_random_uuid(), "
               "lease_expires_at = now() + interval '1 hour' WHERE effect_id = %s", (eid,))
    refused(p, "DELETE FROM outbox_effects WHERE effect_id = %s", (eid,))
    for sql in TABLE_WRITES:
        denied(p, sql, {"e": str(eid)})
    denied(p, "UPDATE workflow_runs SET state = 'completed' WHERE idempotency_key = %s", (key,))
    refused(p, "INSERT INTO effect_attempts (effect_id, attempt, started_at, outcome_class) "
              "VALUES (%s, 1, now(), 'accepted')", (eid,))
    # Nor can it insert an effect that starts in another state or with
    # dispatching columns set.
    refused(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, state) "
               "VALUES (%s, 'http', 'https://y.example/', '{}', 'completed')", (key,))
    refused(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, attempts) "
               "VALUES (%s, 'http', 'https://y.example/', '{}', 99)", (key,))
    denied(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, approved_by) "
              "VALUES (%s, 'http', 'https://y.example/', '{}', 'nobody')", (key,))
    assert query(conn, "SELECT * FROM outbox_effects WHERE effect_id = %s", (eid,)) == before
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1


def test_producer_cannot_read_token_hashes(conn, login_as):
    p = login_as("outbox_producer")
    owner = str(uuid.uuid4())
    query(p, "SELECT * FROM outbox_claim_run('k1', 'h', %s, 300)", (owner,))
    rows = query(p, "SELECT approval_id FROM outbox_create_approval('k1', %s, 0, "
                    "decode(repeat('ab', 32), 'hex'), ARRAY['approve'], 60, '[]')", (owner,))
    assert len(rows) == 1
    denied(p, "SELECT token_hash FROM approvals")
    denied(p, "SELECT * FROM approvals")
    denied(p, "SELECT count(*) FROM approvals WHERE token_hash = decode(repeat('ab', 32), 'hex')")
    # What an approval page needs is readable.
    assert query(p, "SELECT idempotency_key, consumed_at FROM approvals") == [("k1", None)]


def test_producer_plain_insert_and_duplicates(conn, login_as):
    p = login_as("outbox_producer")
    key = make_run(conn)
    ins = ("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
           "VALUES (%s, %s, %s, %s)")
    args = (key, "http", "https://hooks.example/a", json.dumps({"body": {"a": 1}}))
    query(p, ins, args)
    row = query(conn, "SELECT state, attempts, available_at <= now(), lease_owner, effect_key, "
                      "payload_hash FROM outbox_effects WHERE idempotency_key = %s", (key,))
    assert len(row) == 1
    state, attempts, due, owner, ekey, phash = row[0]
    assert (state, attempts, due, owner) == ("pending", 0, True, None)
    assert ekey and phash
    # A duplicate (key, type, target) is rejected by the unique constraint...
    with pytest.raises(psycopg2.errors.UniqueViolation):
        query(p, ins, args)
    with pytest.raises(psycopg2.errors.UniqueViolation):
        query(p, ins, (key, "http", "https://hooks.example/a", json.dumps({"other": True})))
    # ...and ON CONFLICT DO NOTHING makes an at-least-once producer's retry a no-op.
    with p.cursor() as cur:
        cur.execute(ins + " ON CONFLICT DO NOTHING", args)
        assert cur.rowcount == 0
        cur.execute(ins + " ON CONFLICT (idempotency_key, effect_type, target) DO NOTHING", args)
        assert cur.rowcount == 0
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    # Another target of the same run is another effect.
    query(p, ins, (key, "http", "https://hooks.example/b", "{}"))
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 2
    # No effect without its run: a producer login is refused by the row
    # policy (42501), before the foreign key would be.
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(p, ins, ("no-such-run", "http", "https://hooks.example/a", "{}"))


def test_producer_can_call_the_producer_functions(conn, login_as):
    p = login_as("outbox_producer")
    owner = str(uuid.uuid4())
    assert scalar(p, "SELECT status FROM outbox_claim_run('k2', 'h', %s, 300)", (owner,)) == "claimed"
    eid, inserted = query(p, "SELECT effect_id, inserted FROM outbox_enqueue('k2', 'http', "
                             "'https://x.example/', '{}', NULL, 60)")[0]
    assert inserted
    assert query(p, "SELECT * FROM outbox_transition_run('k2', %s, 0, 'approved')", (owner,)) == [(1,)]
    assert scalar(p, "SELECT outbox_cancel(%s, 'changed mind', 'n8n')", (eid,)) is True


DISPATCHER_CALLS = [
    "SELECT * FROM outbox_lease(gen_random_uuid(), 'w', 10, 30, ARRAY['http'], true)",
    "SELECT * FROM outbox_mark_sending(gen_random_uuid(), ARRAY[%s]::uuid[], true, ARRAY['http'], 30)",
    "SELECT * FROM outbox_complete(gen_random_uuid(), 'w', '[]')",
    "SELECT * FROM outbox_release(gen_random_uuid(), ARRAY[%s]::uuid[], 0)",
    "SELECT * FROM outbox_reap('w', 10)",
    "SELECT * FROM outbox_fail_invalid(gen_random_uuid(), '[]')",
]


def test_producer_cannot_call_kill_switch_or_dispatcher_functions(conn, login_as):
    p = login_as("outbox_producer")
    _, eid = pending_effect(conn)
    denied(p, "SELECT * FROM outbox_kill_switch_set(true, 'mallory', 'let it all out')")
    for sql in DISPATCHER_CALLS:
        denied(p, sql, (eid,) if "%s" in sql else None)
    assert scalar(conn, "SELECT enabled FROM outbox_control") is False
    # Beyond the calls above: no function outside the producer's own set.
    allowed = {"outbox_claim_run", "outbox_claim_run_status", "outbox_renew_run", "outbox_transition_run",
               "outbox_create_approval", "outbox_peek_approval", "outbox_consume_approval",
               "outbox_enqueue", "outbox_cancel",
               # the plain INSERT's row-level security checks
               "outbox_lock_run_for_effect", "outbox_metadata_ok", "outbox_metadata_max_bytes",
               # the n8n kit's cancel that says why not (25_kit.sql)
               "outbox_cancel_status",
               # pure, and needed by effect_outbox's generated columns for
               # the plain INSERT, and the effect id's default
               "outbox_sha256_hex", "outbox_new_effect_id"}
    executable = {r[0] for r in query(p, """
        SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'public' AND p.prokind = 'f'
           AND has_function_privilege(p.oid, 'EXECUTE')""")}
    assert executable <= allowed, executable - allowed
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == "pending"


def test_producer_cannot_flip_the_kill_switch_table(conn, login_as):
    p = login_as("outbox_producer")
    denied(p, "UPDATE outbox_control SET enabled = true")
    denied(p, "INSERT INTO outbox_control_history (enabled, changed_by, reason) "
              "VALUES (true, 'x', 'y')")
    assert scalar(conn, "SELECT enabled FROM outbox_control") is False


# --- dispatcher -------------------------------------------------------------------

def test_dispatcher_cannot_touch_approvals(conn, login_as):
    d = login_as("outbox_dispatcher")
    owner = str(uuid.uuid4())
    query(conn, "SELECT * FROM outbox_claim_run('k3', 'h', %s, 300)", (owner,))
    query(conn, "SELECT * FROM outbox_create_approval('k3', %s, 0, decode(repeat('cd', 32), 'hex'), "
                "ARRAY['approve'], 60, '[]')", (owner,))
    denied(d, "SELECT approval_id FROM approvals")
    denied(d, "SELECT count(*) FROM approvals")
    denied(d, "UPDATE approvals SET consumed_at = now()")
    denied(d, "SELECT * FROM outbox_peek_approval(decode(repeat('cd', 32), 'hex'))")
    denied(d, "SELECT * FROM outbox_consume_approval(decode(repeat('cd', 32), 'hex'), "
              "'approve', 'worker')")
    denied(d, "SELECT * FROM outbox_create_approval('k3', %s, 0, decode(repeat('ef', 32), 'hex'), "
              "ARRAY['approve'], 60, '[]')", (owner,))
    denied(d, "SELECT * FROM outbox_kill_switch_set(true, 'w', 'w')")
    assert scalar(conn, "SELECT consumed_at FROM approvals") is None


def test_dispatcher_cannot_write_tables_directly(conn, login_as):
    d = login_as("outbox_dispatcher")
    _, eid = pending_effect(conn)
    refused(d, "UPDATE outbox_effects SET state = 'completed' WHERE effect_id = %s", (eid,))
    denied(d, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
              "SELECT idempotency_key, 'http', 'https://z.example/', '{}' FROM outbox_effects")
    for sql in TABLE_WRITES:
        denied(d, sql, {"e": str(eid)})
    # It does its work through its functions (kill switch off: nothing leased).
    assert query(d, "SELECT * FROM outbox_lease(gen_random_uuid(), 'w', 10, 30, "
                    "ARRAY['http'], true)") == []


# --- operator ----------------------------------------------------------------------

def test_operator_flips_kill_switch_but_cannot_read_token_hashes(conn, login_as):
    o = login_as("outbox_operator")
    query(o, "SELECT * FROM outbox_kill_switch_set(true, 'op', 'go live')")
    assert scalar(conn, "SELECT enabled FROM outbox_control") is True
    denied(o, "SELECT token_hash FROM approvals")
    assert query(o, "SELECT approval_id, proposed_effects FROM approvals") == []


def test_dispatcher_cannot_forge_reconcile_evidence(conn, login_as, db):
    """Evidence only from the holder of the effect's reconcile lease: the
    worker login calling outbox_reconcile_record with an owner of its own
    choosing, about an unknown effect (unleased, or leased by another
    worker) or a uuid that names no effect, writes nothing and changes
    nothing; `outboxctl unknown list` still shows the real last attempt."""
    from outbox_test import run_ctl
    forger = login_as("outbox_dispatcher")
    holder = login_as("outbox_dispatcher")
    _, unleased = pending_effect(conn)
    _, leased = pending_effect(conn)
    query(conn, "UPDATE effect_live SET state = 'unknown', available_at = 'infinity', attempts = 1")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "outcome_class) SELECT effect_id, created_at, 1, 'w-real', now(), 'ambiguous' "
                "FROM effect_live")
    owner = str(uuid.uuid4())
    query(conn, "UPDATE effect_live SET lease_owner = %s, lease_expires_at = now() + interval '1 min' "
                "WHERE effect_id = %s", (owner, leased))
    for eid in (unleased, leased, str(uuid.uuid4())):
        forged = json.dumps([{"effect_id": eid, "verdict": "sent", "provider_id": "FORGED-ID",
                              "status": 200}])
        rows = query(forger, "SELECT effect_id::text, applied, state FROM "
                             "outbox_reconcile_record(gen_random_uuid(), 'forger', %s)", (forged,))
        assert rows == [(eid, False, None)]
    assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE worker = 'forger' "
                        "OR provider_id = 'FORGED-ID'") == 0
    assert query(conn, "SELECT state, provider_id FROM outbox_effects ORDER BY effect_id") == \
        [("unknown", None), ("unknown", None)]
    r = run_ctl(["--db", db, "unknown", "list"])
    assert r.returncode == 0, r.stderr
    assert "FORGED" not in r.stdout and "forger" not in r.stdout
    assert r.stdout.count("worker w-real, outcome ambiguous") == 2
    # The lease holder's answer is evidence, and resolves the effect.
    answer = json.dumps([{"effect_id": leased, "verdict": "sent", "provider_id": "P-1", "status": 200}])
    assert query(holder, "SELECT effect_id::text, applied, state FROM "
                         "outbox_reconcile_record(%s, 'w-real', %s)", (owner, answer)) == \
        [(leased, True, "completed")]
    assert query(conn, "SELECT outcome_class, provider_id, metadata FROM effect_attempts "
                       "WHERE effect_id = %s ORDER BY attempt_id", (leased,)) == \
        [("ambiguous", None, None), ("reconciled_sent", "P-1", None)]


# --- producer isolation -----------------------------------------------------------

def claim(c, key, owner, payload_hash="h"):
    return scalar(c, "SELECT status FROM outbox_claim_run(%s, %s, %s, 300)", (key, payload_hash, owner))


def test_two_producer_logins_cannot_read_or_act_on_each_others_runs(conn, login_as):
    """A run, its effects and its approvals belong to the producer login
    that claimed it: another producer login reads none of them and cannot
    enqueue into, claim, renew, transition, approve for or cancel it, even
    knowing the run's lease owner."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    oa, ob = str(uuid.uuid4()), str(uuid.uuid4())
    assert claim(a, "run-a", oa) == "claimed" and claim(b, "run-b", ob) == "claimed"
    secret = json.dumps({"headers": {"Authorization": "Bearer A-SECRET"}, "body": {}})
    query(a, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
             "VALUES ('run-a', 'http', 'https://a.example/', %s)", (secret,))
    delayed = scalar(a, "SELECT effect_id FROM outbox_enqueue('run-a', 'http', 'https://a.example/2', "
                        "'{}', NULL, 3600)")
    query(b, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
             "VALUES ('run-b', 'http', 'https://b.example/', '{}')")

    # Reads: each sees its own only.
    assert query(b, "SELECT idempotency_key FROM workflow_runs") == [("run-b",)]
    assert query(b, "SELECT idempotency_key FROM outbox_effects") == [("run-b",)]
    assert scalar(b, "SELECT count(*) FROM outbox_effects WHERE payload::text LIKE '%A-SECRET%'") == 0
    assert sorted(r[0] for r in query(a, "SELECT target FROM outbox_effects")) == \
        ["https://a.example/", "https://a.example/2"]

    # Enqueue into the other's processing run: neither path.
    # The answer is the one for a run that does not exist.
    for sql, refused in (("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                          "VALUES (%s, 'http', 'https://evil.example/', '{}')",
                          psycopg2.errors.InsufficientPrivilege),
                         ("SELECT * FROM outbox_enqueue(%s, 'http', 'https://evil.example/', '{}')",
                          psycopg2.errors.ForeignKeyViolation)):
        errors = []
        for key in ("run-a", "no-such-run"):
            with pytest.raises(refused) as ei:
                query(b, sql, (key,))
            errors.append(str(ei.value).replace(key, "K"))
        assert errors[0] == errors[1], errors
    # Claim, renew, transition, approve: nothing, even with the owner uuid;
    # the refused claim does not say whose the key is.
    with pytest.raises(DENIED) as ei:
        query(b, "SELECT * FROM outbox_claim_run('run-a', 'h', %s, 300)", (ob,))
    assert "not available to this login" in str(ei.value)
    assert scalar(b, "SELECT outbox_renew_run('run-a', %s, 0, 300)", (oa,)) is None
    assert query(b, "SELECT * FROM outbox_transition_run('run-a', %s, 0, 'failed_terminal')",
                 (oa,)) == []
    assert query(b, "SELECT * FROM outbox_create_approval('run-a', %s, 0, "
                    "decode(repeat('aa', 32), 'hex'), ARRAY['approve'], 60, '[]')", (oa,)) == []
    # Cancel the other's delayed effect: not found.
    assert scalar(b, "SELECT outbox_cancel(%s, 'mine now', 'b')", (delayed,)) is False
    assert query(b, "SELECT status, state FROM outbox_cancel_status(%s, 'mine now', 'b')",
                 (delayed,)) == [("not_found", None)]
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (delayed,)) == "pending"
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE target LIKE '%%evil%%'") == 0
    assert scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = 'run-a'") == "processing"

    # Approvals: the other login neither reads, peeks nor consumes them.
    effects = json.dumps([{"effect_type": "http", "target": "https://a.example/3", "payload": {}}])
    query(a, "SELECT * FROM outbox_create_approval('run-a', %s, 0, decode(repeat('ab', 32), 'hex'), "
             "ARRAY['approve', 'reject'], 60, %s)", (oa, effects))
    assert query(b, "SELECT approval_id FROM approvals") == []
    assert query(b, "SELECT * FROM outbox_peek_approval(decode(repeat('ab', 32), 'hex'))") == []
    assert query(b, "SELECT * FROM outbox_consume_approval(decode(repeat('ab', 32), 'hex'), "
                    "'reject', 'b')") == []
    assert scalar(conn, "SELECT consumed_at FROM approvals") is None
    assert len(query(a, "SELECT * FROM outbox_peek_approval(decode(repeat('ab', 32), 'hex'))")) == 1
    # The owner still does everything: consumes, cancels its delayed effect.
    rows = query(a, "SELECT decision, target FROM outbox_consume_approval("
                    "decode(repeat('ab', 32), 'hex'), 'approve', 'alice')")
    assert rows == [("approve", "https://a.example/3")]
    assert scalar(a, "SELECT outbox_cancel(%s, 'changed mind', 'a')", (delayed,)) is True

    # Workers and operators see every run's effects.
    d, o = login_as("outbox_dispatcher"), login_as("outbox_operator")
    assert scalar(d, "SELECT count(DISTINCT idempotency_key) FROM outbox_effects") == 2
    assert scalar(o, "SELECT count(*) FROM workflow_runs") == 2
    assert scalar(o, "SELECT count(*) FROM approvals") == 1


def test_one_shared_producer_login_keeps_every_run(conn, login_as):
    """One login for every workflow (the usual n8n credential): it claims,
    reads, enqueues into and cancels across all its runs, as before; runs
    with no owner (created before ownership, or by an administrator) are
    shared by every producer login."""
    p = login_as("outbox_producer")
    owners = [str(uuid.uuid4()) for _ in range(2)]
    for i, owner in enumerate(owners):
        assert claim(p, f"wf-{i}", owner) == "claimed"
        query(p, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                 "VALUES (%s, 'http', 'https://x.example/', '{}')", (f"wf-{i}",))
    assert scalar(p, "SELECT count(*) FROM outbox_effects") == 2
    eid = scalar(p, "SELECT effect_id FROM outbox_enqueue('wf-1', 'http', 'https://y.example/', "
                    "'{}', NULL, 60)")
    assert scalar(p, "SELECT outbox_cancel(%s, 'no', 'n8n')", (eid,)) is True
    shared = make_run(conn)
    other = login_as("outbox_producer")
    query(other, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                 "VALUES (%s, 'http', 'https://x.example/', '{}')", (shared,))
    assert query(other, "SELECT idempotency_key FROM workflow_runs") == [(shared,)]


def test_another_login_cannot_slip_an_effect_into_a_run_claimed_meanwhile(conn, login_as):
    """The plain INSERT checks the run it names with a fresh read, not the
    statement's snapshot: login B's INSERT that started before login A
    claimed key K (and so saw no run K) is refused once A's run exists,
    and A's own effect with the same type and target is A's."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    b_name = scalar(b, "SELECT session_user")
    outcome = {}

    def slow_insert():
        try:
            query(b, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                     "SELECT 'K', 'http', 'https://x.example/', '{\"from\": \"b\"}' FROM pg_sleep(2)")
            outcome["error"] = None
        except psycopg2.Error as e:
            outcome["error"] = e

    t = threading.Thread(target=slow_insert)
    t.start()
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE usename = %s "
                                  "AND state = 'active' AND query LIKE '%%pg_sleep%%'", (b_name,)) == 1,
             what="B's insert to be running")
    assert claim(a, "K", str(uuid.uuid4())) == "claimed"
    assert t.is_alive(), "B's insert ended before A's claim: the race was not exercised"
    t.join(timeout=30)
    assert isinstance(outcome["error"], psycopg2.errors.InsufficientPrivilege), outcome
    rows = query(a, "SELECT inserted, state FROM outbox_enqueue('K', 'http', 'https://x.example/', "
                    "'{\"from\": \"a\"}')")
    assert rows == [(True, "pending")]
    assert query(conn, "SELECT payload->>'from' FROM outbox_effects WHERE idempotency_key = 'K'") == \
        [("a",)]


def test_another_logins_effects_are_not_found_by_cancel_whatever_their_state(conn, login_as):
    """outbox_cancel and outbox_cancel_status answer for another login's
    effect exactly as for an effect that does not exist, pending or not."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    oa, ob = str(uuid.uuid4()), str(uuid.uuid4())
    assert claim(a, "run-a", oa) == "claimed" and claim(a, "run-a2", oa) == "claimed"
    pending = scalar(a, "SELECT effect_id FROM outbox_enqueue('run-a', 'http', 'https://a.example/', "
                        "'{}', NULL, 3600)")
    done = scalar(a, "SELECT effect_id FROM outbox_enqueue('run-a2', 'http', 'https://a.example/', "
                     "'{}', NULL, 3600)")
    assert scalar(a, "SELECT outbox_cancel(%s, 'changed mind', 'a')", (done,)) is True
    for eid in (pending, done, str(uuid.uuid4())):
        assert scalar(b, "SELECT outbox_cancel(%s, 'x', 'b')", (eid,)) is False, eid
        assert scalar(b, "SELECT outbox_cancel(%s, %s, 'x', 'b')", (eid, ob)) is False, eid
        assert query(b, "SELECT status, state, available_at FROM outbox_cancel_status(%s, 'x', 'b')",
                     (eid,)) == [("not_found", None, None)], eid
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (pending,)) == "pending"


@pytest.mark.parametrize("cancel", [
    "SELECT outbox_cancel(%s, 'x', 'b')",
    "SELECT * FROM outbox_cancel_status(%s, 'x', 'b')",
])
def test_another_logins_cancel_does_not_hold_the_effect(conn, login_as, cancel):
    """Another login's cancel attempt on an effect in flight, in a
    transaction it keeps open, locks nothing of it: the worker completes it
    without waiting (lock_timeout on its side would say otherwise)."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    d = login_as("outbox_dispatcher")
    assert claim(a, "run-a", str(uuid.uuid4())) == "claimed"
    eid = scalar(a, "SELECT effect_id FROM outbox_enqueue('run-a', 'http', 'https://a.example/', '{}')")
    kill_switch(conn, True)
    worker = str(uuid.uuid4())
    assert [r[0] for r in query(d, "SELECT effect_id FROM outbox_lease(%s, 'w', 10, 30, "
                                   "ARRAY['http'], true)", (worker,))] == [eid]
    assert [r[0] for r in query(d, "SELECT effect_id FROM outbox_mark_sending(%s, ARRAY[%s]::uuid[], "
                                   "true, ARRAY['http'], 30)", (worker, eid))] == [eid]
    b.autocommit = False
    try:
        with b.cursor() as cur:
            cur.execute(cancel, (eid,))
        query(d, "SET lock_timeout = '500ms'")
        done = [{"effect_id": eid, "attempt": 1, "outcome": "accepted", "next_state": "completed",
                 "provider_id": "p-1"}]
        assert query(d, "SELECT applied FROM outbox_complete(%s, 'w', %s)",
                     (worker, json.dumps(done))) == [(True,)]
    finally:
        b.rollback()
        b.autocommit = True
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == "completed"
