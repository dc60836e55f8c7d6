# SPDX-License-Identifier: ISC
"""Producer isolation as an attacker holding a second producer login
tries it: no producer function locks another login's run (ownership is
checked before any lock), the approval gate answers another login's run
exactly as a missing one, the metadata bound counts real bytes, and the
producer's cancel window is the producer's whatever an operator paused.

Every test logs in as real LOGIN members of outbox_producer (A, the
victim, and B), created per test and dropped after it.
"""
import json
import uuid

import psycopg2
import psycopg2.errors
import pytest

from outbox_test import query, scalar, wait_for

TOKEN = "decode(repeat('ab', 32), 'hex')"


def claim(c, key, owner):
    return scalar(c, "SELECT status FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner))


# What B runs on A's run 'run-a', in a transaction B keeps open.
ATTACKS = {
    "renew": "SELECT outbox_renew_run('run-a', gen_random_uuid(), 0, 30)",
    "create_approval": "SELECT * FROM outbox_create_approval('run-a', gen_random_uuid(), 0, "
                       "decode(repeat('cd', 32), 'hex'), ARRAY['approve'], 60, '[]')",
    "transition": "SELECT * FROM outbox_transition_run('run-a', gen_random_uuid(), 0, "
                  "'failed_terminal')",
    "claim_status": "SELECT * FROM outbox_claim_run_status('run-a', 'h', gen_random_uuid(), 30)",
    "insert": "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
              "VALUES ('run-a', 'http', 'https://b.example/', '{}')",
    "claim": "SELECT * FROM outbox_claim_run('run-a', 'h', gen_random_uuid(), 30)",
    # The approval's token leaked to B: still nothing of A's is locked.
    "peek": f"SELECT * FROM outbox_peek_approval({TOKEN})",
    "consume": f"SELECT * FROM outbox_consume_approval({TOKEN}, 'reject', 'mallory')",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_another_login_locks_nothing_of_a_run_it_does_not_own(conn, login_as, attack):
    """outbox_renew_run and outbox_create_approval locked the run row
    (the settle's FOR UPDATE) before they checked ownership, and returned
    an empty answer: B's open transaction kept A's run locked, and A's
    next step waited for as long as B liked.  Now every producer function
    answers B without locking anything of A's: A's steps, under a 500 ms
    lock timeout, go through while B's transaction stays open."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    oa = str(uuid.uuid4())
    assert claim(a, "run-a", oa) == "claimed"
    effects = json.dumps([{"effect_type": "http", "target": "https://a.example/1", "payload": {}}])
    if attack in ("peek", "consume"):
        assert len(query(a, "SELECT * FROM outbox_create_approval('run-a', %s, 0, "
                            f"{TOKEN}, ARRAY['approve', 'reject'], 60, %s)",
                         (oa, effects))) == 1
    b.autocommit = False
    try:
        with b.cursor() as cur:
            try:
                cur.execute(ATTACKS[attack])
                rows = cur.fetchall()
            except psycopg2.Error:
                rows = None          # an error ends B's transaction: nothing held
        assert rows in (None, [], [(None,)], [("unavailable", "run-a", None, None, None, None)]), rows
        query(a, "SET lock_timeout = '500ms'")
        if attack in ("peek", "consume"):
            got = query(a, f"SELECT decision FROM outbox_consume_approval({TOKEN}, 'approve', 'alice')")
            assert got == [("approve",)]
        else:
            assert scalar(a, "SELECT outbox_renew_run('run-a', %s, 0, 60)", (oa,)) == 0
            assert query(a, "SELECT * FROM outbox_enqueue('run-a', 'http', 'https://a.example/2', "
                            "'{}')")[0][1] is True
            assert query(a, "SELECT * FROM outbox_transition_run('run-a', %s, 0, 'approved')",
                         (oa,)) == [(1,)]
    finally:
        b.rollback()
        b.autocommit = True
        query(a, "RESET lock_timeout")
    # B's attempt changed nothing and recorded no claim of A's key.
    assert scalar(conn, "SELECT count(*) FROM run_claims WHERE idempotency_key = 'run-a'") == 1


def test_the_claim_status_of_another_logins_key_is_unavailable_and_says_nothing_of_it(conn, login_as):
    """The kit's claim: a key another producer login holds is answered
    `unavailable` (a retry can never succeed) with nothing of that run,
    exactly as for each of its states; outbox_claim_run keeps its 42501."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    oa = str(uuid.uuid4())
    answers = set()
    for key, state in (("k-proc", None), ("k-done", "completed"), ("k-wait", "awaiting_human")):
        assert claim(a, key, oa) == "claimed"
        if state:
            query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s", (state, key))
        got = query(b, "SELECT * FROM outbox_claim_run_status(%s, 'h', %s, 30)",
                    (key, str(uuid.uuid4())))
        answers.add(tuple(x if x != key else "K" for x in got[0]))
        assert len(got) == 1
    assert answers == {("unavailable", "K", None, None, None, None)}, answers
    with pytest.raises(psycopg2.errors.InsufficientPrivilege) as ei:
        query(b, "SELECT * FROM outbox_claim_run('k-proc', 'h', %s, 30)", (str(uuid.uuid4()),))
    assert "not available to this login" in str(ei.value)
    # The owner's own claims answer as before.
    assert query(a, "SELECT status FROM outbox_claim_run_status('k-proc', 'h', %s, 30)",
                 (str(uuid.uuid4()),)) == [("busy",)]
    assert query(a, "SELECT status FROM outbox_claim_run_status('k-new', 'h', %s, 30)",
                 (str(uuid.uuid4()),)) == [("claimed",)]
    assert scalar(conn, "SELECT count(*) FROM run_claims WHERE outcome NOT IN ('claimed', 'busy')") == 0


def error_of(c, sql, args, key):
    with pytest.raises(psycopg2.Error) as ei:
        query(c, sql, args)
    e = ei.value
    return (e.pgcode, (e.pgerror or "").replace(key, "K"),
            e.diag.message_detail, e.diag.message_hint)


def test_the_gate_answers_another_logins_run_exactly_as_a_missing_one(conn, login_as):
    """The approval gate runs before row-level security: B's plain INSERT
    into A's run that is no longer processing answered 55000 naming its
    state, and 42501 only when the (type, target) was already in it, so B
    could learn a run's state and test "did run X email bob@...".  Now
    every INSERT naming a run that is not B's gets the answer of a key that
    names no run, in SQLSTATE and text, and never waits for A's locks."""
    a, b = login_as("outbox_producer"), login_as("outbox_producer")
    oa = str(uuid.uuid4())
    ins = ("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
           "VALUES (%s, 'email', %s, '{}')")
    keys = {}
    for state in ("processing", "completed", "awaiting_human", "failed_terminal", "approved"):
        key = f"run-a-{state}"
        assert claim(a, key, oa) == "claimed"
        query(a, ins, (key, "bob@example.com"))
        if state != "processing":
            query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s", (state, key))
        keys[state] = key
    missing = error_of(b, ins, ("no-such-run", "bob@example.com"), "no-such-run")
    assert missing[0] == "42501", missing
    for state, key in keys.items():
        for target in ("bob@example.com", "carol@example.com"):
            got = error_of(b, ins, (key, target), key)
            assert got == missing, (state, target, got, missing)
            got = error_of(b, ins + " ON CONFLICT DO NOTHING", (key, target), key)
            assert got[:2] == missing[:2], (state, target, got)
    # A state change holds the run's row lock: B's insert does not wait for it.
    locker = psycopg2.connect(conn.dsn)
    try:
        with locker.cursor() as cur:
            cur.execute("SELECT 1 FROM workflow_runs WHERE idempotency_key = %s FOR UPDATE",
                        (keys["completed"],))
        query(b, "SET lock_timeout = '300ms'")
        assert error_of(b, ins, (keys["completed"], "dave@example.com"), keys["completed"]) == missing
    finally:
        locker.rollback()
        locker.close()
        query(b, "RESET lock_timeout")
    # A's own inserts still meet the gate, with its state named.
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as ei:
        query(a, ins, (keys["completed"], "carol@example.com"))
    assert "is completed" in str(ei.value)
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == len(keys)


def test_the_metadata_bound_counts_real_bytes_not_compressed_ones(conn, login_as):
    """pg_column_size is the compressed size of a value read from a table:
    12 MiB of jsonb kept in the producer's own temporary table (lz4) went in
    whole through INSERT ... SELECT.  Every way in now measures the text."""
    a = login_as("outbox_producer")
    assert claim(a, "meta", str(uuid.uuid4())) == "claimed"
    query(a, "CREATE TEMP TABLE big (m jsonb COMPRESSION lz4)")
    query(a, "INSERT INTO big SELECT jsonb_build_object('model', 'm', 'blob', repeat('x', 12 << 20))")
    stored = scalar(a, "SELECT pg_column_size(m) FROM big")
    assert stored < 65536, f"the arrangement needs a small stored size, got {stored}"
    size = (12 << 20) + len('{"blob": "", "model": "m"}')
    attempts = [
        "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
        "SELECT 'meta', 'http', 'https://x.example/1', '{}', m FROM big",
        "SELECT * FROM outbox_enqueue('meta', 'http', 'https://x.example/2', '{}', "
        "(SELECT m FROM big))",
        "SELECT * FROM outbox_create_approval('meta', gen_random_uuid(), 0, "
        f"{TOKEN}, ARRAY['approve'], 60, "
        "(SELECT jsonb_build_array(jsonb_build_object('effect_type', 'http', 'target', "
        "'https://x.example/3', 'payload', '{}'::jsonb, 'metadata', m)) FROM big))",
    ]
    for sql in attempts:
        with pytest.raises(psycopg2.Error) as ei:
            query(a, sql)
        assert ei.value.pgcode == "54000", (sql, ei.value)
        assert f"metadata is {size} bytes" in str(ei.value), str(ei.value)
    assert scalar(conn, "SELECT count(*) FROM effect_outbox") == 0
    # Just under the bound, as text, goes in from a table too.
    query(a, "TRUNCATE big")
    query(a, "INSERT INTO big SELECT jsonb_build_object('n', repeat('y', 65536 - 9))")
    assert scalar(a, "SELECT octet_length(m::text) FROM big") == 65536
    query(a, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
             "SELECT 'meta', 'http', 'https://x.example/4', '{}', m FROM big")
    query(a, "UPDATE big SET m = jsonb_build_object('n', repeat('y', 65536 - 8))")
    with pytest.raises(psycopg2.errors.ProgramLimitExceeded):
        query(a, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, metadata) "
                 "SELECT 'meta', 'http', 'https://x.example/5', '{}', m FROM big")
    query(a, "DROP TABLE big")


def park(conn, eid):
    """What a worker does to a due effect of a paused scope."""
    query(conn, "UPDATE effect_live SET available_at = 'infinity', held_by = 'host:a.example' "
                "WHERE effect_id = %s", (eid,))


def test_a_pause_does_not_reopen_the_producers_cancel_window(conn, login_as):
    """A pause parks a due effect at available_at 'infinity', and the
    cancel refused only when available_at <= now(): 25 s after a 20 s
    window, the kit's cancel answered `cancelled`.  The window closes at
    the effect's first due time, whatever the operator paused; before it
    closes, a parked effect is cancelled as ever; the operator may cancel
    at any time."""
    a = login_as("outbox_producer")
    o = login_as("outbox_operator")
    oa = str(uuid.uuid4())
    assert claim(a, "win", oa) == "claimed"
    due = scalar(a, "SELECT effect_id FROM outbox_enqueue('win', 'http', 'https://a.example/1', "
                    "'{}', NULL, 1)")
    later = scalar(a, "SELECT effect_id FROM outbox_enqueue('win', 'http', 'https://a.example/2', "
                      "'{}', NULL, 3600)")
    other = scalar(a, "SELECT effect_id FROM outbox_enqueue('win', 'http', 'https://a.example/3', "
                      "'{}', NULL, 1)")
    wait_for(lambda: scalar(conn, "SELECT available_at < now() FROM effect_outbox WHERE effect_id = %s",
                            (due,)), what="the 1 s window to pass")
    for eid in (due, later, other):
        park(conn, eid)
    assert query(a, "SELECT status, state FROM outbox_cancel_status(%s, 'x', 'n8n')", (due,)) == \
        [("too_late", "pending")]
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        query(a, "SELECT outbox_cancel(%s, 'x', 'n8n')", (due,))
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (due,)) == "pending"
    # Inside its window, a parked effect is the producer's to cancel.
    assert query(a, "SELECT status FROM outbox_cancel_status(%s, 'x', 'n8n')", (later,)) == \
        [("cancelled",)]
    # The operator, at any time.
    assert query(o, "SELECT status FROM outbox_cancel_status(%s, 'x', 'op')", (other,)) == \
        [("cancelled",)]
