"""The hot path's SQL (sql/functions/30_dispatcher.sql): outbox_mark_sending,
outbox_complete and outbox_advance_runs run on plans cached once per
session (force_generic_plan: planning on every call was about a fifth of
PostgreSQL's CPU samples in a profile, docs/performance.md "Cost per
effect in the database").  A
cached plan must stay a lookup by key whatever the table held when it was
made: these tests cache the plans on an empty table, grow the table under
the same session without ANALYZE, and read the plans through auto_explain.
They also check the two paths of outbox_complete: the usual batch (state
change and attempts rows in one statement) and the leftovers (lease lost,
a batch delivered twice).
"""
import json
import re
import uuid

from outbox_test import kill_switch, query


def plans_of(conn, sql, args):
    """The plans auto_explain reports for the statements sql runs, nested
    ones included (as in test_lease_plans.py)."""
    query(conn, "LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "auto_explain.log_level = notice", "client_min_messages = notice"):
        query(conn, "SET " + setting)
    del conn.notices[:]
    query(conn, sql, args)
    query(conn, "SET auto_explain.log_min_duration = -1")
    return "\n".join(conn.notices)


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


def assert_index_reads_are_probes(plans):
    lines = plans.splitlines()
    scans = 0
    for i, line in enumerate(lines):
        if re.search(r"Index (Only )?Scan.* on (effect_outbox|workflow_runs|effect_attempts)", line):
            scans += 1
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            assert nxt.startswith("Index Cond:"), "no Index Cond under %r in:\n%s" % (line, plans)
    assert scans > 0, plans


def test_cached_plans_stay_key_lookups_after_the_table_grew(conn):
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    # A fresh install: empty tables, and statistics that say so.
    query(conn, "ANALYZE effect_outbox")
    query(conn, "ANALYZE workflow_runs")
    # The session caches its plans on its first calls, on an empty table
    # (ids that do not exist), then works on a tiny one.
    mark(conn, owner, [str(uuid.uuid4())])
    complete(conn, owner, outcomes([str(uuid.uuid4())]))
    query(conn, "SELECT outbox_advance_runs('{}', '{nokey}')")
    for i in range(3):
        add_effects(conn, 2, "small%d-" % i)
        ids = lease(conn, owner, 2)
        mark(conn, owner, ids)
        complete(conn, owner, outcomes(ids))
    # A busy morning before autoanalyze: 10,000 finished and 10,000
    # pending effects, each with its run.
    add_effects(conn, 10000, "big-")
    query(conn, "UPDATE effect_outbox SET state = 'completed', completed_at = now() "
                "WHERE idempotency_key LIKE 'big-%%'")
    add_effects(conn, 10000, "next-")
    ids = lease(conn, owner, 5)
    assert len(ids) == 5
    plans = plans_of(conn, "SELECT * FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)",
                     (owner, ids, str(uuid.uuid4())))
    plans += plans_of(conn, "SELECT * FROM outbox_complete(%s, 'w', %s)", (owner, outcomes(ids)))
    assert "Update on effect_outbox" in plans and "Update on workflow_runs" in plans, plans
    for bad in ("Seq Scan on effect_outbox", "Seq Scan on workflow_runs", "Hash Join", "Merge Join",
                "Hash Anti Join", "effect_outbox_due_idx", "effect_outbox_sending_idx",
                "effect_outbox_done_idx"):
        assert bad not in plans, "%s in:\n%s" % (bad, plans)
    assert "effect_outbox_pkey" in plans, plans
    # Every index read is a probe: a scan of a whole index (with the keys
    # as a filter) also reads the whole table's worth.
    assert_index_reads_are_probes(plans)
    # The runs' "every effect completed" test probes by run key.
    assert "effect_outbox_idempotency_key_effect_type_target_key" in plans, plans
    assert query(conn, "SELECT count(*) FROM workflow_runs WHERE idempotency_key = ANY (%s) "
                       "AND state = 'completed'",
                 ([r[0] for r in query(conn, "SELECT idempotency_key FROM effect_outbox "
                                             "WHERE effect_id = ANY (%s::uuid[])", (ids,))],))[0][0] == 5


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
    query(conn, "UPDATE effect_outbox SET lease_expires_at = now() - interval '1 second' "
                "WHERE effect_id = %s", (lost,))
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
    assert query(conn, "SELECT state FROM effect_outbox WHERE effect_id = %s", (lost,))[0][0] == "unknown"
    assert query(conn, "SELECT w.state FROM workflow_runs w JOIN effect_outbox o USING (idempotency_key) "
                       "WHERE o.effect_id = %s", (ok,))[0][0] == "completed"
