# SPDX-License-Identifier: ISC
"""effect_history.source (sql/112_history_source.sql): every writer of the
history says who it is, and the readers that told the reaper's rows by
the worker name's pattern ('reaper:%') read the column instead.

- Each writer's rows: the worker's completion (outbox_complete_sending and
  outbox_complete_rest) and its validation failures, the reaper, a
  reconciliation's verdicts and the row that finishes the effect, an
  operator's resolve and requeue, a producer's cancel.
- The late evidence goes by the column: a reaper row is what makes an
  `unknown` effect take its own attempt's late answer, whatever the worker
  column says, and a row whose worker name merely looks like the reaper's
  does not.
- The backfill's derivation (outbox_history_source_of) and the one update
  the append-only trigger allows: a row's source set to what its other
  columns say, nothing else.
- The upgrade from the last release: migrate gives the rows written before
  it their writer's source.
"""
import json
import os
import subprocess
import uuid

import psycopg2
import pytest

from outbox_test import BUILD_DIR, dsn_for, expire_sending, kill_switch, query, scalar
from releases import release_build


def add_effects(conn, n, label):
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (label, n))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s || g, 'http', 'http://127.0.0.1:9/', '{}' FROM generate_series(1, %s) g",
          (label, n))
    return [r[0] for r in query(conn, "SELECT effect_id::text FROM effect_outbox "
                                      "WHERE idempotency_key LIKE %s ORDER BY effect_id",
                                (label + "%",))]


def lease_and_mark(conn, owner, ids):
    leased = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w1', %s, 30, "
                                        "'{http}', true)", (owner, len(ids)))]
    assert sorted(leased) == sorted(ids)
    query(conn, "SELECT * FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)",
          (owner, ids, str(uuid.uuid4())))


def outcome(eid, outcome="accepted", next_state="completed", attempt=1):
    return {"effect_id": eid, "attempt": attempt, "outcome": outcome, "next_state": next_state,
            "retry_delay_ms": 0, "status": 200 if outcome == "accepted" else 503,
            "provider_id": "p-" + eid[:8] if outcome == "accepted" else None}


def sources(conn, eid):
    return query(conn, "SELECT source, worker, outcome_class, state FROM effect_history "
                       "WHERE effect_id = %s ORDER BY history_id", (eid,))


def test_each_writer_says_who_it_is(conn):
    kill_switch(conn, True)
    done, retried, reaped, recon, resolved, failed, cancelled, refused = \
        add_effects(conn, 8, "src-")
    owner = str(uuid.uuid4())
    lease_and_mark(conn, owner, [done, retried, reaped, recon, resolved])

    # The worker: the usual batch, one statement, answering what it applied.
    answer = query(conn, "SELECT effect_id::text, state FROM outbox_complete_sending(%s, 'w1', %s)",
                   (owner, json.dumps([outcome(done), outcome(retried, "retry", "pending")])))
    assert sorted(answer) == sorted([(done, "completed"), (retried, "pending")])
    assert sources(conn, done) == [("worker", "w1", "accepted", "completed")]
    assert sources(conn, retried) == [("worker", "w1", "retry", None)]

    # The reaper: three leases expired while sending.
    expire_sending(conn, [reaped, recon, resolved])
    assert len(query(conn, "SELECT * FROM outbox_reap('r1', 10)")) == 3
    assert sources(conn, reaped) == [("reaper", "reaper:r1", "ambiguous", None)]

    # The worker again, its late answer for the reaped attempt: not applied
    # by the usual batch (the row is `unknown`), so the rest takes it.
    late = json.dumps([outcome(reaped)])
    assert query(conn, "SELECT * FROM outbox_complete_sending(%s, 'w1', %s)", (owner, late)) == []
    assert query(conn, "SELECT effect_id::text, applied, state, resolved "
                       "FROM outbox_complete_rest(%s, 'w1', %s)", (owner, late)) == \
        [(reaped, True, "completed", "late_accepted")]
    assert [s[0] for s in sources(conn, reaped)] == ["reaper", "worker"]

    # A reconciliation: its verdict and the row that finishes the effect.
    query(conn, "INSERT INTO outbox_providers (name, can_reconcile, last_seen) "
                "VALUES ('http', true, now()) ON CONFLICT (name) DO UPDATE SET can_reconcile = true")
    rowner = str(uuid.uuid4())
    leased = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_reconcile_lease(%s, "
                                        "'w2', '{http}', 10, 0)", (rowner,))]
    assert recon in leased
    query(conn, "SELECT * FROM outbox_reconcile_record(%s, 'w2', %s)",
          (rowner, json.dumps([{"effect_id": recon, "verdict": "sent", "provider_id": "p-r"}])))
    assert sorted(s[0] for s in sources(conn, recon)[1:]) == ["reconcile", "reconcile"]

    # An operator: the resolve of the other unknown, then a requeue.
    query(conn, "SELECT * FROM outbox_resolve_unknown(%s, false, 'alice', 'checked')", (resolved,))
    assert sources(conn, resolved)[-1] == ("operator", "operator:alice", "operator_not_sent", None)
    fowner = str(uuid.uuid4())
    assert [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w1', 1, 30, "
                                      "'{http}', true)", (fowner,))] == [failed]
    query(conn, "SELECT * FROM outbox_fail_invalid(%s, %s)",
          (fowner, json.dumps([{"effect_id": failed, "error": "bad payload"}])))
    assert sources(conn, failed) == [("worker", None, None, "failed")]
    query(conn, "SELECT * FROM outbox_requeue(%s, 'alice', 'fixed')", (failed,))
    assert sources(conn, failed)[-1][:2] == ("operator", "operator:alice")

    # An operator's cancel (this login is a member of every role), and a
    # producer's: the run refused, its pending effects cancelled with it.
    assert scalar(conn, "SELECT outbox_cancel(%s, 'not needed')", (cancelled,)) is True
    assert sources(conn, cancelled)[-1] == ("operator", "cancel", None, "failed")
    key = scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (refused,))
    assert scalar(conn, "SELECT outbox_cancel_pending_of_run(%s, 'refused')", (key,)) == 1
    assert sources(conn, refused) == [("producer", "cancel", None, "failed")]

    # Every row written has a source its derivation from the other
    # columns agrees with (what the backfill gives rows written before).
    disagree = query(conn, "SELECT source, worker, outcome_class, resolution, state "
                           "FROM effect_history WHERE source <> outbox_history_source_of("
                           "worker, lease_owner, outcome_class, resolution, state) "
                           "AND worker IS DISTINCT FROM 'cancel'")
    assert disagree == []


