# SPDX-License-Identifier: ISC
"""A run's state after its effects finished (sql/functions/20_producer.sql,
25_kit.sql): the completion no longer writes the run, so every producer
function that reads or moves a run settles it first and answers as if the
run had been moved when its last effect finished.  Above all a run whose
effects have all finished is never claimable again (a duplicate trigger
of a finished run does nothing).  Cancels finish an effect the same way a
completion does: the live row goes, one history row without a call says
how it ended.
"""
import hashlib
import json
import uuid

import psycopg2
import pytest

from outbox_test import query, scalar

ENQ = "SELECT effect_id FROM outbox_enqueue(%s, 'http', %s, '{}')"


def finish(conn, eid, state="completed"):
    """Finish an effect as the completion does: its live row deleted and the
    history row of the provider call that finished it written, in one
    statement; the run is left alone."""
    query(conn, "WITH gone AS (DELETE FROM effect_live WHERE effect_id = %s RETURNING *) "
                "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "outcome_class, state, last_error_class, retry_base) "
                "SELECT effect_id, created_at, attempts + 1, 'w1', now(), %s, %s, %s, retry_base "
                "FROM gone",
          (eid, "accepted" if state == "completed" else "terminal", state,
           None if state == "completed" else "terminal"))
    assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,)) == state


def run_with_effects(p, conn, n=2, lease=300):
    key = "run-" + uuid.uuid4().hex[:10]
    owner = str(uuid.uuid4())
    assert scalar(p, "SELECT status FROM outbox_claim_run(%s, 'h', %s, %s)",
                  (key, owner, lease)) == "claimed"
    ids = [scalar(p, ENQ, (key, f"https://x.example/{i}")) for i in range(n)]
    return key, owner, ids


def expire_lease(conn, key):
    query(conn, "UPDATE workflow_runs SET lease_expires_at = now() - interval '1 second' "
                "WHERE idempotency_key = %s", (key,))


def run_row(conn, key):
    return query(conn, "SELECT state, version, failure_reason FROM workflow_runs "
                       "WHERE idempotency_key = %s", (key,))[0]


@pytest.mark.parametrize("last", ["completed", "failed"])
def test_a_run_whose_effects_all_finished_is_never_reclaimed(conn, login_as, last):
    p = login_as("outbox_producer")
    key, _, ids = run_with_effects(p, conn)
    finish(conn, ids[0])
    expire_lease(conn, key)
    # One effect still open: the run is still the workflow's to retry.
    assert run_row(conn, key)[0] == "processing"
    finish(conn, ids[1], last)
    rows = query(p, "SELECT status, state, lease_owner, version FROM outbox_claim_run(%s, 'h', %s, 300)",
                 (key, str(uuid.uuid4())))
    want = "completed" if last == "completed" else "failed_terminal"
    assert rows == [("done", want, None, 1)]
    assert run_row(conn, key) == (want, 1, None if last == "completed"
                                  else "an effect failed terminally")
    # Asked again, the same answer; the run moves no further.
    assert query(p, "SELECT status, state, version FROM outbox_claim_run(%s, 'h', %s, 300)",
                 (key, str(uuid.uuid4()))) == [("done", want, 1)]


def test_a_run_with_an_effect_still_open_is_reclaimed(conn, login_as):
    p = login_as("outbox_producer")
    key, _, ids = run_with_effects(p, conn)
    finish(conn, ids[0])
    expire_lease(conn, key)
    assert query(p, "SELECT status, state, version FROM outbox_claim_run(%s, 'h', %s, 300)",
                 (key, str(uuid.uuid4()))) == [("reclaimed", "processing", 1)]


def test_a_failed_retryable_run_with_a_failed_effect_is_not_reclaimed(conn, login_as):
    p = login_as("outbox_producer")
    key, owner, ids = run_with_effects(p, conn, n=1)
    assert query(p, "SELECT version FROM outbox_transition_run(%s, %s, 0, 'failed_retryable')",
                 (key, owner)) == [(1,)]
    finish(conn, ids[0], "failed")
    assert query(p, "SELECT status, state FROM outbox_claim_run(%s, 'h', %s, 300)",
                 (key, str(uuid.uuid4()))) == [("done", "failed_terminal")]


@pytest.mark.parametrize("call", ["renew", "transition", "approval"])
def test_the_lease_holder_cannot_move_a_run_its_effects_finished(conn, login_as, call):
    p = login_as("outbox_producer")
    key, owner, ids = run_with_effects(p, conn)
    for eid in ids:
        finish(conn, eid)
    if call == "renew":
        assert scalar(p, "SELECT outbox_renew_run(%s, %s, 0, 600)", (key, owner)) is None
    elif call == "transition":
        assert query(p, "SELECT * FROM outbox_transition_run(%s, %s, 0, 'awaiting_human')",
                     (key, owner)) == []
    else:
        assert query(p, "SELECT * FROM outbox_create_approval(%s, %s, 0, %s, ARRAY['approve'], "
                        "60, '[]')", (key, owner, psycopg2.Binary(hashlib.sha256(b"t").digest()))) == []
        assert scalar(conn, "SELECT count(*) FROM approvals") == 0
    assert run_row(conn, key)[:2] == ("completed", 1)