def test_late_evidence_follows_the_source_not_the_worker_name(conn):
    """A worker whose name starts with 'reaper:' is a worker: its
    ambiguous row does not make the attempt's late not-sent evidence."""
    kill_switch(conn, True)
    (eid,) = add_effects(conn, 1, "named-")
    owner = str(uuid.uuid4())
    lease_and_mark(conn, owner, [eid])
    ambiguous = json.dumps([outcome(eid, "ambiguous", "unknown")])
    query(conn, "SELECT * FROM outbox_complete_sending(%s, 'reaper:impostor', %s)",
          (owner, ambiguous))
    assert sources(conn, eid) == [("worker", "reaper:impostor", "ambiguous", None)]
    not_sent = json.dumps([outcome(eid, "not_sent", "pending")])
    got = query(conn, "SELECT resolved FROM outbox_complete_rest(%s, 'w1', %s)",
                (owner, not_sent))
    assert got == [(None,)]
    assert scalar(conn, "SELECT state FROM effect_live WHERE effect_id = %s", (eid,)) == "unknown"


def test_derivation_of_rows_written_before_112(conn):
    of = "SELECT outbox_history_source_of(%s, %s::uuid, %s, %s, %s)"
    owner = str(uuid.uuid4())
    cases = [
        (("reaper:w1", owner, "ambiguous", None, None), "reaper"),
        (("operator:alice", None, "operator_sent", None, None), "operator"),
        (("operator:alice", None, None, "requeued", None), "operator"),
        (("cancel", None, None, None, "failed"), "producer"),
        (("w1", None, "reconciled_sent", None, None), "reconcile"),
        (("w1", None, "reconcile_unknown", None, None), "reconcile"),
        (("w1", None, None, None, "completed"), "reconcile"),
        (("w1", None, "reconciled_sent", "late_accepted", "completed"), "worker"),
        (("w1", owner, "accepted", None, "completed"), "worker"),
        (("w1", owner, "not_sent", "late_not_sent", None), "worker"),
        ((None, owner, None, None, "failed"), "worker"),
        (("migration", None, None, None, "completed"), "worker"),
    ]
    for args, want in cases:
        assert scalar(conn, of, args) == want, args