def test_an_approval_of_a_run_whose_effect_failed_is_not_consumed(conn, login_as):
    """An effect enqueued before the run went to a human fails: the run is
    failed_terminal, so the approval page shows it and the approval is
    refused (the run is no longer awaiting_human)."""
    p = login_as("outbox_producer")
    key, owner, ids = run_with_effects(p, conn, n=1)
    token = hashlib.sha256(b"t-failed").digest()
    assert len(query(p, "SELECT * FROM outbox_create_approval(%s, %s, 0, %s, ARRAY['approve'], "
                        "600, %s)", (key, owner, psycopg2.Binary(token),
                                     json.dumps([{"effect_type": "http", "target": "https://y.example/",
                                                  "payload": {}}])))) == 1
    finish(conn, ids[0], "failed")
    assert query(p, "SELECT run_state FROM outbox_peek_approval(%s)",
                 (psycopg2.Binary(token),)) == [("failed_terminal",)]
    assert query(p, "SELECT * FROM outbox_consume_approval(%s, 'approve', 'alice')",
                 (psycopg2.Binary(token),)) == []
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE idempotency_key = %s", (key,)) == 1


def test_cancel_status_of_a_finished_effect_settles_its_run(conn, login_as):
    p = login_as("outbox_producer")
    key, _, ids = run_with_effects(p, conn, n=1)
    finish(conn, ids[0])
    assert query(p, "SELECT status, state FROM outbox_cancel_status(%s, 'x', 'n8n')",
                 (ids[0],)) == [("finished", "completed")]
    assert run_row(conn, key)[:2] == ("completed", 1)


def test_a_cancel_finishes_the_effect_with_one_history_row(conn, login_as):
    p = login_as("outbox_producer")
    key = "run-" + uuid.uuid4().hex[:10]
    owner = str(uuid.uuid4())
    scalar(p, "SELECT status FROM outbox_claim_run(%s, 'h', %s, 300)", (key, owner))
    eid, inserted, st, due = query(p, "SELECT * FROM outbox_enqueue(%s, 'http', 'https://x.example/', "
                                      "'{}', NULL, 600)", (key,))[0]
    assert inserted and st == "pending"
    assert scalar(conn, "SELECT available_at FROM effect_live WHERE effect_id = %s", (eid,)) == due
    assert scalar(conn, "SELECT available_at FROM effect_outbox WHERE effect_id = %s", (eid,)) == due
    assert query(p, "SELECT status, state, available_at FROM outbox_cancel_status(%s, 'gone', 'n8n')",
                 (eid,)) == [("cancelled", "failed", due)]
    assert scalar(conn, "SELECT count(*) FROM effect_live WHERE effect_id = %s", (eid,)) == 0
    assert query(conn, "SELECT state, outcome_class, last_error_class, last_error, worker "
                       "FROM effect_history WHERE effect_id = %s", (eid,)) == \
        [("failed", None, "cancelled", "cancelled: gone", "cancel")]
    assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE effect_id = %s", (eid,)) == 0
    assert query(conn, "SELECT state, last_error_class, completed_at IS NOT NULL FROM outbox_effects "
                       "WHERE effect_id = %s", (eid,)) == [("failed", "cancelled", True)]
    # The same effect enqueued again adds nothing and says how it ended.
    assert query(p, "SELECT * FROM outbox_enqueue(%s, 'http', 'https://x.example/', '{}')",
                 (key,)) == [(eid, False, "failed", due)]
    assert run_row(conn, key)[0] == "failed_terminal"


def test_a_rejection_finishes_every_pending_effect_of_the_run(conn, login_as):
    p = login_as("outbox_producer")
    key, owner, ids = run_with_effects(p, conn, n=3)
    finish(conn, ids[2])
    assert query(p, "SELECT version FROM outbox_transition_run(%s, %s, 0, 'failed_terminal')",
                 (key, owner)) == [(1,)]
    assert query(conn, "SELECT effect_id, state, last_error_class FROM outbox_effects "
                       "WHERE idempotency_key = %s ORDER BY effect_id", (key,)) == \
        sorted([(ids[0], "failed", "cancelled"), (ids[1], "failed", "cancelled"),
                (ids[2], "completed", None)])
    assert scalar(conn, "SELECT count(*) FROM effect_live l JOIN effect_outbox b USING (effect_id) "
                        "WHERE b.idempotency_key = %s", (key,)) == 0
    assert scalar(conn, "SELECT count(*) FROM effect_history WHERE effect_id = ANY (%s::uuid[]) "
                        "AND outcome_class IS NULL", ([str(i) for i in ids],)) == 2


def test_no_effect_is_enqueued_into_a_run_whose_effects_all_finished(conn, login_as):
    """The run's effects completed while it was processing: it is completed,
    and outbox_enqueue's new effect for it is refused by the approval gate
    (55000), as when the completion moved the run itself.  A repeat of a
    finished effect still adds nothing and says how it ended."""
    p = login_as("outbox_producer")
    key, _, ids = run_with_effects(p, conn, n=1)
    finish(conn, ids[0])
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as e:
        query(p, "SELECT effect_id FROM outbox_enqueue(%s, 'http', 'https://x.example/late', '{}')",
              (key,))
    assert f'run "{key}" is completed' in str(e.value)
    # (The refusal rolled its settle back; the next reader settles again.)
    assert query(p, "SELECT status, state FROM outbox_claim_run(%s, 'h', %s, 300)",
                 (key, str(uuid.uuid4()))) == [("done", "completed")]
    assert query(p, "SELECT effect_id, inserted, state FROM outbox_enqueue(%s, 'http', "
                    "'https://x.example/0', '{}')", (key,)) == [(ids[0], False, "completed")]
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE idempotency_key = %s", (key,)) == 1


def test_a_run_with_an_effect_still_open_takes_more_effects(conn, login_as):
    p = login_as("outbox_producer")
    key, _, ids = run_with_effects(p, conn, n=2)
    finish(conn, ids[0])
    assert query(p, "SELECT inserted, state FROM outbox_enqueue(%s, 'http', 'https://x.example/more', "
                    "'{}')", (key,)) == [(True, "pending")]
    assert run_row(conn, key)[:2] == ("processing", 0)