def test_history_stays_append_only_but_for_the_backfill(conn):
    kill_switch(conn, True)
    (eid,) = add_effects(conn, 1, "ao-")
    created = scalar(conn, "SELECT created_at FROM effect_outbox WHERE effect_id = %s", (eid,))
    # A reaper row as a release before 112 wrote it (the default source).
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class) VALUES (%s, %s, 1, gen_random_uuid(), 'reaper:r', "
                "now(), 'ambiguous')", (eid, created))
    for bad in ("UPDATE effect_history SET source = 'operator' WHERE effect_id = %s",
                "UPDATE effect_history SET source = 'reaper', error_text = 'x' WHERE effect_id = %s",
                "UPDATE effect_history SET error_text = 'x' WHERE effect_id = %s",
                "DELETE FROM effect_history WHERE effect_id = %s"):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege, match="append-only"):
            query(conn, bad, (eid,))
    query(conn, "UPDATE effect_history SET source = 'reaper' WHERE effect_id = %s", (eid,))
    assert scalar(conn, "SELECT source FROM effect_history WHERE effect_id = %s", (eid,)) == "reaper"
    # Once set, not again (even to the same value).
    with pytest.raises(psycopg2.errors.InsufficientPrivilege, match="append-only"):
        query(conn, "UPDATE effect_history SET source = 'reaper' WHERE effect_id = %s", (eid,))


# ---- the upgrade -------------------------------------------------------------


def migrate(dsn, exe):
    return subprocess.run([exe, "--db", dsn, "migrate"], capture_output=True, text=True,
                          timeout=600)


def test_upgrade_from_the_last_release_backfills_the_source(unmigrated_db):
    """A database of the last release (71088d8, schema 106: no source
    column), with the history every writer left in it, for an effect
    finished and one still `unknown`: this tree's migrate gives each row
    the source of its writer (the live effect's rows under the locks, the
    finished one's in the steps after the commit) and validates the
    CHECK."""
    old = release_build("71088d8")
    dsn = dsn_for(unmigrated_db)
    r = migrate(dsn, os.path.join(old, "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    c = psycopg2.connect(dsn)
    c.autocommit = True
    assert scalar(c, "SELECT max(version) FROM schema_migrations") == 106
    assert scalar(c, "SELECT count(*) FROM pg_attribute WHERE attrelid = 'effect_history'::regclass "
                     "AND attname = 'source'") == 0
    query(c, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
             "VALUES ('up-1', 'processing', 'h')")
    finished = scalar(c, "SELECT effect_id::text FROM outbox_enqueue('up-1', 'http', "
                                "'http://127.0.0.1:9/a', '{}')")
    live = scalar(c, "SELECT effect_id::text FROM outbox_enqueue('up-1', 'http', "
                            "'http://127.0.0.1:9/b', '{}')")
    owner = str(uuid.uuid4())
    rows = {   # (worker, lease_owner, outcome_class, resolution, state): the source it gets
        ("w1", owner, "ambiguous", None, None): "worker",
        ("reaper:r1", owner, "ambiguous", None, None): "reaper",
        ("w2", None, "reconciled_not_sent", None, None): "reconcile",
        ("operator:alice", None, "operator_sent", None, None): "operator",
        ("operator:alice", None, None, None, "completed"): "operator",
    }
    for eid in (finished, live):
        for (worker, lease_owner, oc, res, state) in rows:
            query(c, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, "
                     "worker, started_at, outcome_class, resolution, state) "
                     "SELECT effect_id, created_at, 1, %s, %s, now(), %s, %s, %s "
                     "FROM effect_outbox WHERE effect_id = %s",
                  (lease_owner, worker, oc, res, state, eid))
    query(c, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, state) "
             "SELECT effect_id, created_at, 1, 'cancel', now(), 'failed' FROM effect_outbox "
             "WHERE effect_id = %s", (finished,))
    query(c, "DELETE FROM effect_live WHERE effect_id = %s", (finished,))
    query(c, "UPDATE effect_live SET state = 'unknown', available_at = 'infinity', attempts = 1 "
             "WHERE effect_id = %s", (live,))

    r = migrate(dsn, os.path.join(BUILD_DIR, "outboxctl"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "applied 112_history_source\n" in r.stdout, r.stdout
    assert "backfilled effect_history.source" in r.stdout, r.stdout
    want = dict(rows)
    for eid in (finished, live):
        got = {tuple(x[:5]): x[5] for x in query(
            c, "SELECT worker, lease_owner::text, outcome_class, resolution, state, source "
               "FROM effect_history WHERE effect_id = %s AND worker <> 'cancel'", (eid,))}
        assert got == want, (eid, got)
    assert query(c, "SELECT source FROM effect_history WHERE worker = 'cancel'") == [("producer",)]
    assert scalar(c, "SELECT convalidated FROM pg_constraint WHERE conname = "
                     "'effect_history_source_check' AND conrelid = 'effect_history'::regclass") \
        is True
    assert scalar(c, "SELECT count(*) FROM outbox_history_backfill WHERE next_page < end_page") == 0
    # Nothing left: migrate again does nothing and says nothing of it.
    r = migrate(dsn, os.path.join(BUILD_DIR, "outboxctl"))
    assert r.returncode == 0 and "backfilled" not in r.stdout, r.stdout + r.stderr
    c.close()
