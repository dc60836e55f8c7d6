# SPDX-License-Identifier: ISC
"""outboxctl against a real database: every command, its records
(operator_actions, the attempts log, the control history), its refusals
and its exit codes (0 done, 1 refused or not found, 2 usage, 3 database).

Scenarios are arranged directly with SQL as the superuser (an effect
forced to `unknown`, `failed`, `sending`... in the live queue and its
history: tests/lib/effect_arrange.py), so no worker is needed.
"""
import json
import select
import uuid

import psycopg2
import pytest

from effect_arrange import arrange, effect_created_at, history_months, month_partition
from outbox_test import (OPERATOR_ROLE, attempts, connect, effect, enqueue, make_run, query,
                         ctl, fails, ok, run_ctl, scalar, wait_for)

DOWN = "host=127.0.0.1 port=1 connect_timeout=2"
NO_SUCH = "00000000-0000-4000-8000-000000000000"


def new_effect(conn, key=None, target=None, payload=None, effect_type="http", metadata=None):
    """An effect of an approved run (the approval gate, admits
    effects while the run is processing: the run is arranged around it)."""
    key = key or make_run(conn)
    before = run_state(conn, key)
    query(conn, "UPDATE workflow_runs SET state = 'processing' WHERE idempotency_key = %s", (key,))
    eid = str(enqueue(conn, effect_type, target or f"https://sink.example/{uuid.uuid4().hex[:6]}",
                      payload if payload is not None else {"body": {"n": 1}}, key=key,
                      metadata=metadata))
    query(conn, "UPDATE workflow_runs SET state = %s WHERE idempotency_key = %s",
          ("approved" if before == "processing" else before, key))
    return eid


def run_of(conn, eid):
    return scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (eid,))


def run_state(conn, key):
    return scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,))


def actions(conn, action=None):
    rows = query(conn, "SELECT action, effect_id::text, run_key, operator, reason, detail "
                       "FROM operator_actions WHERE %s IS NULL OR action = %s ORDER BY action_id",
                 (action, action))
    k = ("action", "effect_id", "run_key", "operator", "reason", "detail")
    return [dict(zip(k, r)) for r in rows]


def row(conn, eid):
    return query(conn, "SELECT to_jsonb(o) FROM outbox_effects o WHERE effect_id = %s", (eid,))[0][0]


def make_unknown(conn, key=None):
    eid = new_effect(conn, key=key)
    arrange(conn, eid, "unknown", attempts=1, last_error_class="ambiguous",
            last_error="timeout after the request was sent")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, outcome_class, error_text) SELECT effect_id, created_at, 1, "
                "gen_random_uuid(), 'w1', now(), 'ambiguous', 'timeout' FROM effect_outbox "
                "WHERE effect_id = %s", (eid,))
    return eid


def make_failed(conn, key=None, error_class="retry", ago="0 seconds"):
    eid = new_effect(conn, key=key)
    arrange(conn, eid, "failed", attempts=5, last_error_class=error_class,
            last_error=f"{error_class}: gave up", completed_at=f"SQL:now() - interval '{ago}'")
    query(conn, "UPDATE workflow_runs SET state = 'failed_terminal', "
                "failure_reason = 'an effect failed terminally' WHERE idempotency_key = %s",
          (run_of(conn, eid),))
    return eid


# --- help, usage, a database that is down ----------------------------------------

COMMANDS = ["migrate", "kill-switch", "status", "unknown", "requeue", "replace", "prune", "cancel"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_outboxctl_every_command_has_help(cmd):
    r = ok(run_ctl([cmd, "--help"]))
    assert r.stdout.startswith("usage: outboxctl")
    assert cmd in r.stdout


def test_outboxctl_usage_lists_the_commands_and_exit_codes():
    r = ok(run_ctl(["--help"]))
    for cmd in COMMANDS:
        assert f"\n  {cmd}" in r.stdout
    assert "exit codes" in r.stdout
    fails(run_ctl(["frobnicate"]), 2, "unknown command")
    fails(run_ctl([]), 2)


@pytest.mark.parametrize("args", [
    ["status"],
    ["status", "--json"],
    ["kill-switch", "status"],
    ["kill-switch", "off", "--operator", "ann", "--reason", "r"],
    ["unknown", "list"],
    ["unknown", "resolve", NO_SUCH, "--sent", "--operator", "ann", "--reason", "r"],
    ["requeue", NO_SUCH, "--operator", "ann", "--reason", "r"],
    ["requeue", "--failed-since", "1h", "--operator", "ann", "--reason", "r"],
    ["replace", NO_SUCH, "--new-key", "k", "--operator", "ann", "--reason", "r"],
    ["prune", "--older-than", "30d"],
    ["cancel", NO_SUCH],
    ["migrate"],
])
def test_outboxctl_database_down_exits_3_with_the_connection_error(args):
    r = fails(run_ctl(["--db", DOWN] + args), 3, "cannot connect to the database")
    assert "port=1" in r.stderr and "refused" in r.stderr.lower()


@pytest.mark.parametrize("args", [
    ["unknown", "resolve", "nope", "--sent", "--operator", "a", "--reason", "r"],
    ["requeue", "12345", "--operator", "a", "--reason", "r"],
    ["replace", "not-a-uuid-at-all", "--new-key", "k", "--operator", "a", "--reason", "r"],
    ["cancel", "0b9e6a52-3c41-4f0e-9d7a-5f0c2e8b1a4"],
    ["cancel", "zb9e6a52-3c41-4f0e-9d7a-5f0c2e8b1a47"],
])
def test_outboxctl_malformed_id_is_a_usage_error_before_connecting(args):
    # The database is down: a malformed id must be reported without it.
    fails(run_ctl(["--db", DOWN] + args), 2, "is not a UUID")


@pytest.mark.parametrize("args,words", [
    (["unknown"], "expected 'list', 'show' or 'resolve'"),
    (["unknown", "forget"], "expected 'list', 'show' or 'resolve'"),
    (["unknown", "list", "--csv"], "unexpected argument"),
    (["unknown", "resolve"], "needs an effect id"),
    (["unknown", "resolve", NO_SUCH, "--operator", "a", "--reason", "r"], "exactly one of"),
    (["unknown", "resolve", NO_SUCH, "--sent", "--not-sent", "--operator", "a", "--reason", "r"],
     "exactly one of"),
    (["unknown", "resolve", NO_SUCH, "--not-sent", "--provider-id", "x", "--operator", "a",
      "--reason", "r"], "--sent only"),
    (["unknown", "resolve", NO_SUCH, "--sent", "--reason", "r"], "--operator NAME"),
    (["unknown", "resolve", NO_SUCH, "--sent", "--operator", "a"], "--reason TEXT"),
    (["unknown", "resolve", NO_SUCH, "--sent", "--operator", "a", "--reason"], "needs a value"),
    (["requeue", "--operator", "a", "--reason", "r"], "either an effect id or --failed-since"),
    (["requeue", NO_SUCH, "--failed-since", "1h", "--operator", "a", "--reason", "r"],
     "either an effect id or --failed-since"),
    (["requeue", NO_SUCH], "--operator NAME"),
    (["replace", NO_SUCH, "--operator", "a", "--reason", "r"], "--new-key KEY"),
    (["replace", NO_SUCH, "--new-key", "k"], "--operator NAME"),
    (["replace", NO_SUCH, "--new-key", "k", "--operator", "a", "--reason", "r", "--payload", "{x"],
     "not valid JSON"),
    (["replace", NO_SUCH, "--new-key", "k", "--operator", "a", "--reason", "r", "--target", ""],
     "--target is empty"),
    (["prune"], "--older-than D"),
    (["prune", "--older-than", "30d", "--batch", "0"], "--batch must be"),
    (["prune", "--older-than", "30d", "--batch", "ten"], "--batch must be"),
    (["prune", "--older-than", "30d", "--batch", "100001"], "--batch must be"),
    (["cancel"], "needs an effect id"),
    (["cancel", NO_SUCH, "--force"], "unexpected argument"),
    (["kill-switch", "off"], "--operator NAME and --reason TEXT"),
    (["kill-switch", "sideways"], "expected off, on or status"),
])
def test_outboxctl_missing_or_bad_options_exit_2(args, words):
    fails(run_ctl(["--db", DOWN] + args), 2, words)


# --- kill switch --------------------------------------------------------------------

def test_outboxctl_kill_switch_off_on_status_keeps_history(db, conn):
    r = ok(ctl(db, "kill-switch", "on", "--operator", "ann", "--reason", "go live"))
    assert "on" in r.stdout
    r = ok(ctl(db, "kill-switch", "status"))
    assert "kill switch: on" in r.stdout and "ann" in r.stdout and "go live" in r.stdout

    r = ok(ctl(db, "kill-switch", "off", "--operator", "bob", "--reason", "bad model output"))
    assert "no send can start" in r.stdout
    assert "0 effects were already in flight" in r.stdout
    st = json.loads(ok(ctl(db, "kill-switch", "status", "--json")).stdout)
    assert st["state"] == "off" and st["changed_by"] == "bob"
    assert st["reason"] == "bad model output"

    assert query(conn, "SELECT enabled, changed_by, reason FROM outbox_control") == \
        [(False, "bob", "bad model output")]
    hist = query(conn, "SELECT enabled, changed_by, reason FROM outbox_control_history "
                       "ORDER BY change_id")
    assert hist[-2:] == [(True, "ann", "go live"), (False, "bob", "bad model output")]


def test_outboxctl_kill_switch_off_lists_the_sends_in_flight(db, conn):
    ok(ctl(db, "kill-switch", "on", "--operator", "ann", "--reason", "r"))
    flying = new_effect(conn, target="https://crm.example/notes")
    waiting = new_effect(conn)
    arrange(conn, flying, "sending", attempts=1, lease_owner=str(uuid.uuid4()),
            lease_worker="host7-w3", sending_since="SQL:now()",
            lease_expires_at="SQL:now() + interval '30 seconds'")
    ekey = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (flying,))

    r = ok(ctl(db, "kill-switch", "off", "--operator", "bob", "--reason", "incident"))
    assert "1 effect was already in flight" in r.stdout
    line = [ln for ln in r.stdout.splitlines() if flying in ln]
    assert len(line) == 1
    assert f"key={ekey}" in line[0]
    assert "target=https://crm.example/notes" in line[0]
    assert "worker=host7-w3" in line[0]
    assert "started=" in line[0]
    assert waiting not in r.stdout


# --- status ---------------------------------------------------------------------------

def test_outboxctl_status_counts_match_the_database(db, conn):
    ids = [new_effect(conn) for _ in range(10)]
    arrange(conn, ids[0], "sending", lease_owner=str(uuid.uuid4()), lease_worker="w1",
            sending_since="SQL:now()", lease_expires_at="SQL:now() + interval '1 minute'")
    # Its lease already past: still in flight until the reaper moves it.
    arrange(conn, ids[9], "sending", lease_expires_at="SQL:now() - interval '1 minute'")
    for i in ids[1:3]:
        arrange(conn, i, "completed", completed_at="SQL:now()")
    arrange(conn, ids[3], "unknown")
    arrange(conn, ids[4], "failed", completed_at="SQL:now() - interval '10 minutes'")
    arrange(conn, ids[5], "failed", completed_at="SQL:now() - interval '2 hours'")
    # Pending: ids[6..8]; the oldest became due 5 minutes ago, one is due later.
    query(conn, "UPDATE effect_live SET available_at = now() - interval '5 minutes' "
                "WHERE effect_id = %s", (ids[6],))
    query(conn, "UPDATE effect_live SET available_at = now() + interval '1 hour' "
                "WHERE effect_id = %s", (ids[8],))
    ok(ctl(db, "kill-switch", "off", "--operator", "cara", "--reason", "maintenance"))

    st = json.loads(ok(ctl(db, "status", "--json")).stdout)
    db_counts = dict(query(conn, "SELECT state, count(*) FROM outbox_effects GROUP BY state"))
    for s in ("pending", "sending", "completed", "unknown", "failed"):
        assert st["counts"][s] == db_counts.get(s, 0), s
    assert st["counts"] == {"pending": 3, "sending": 2, "completed": 2, "unknown": 1, "failed": 2}
    assert st["in_flight"] == 2 and st["unknown"] == 1
    assert st["failed_last_hour"] == 1
    assert 295 <= st["oldest_pending_age_seconds"] < 400
    assert st["kill_switch"]["state"] == "off"
    assert st["kill_switch"]["changed_by"] == "cara"

    r = ok(ctl(db, "status"))
    assert "pending    3" in r.stdout and "failed     2" in r.stdout
    assert "in flight: 2" in r.stdout and "unknown: 1" in r.stdout
    assert "kill switch: off" in r.stdout and "cara" in r.stdout


# --- unknown ----------------------------------------------------------------------------

def test_outboxctl_unknown_list(db, conn):
    r = ok(ctl(db, "unknown", "list"))
    assert "no unknown effects" in r.stdout
    assert json.loads(ok(ctl(db, "unknown", "list", "--json")).stdout) == []

    a = make_unknown(conn)
    b = make_unknown(conn)
    new_effect(conn)   # pending: not listed
    query(conn, "UPDATE effect_live SET updated_at = now() - interval '1 hour' "
                "WHERE effect_id = %s", (b,))

    items = json.loads(ok(ctl(db, "unknown", "list", "--json")).stdout)
    assert [i["effect_id"] for i in items] == [b, a]            # oldest first
    ekey = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (a,))
    ia = items[1]
    assert ia["effect_key"] == ekey and ia["idempotency_key"] == run_of(conn, a)
    assert ia["attempts"] == 1 and ia["effect_type"] == "http"
    assert ia["last_attempt_worker"] == "w1" and ia["last_attempt_outcome"] == "ambiguous"
    assert ia["last_attempt_status"] is None
    assert ia["last_error_class"] == "ambiguous" and ia["run_state"] == "approved"

    r = ok(ctl(db, "unknown", "list"))
    assert "2 unknown effects" in r.stdout
    assert r.stdout.index(b) < r.stdout.index(a)
    assert ekey in r.stdout and "worker w1, outcome ambiguous" in r.stdout


def test_outboxctl_unknown_resolve_sent_completes_the_effect_and_its_run(db, conn):
    eid = make_unknown(conn)
    key = run_of(conn, eid)
    r = ok(ctl(db, "unknown", "resolve", eid, "--sent", "--provider-id", "msg-42",
               "--operator", "dana", "--reason", "provider dashboard shows it delivered"))
    assert "completed" in r.stdout and "msg-42" in r.stdout

    e = effect(conn, eid)
    assert e["state"] == "completed" and e["provider_id"] == "msg-42"
    assert e["attempts"] == 1
    log = attempts(conn, eid)
    assert log[-1]["outcome_class"] == "operator_sent"
    assert log[-1]["provider_id"] == "msg-42" and log[-1]["worker"] == "operator:dana"
    assert log[-1]["error_text"] == "provider dashboard shows it delivered"
    acts = actions(conn)
    assert len(acts) == 1
    assert acts[0]["action"] == "resolve_sent" and acts[0]["effect_id"] == eid
    assert acts[0]["operator"] == "dana" and acts[0]["run_key"] == key
    # It was the run's only effect: the run is completed.
    assert run_state(conn, key) == "completed"


def test_outboxctl_unknown_resolve_sent_waits_for_the_runs_other_effects(db, conn):
    key = make_run(conn)
    eid = make_unknown(conn, key=key)
    other = new_effect(conn, key=key)
    ok(ctl(db, "unknown", "resolve", eid, "--sent", "--operator", "dana", "--reason", "seen"))
    assert run_state(conn, key) == "approved"
    # No provider id given: a local reference to the recorded decision.
    action_id = scalar(conn, "SELECT action_id FROM operator_actions")
    assert effect(conn, eid)["provider_id"] == f"operator:{action_id}"
    assert effect(conn, other)["state"] == "pending"


def test_outboxctl_unknown_resolve_not_sent_requeues_with_the_same_key(db, conn):
    eid = make_unknown(conn)
    before = row(conn, eid)
    listener = connect(db)
    query(listener, "LISTEN effect_outbox")

    r = ok(ctl(db, "unknown", "resolve", eid, "--not-sent", "--operator", "eve",
               "--reason", "SMTP relay log has no such Message-ID"))
    assert "pending again with the same key" in r.stdout

    after = row(conn, eid)
    assert after["state"] == "pending"
    assert after["effect_key"] == before["effect_key"]
    assert after["idempotency_key"] == before["idempotency_key"]
    assert after["attempts"] == before["attempts"]
    assert after["lease_owner"] is None
    assert scalar(conn, "SELECT available_at <= now() FROM outbox_effects WHERE effect_id = %s",
                  (eid,))
    log = attempts(conn, eid)
    assert log[-1]["outcome_class"] == "operator_not_sent" and log[-1]["worker"] == "operator:eve"
    acts = actions(conn)
    assert [(a["action"], a["operator"], a["reason"]) for a in acts] == \
        [("resolve_not_sent", "eve", "SMTP relay log has no such Message-ID")]
    assert run_state(conn, after["idempotency_key"]) == "approved"

    def notified():
        if select.select([listener], [], [], 0.1)[0]:
            listener.poll()
        return [n for n in listener.notifies if n.channel == "effect_outbox"]
    wait_for(notified, timeout=10, what="NOTIFY effect_outbox")
    listener.close()


@pytest.mark.parametrize("state", ["pending", "completed", "failed", "sending"])
def test_outboxctl_unknown_resolve_refuses_other_states(db, conn, state):
    eid = new_effect(conn)
    arrange(conn, eid, state)
    before = row(conn, eid)
    r = fails(ctl(db, "unknown", "resolve", eid, "--sent", "--operator", "a", "--reason", "r"),
              1, f"is {state}, not unknown", "nothing changed")
    assert r.stdout == ""
    assert row(conn, eid) == before
    assert actions(conn) == [] and attempts(conn, eid) == []


def test_outboxctl_unknown_resolve_missing_effect(db, conn):
    fails(ctl(db, "unknown", "resolve", NO_SUCH, "--not-sent", "--operator", "a", "--reason", "r"),
          1, f"no effect with id {NO_SUCH}")


# --- requeue ---------------------------------------------------------------------------

def test_outboxctl_requeue_one_failed_effect(db, conn):
    eid = make_failed(conn)
    key = run_of(conn, eid)
    before = row(conn, eid)
    r = ok(ctl(db, "requeue", eid, "--operator", "fay", "--reason", "provider outage over"))
    assert "pending with the same key" in r.stdout and "approved" in r.stdout

    after = row(conn, eid)
    assert after["state"] == "pending" and after["effect_key"] == before["effect_key"]
    assert after["attempts"] == 5             # the log's attempt numbers stay unique
    assert after["completed_at"] is None
    assert run_state(conn, key) == "approved"  # back from failed_terminal, not re-run
    acts = actions(conn, "requeue")
    assert len(acts) == 1 and acts[0]["operator"] == "fay"
    assert acts[0]["reason"] == "provider outage over"
    assert acts[0]["detail"]["last_error_class"] == "retry"
    assert acts[0]["detail"]["run_state_before"] == "failed_terminal"

    # Now pending: a second requeue is refused and says so.
    fails(ctl(db, "requeue", eid, "--operator", "fay", "--reason", "again"), 1,
          "is pending, not failed")
    fails(ctl(db, "requeue", NO_SUCH, "--operator", "fay", "--reason", "r"), 1, "no effect")
    assert len(actions(conn, "requeue")) == 1


def test_outboxctl_requeue_leaves_the_run_failed_while_another_effect_is_failed(db, conn):
    key = make_run(conn)
    a = make_failed(conn, key=key)
    b = make_failed(conn, key=key)
    ok(ctl(db, "requeue", a, "--operator", "g", "--reason", "r"))
    assert run_state(conn, key) == "failed_terminal"
    ok(ctl(db, "requeue", b, "--operator", "g", "--reason", "r"))
    assert run_state(conn, key) == "approved"


def test_outboxctl_requeue_failed_since(db, conn):
    recent = [make_failed(conn, ago="10 minutes"), make_failed(conn, ago="50 minutes",
                                                               error_class="not_sent")]
    old = make_failed(conn, ago="3 hours")
    cancelled = make_failed(conn, ago="5 minutes", error_class="cancelled")
    done = new_effect(conn)
    arrange(conn, done, "completed", completed_at="SQL:now()")

    r = ok(ctl(db, "requeue", "--failed-since", "1h", "--operator", "hal",
               "--reason", "CRM outage 01:00-02:00"))
    assert "requeued 2 failed effects" in r.stdout
    for eid in recent:
        assert eid in r.stdout
        assert effect(conn, eid)["state"] == "pending"
    assert effect(conn, old)["state"] == "failed"
    assert effect(conn, cancelled)["state"] == "failed"
    assert effect(conn, done)["state"] == "completed"
    acts = actions(conn, "requeue")
    assert sorted(a["effect_id"] for a in acts) == sorted(recent)
    assert all(a["operator"] == "hal" and "failed_since" in a["detail"] for a in acts)

    # An absolute timestamp works too; nothing left to requeue is not an error.
    since = scalar(conn, "SELECT (now() - interval '4 hours')::text")
    r = ok(ctl(db, "requeue", "--failed-since", since, "--operator", "hal", "--reason", "rest"))
    assert "requeued 1 failed effect " in r.stdout and old in r.stdout
    r = ok(ctl(db, "requeue", "--failed-since", since, "--operator", "hal", "--reason", "rest"))
    assert "requeued 0 failed effects" in r.stdout

    fails(ctl(db, "requeue", "--failed-since", "last tuesday-ish", "--operator", "hal",
              "--reason", "r"), 2, "invalid input syntax")


# --- replace ---------------------------------------------------------------------------

def test_outboxctl_replace_creates_a_linked_event_and_leaves_the_original(db, conn):
    eid = new_effect(conn, target="https://crm.example/a", payload={"body": {"v": 1}},
                     metadata={"model": "m-3"})
    arrange(conn, eid, "completed", provider_id="p-1", completed_at="SQL:now()")
    key = run_of(conn, eid)
    query(conn, "UPDATE workflow_runs SET state = 'completed' WHERE idempotency_key = %s", (key,))
    before = row(conn, eid)
    run_before = query(conn, "SELECT to_jsonb(w) FROM workflow_runs w WHERE idempotency_key = %s",
                       (key,))

    r = ok(ctl(db, "replace", eid, "--new-key", "ticket-981-correction", "--operator", "ivy",
               "--reason", "wrong amount in the note"))
    assert "replacement created" in r.stdout
    new = scalar(conn, "SELECT effect_id::text FROM outbox_effects WHERE replaces_effect = %s",
                 (eid,))
    assert new and new in r.stdout

    n = row(conn, new)
    assert n["idempotency_key"] == "ticket-981-correction"
    assert n["state"] == "pending" and n["approved_by"] == "ivy"
    assert (n["effect_type"], n["target"], n["payload"]) == \
        (before["effect_type"], before["target"], before["payload"])
    assert n["effect_key"] != before["effect_key"]
    assert n["metadata"]["model"] == "m-3" and n["metadata"]["replaces_effect"] == eid
    assert query(conn, "SELECT state, replaces_key FROM workflow_runs WHERE idempotency_key = %s",
                 ("ticket-981-correction",)) == [("approved", key)]
    # The original is never edited.
    assert row(conn, eid) == before
    assert query(conn, "SELECT to_jsonb(w) FROM workflow_runs w WHERE idempotency_key = %s",
                 (key,)) == run_before
    acts = actions(conn, "replace")
    assert len(acts) == 1 and acts[0]["effect_id"] == eid and acts[0]["operator"] == "ivy"
    assert acts[0]["detail"]["new_key"] == "ticket-981-correction"
    assert acts[0]["detail"]["new_effect_id"] == new

    # Repeating the same replacement changes nothing and says so.
    r = ok(ctl(db, "replace", eid, "--new-key", "ticket-981-correction", "--operator", "ivy",
               "--reason", "wrong amount in the note"))
    assert "already replaced" in r.stdout and new in r.stdout
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE replaces_effect = %s", (eid,)) == 1
    assert len(actions(conn, "replace")) == 1


def test_outboxctl_replace_with_a_new_target_and_payload(db, conn):
    eid = new_effect(conn, effect_type="email", target="old@example.com",
                     payload={"from": "a@example.com", "subject": "s", "text": "t"})
    arrange(conn, eid, "failed", last_error_class="terminal", completed_at="SQL:now()")
    payload = {"from": "a@example.com", "subject": "s", "text": "corrected"}
    ok(ctl(db, "replace", eid, "--new-key", "evt-77", "--operator", "jo", "--reason", "typo",
           "--target", "new@example.com", "--payload", json.dumps(payload)))
    n = query(conn, "SELECT effect_type, target, payload, replaces_effect::text FROM outbox_effects "
                    "WHERE idempotency_key = 'evt-77'")
    assert n == [("email", "new@example.com", payload, eid)]
    d = actions(conn, "replace")[0]["detail"]
    assert d["target_changed"] is True and d["payload_changed"] is True


@pytest.mark.parametrize("state,hint", [
    ("pending", "cancel it"), ("unknown", "resolve it"), ("sending", "wait for its outcome")])
def test_outboxctl_replace_refuses_while_the_original_may_still_go(db, conn, state, hint):
    eid = new_effect(conn)
    arrange(conn, eid, state)
    fails(ctl(db, "replace", eid, "--new-key", "k-new", "--operator", "a", "--reason", "r"),
          1, f"is {state}", hint)
    assert scalar(conn, "SELECT count(*) FROM workflow_runs WHERE idempotency_key = 'k-new'") == 0
    assert actions(conn) == []


def test_outboxctl_replace_refuses_a_taken_key_and_the_same_key(db, conn):
    eid = new_effect(conn)
    arrange(conn, eid, "failed", completed_at="SQL:now()")
    taken = make_run(conn, state="completed")
    fails(ctl(db, "replace", eid, "--new-key", taken, "--operator", "a", "--reason", "r"),
          1, "already belongs to another run (completed)")
    fails(ctl(db, "replace", eid, "--new-key", run_of(conn, eid), "--operator", "a",
              "--reason", "r"), 2, "must differ")
    fails(ctl(db, "replace", NO_SUCH, "--new-key", "k", "--operator", "a", "--reason", "r"),
          1, "no effect")
    assert scalar(conn, "SELECT count(*) FROM outbox_effects") == 1
    assert actions(conn) == []


# --- prune -----------------------------------------------------------------------------

# Months by their distance from this one (UTC), a few days in: the history
# is partitioned by the month an effect was created in.
def month_ago(n):
    return (f"(date_trunc('month', now() AT TIME ZONE 'UTC') - interval '{n} months' "
            f"+ interval '3 days') AT TIME ZONE 'UTC'")


def old_effect(conn, months, state=None, ended=None, key=None):
    """An effect created `months` months ago, finished `ended` ago (an
    interval) in `state` when given."""
    key = key or make_run(conn)
    eid = effect_created_at(conn, key, month_ago(months))
    if state in ("completed", "failed"):
        arrange(conn, eid, state, completed_at=f"SQL:now() - interval '{ended}'")
    elif state:
        arrange(conn, eid, state)
    return eid


def test_outboxctl_prune_removes_only_old_finished_rows_in_batches(db, conn):
    history_months(conn, "now() - interval '7 months'", "now()")
    old_done = [old_effect(conn, 3, "completed" if i % 2 else "failed", "40 days")
                for i in range(5)]
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, worker, "
                "started_at, ended_at, outcome_class) SELECT effect_id, created_at, 1, "
                "gen_random_uuid(), 'w1', now() - interval '41 days', now() - interval '41 days', "
                "'accepted' FROM effect_outbox WHERE effect_id = %s",
          (old_done[0],))
    recent = new_effect(conn)
    arrange(conn, recent, "completed", completed_at="SQL:now() - interval '1 day'")
    keep = {recent: "completed"}
    for state in ("pending", "unknown", "sending"):
        keep[old_effect(conn, 5, state)] = state

    r = ok(ctl(db, "prune", "--older-than", "30d", "--batch", "2"))
    assert "pruned 5 " in r.stdout and "3 batches" in r.stdout
    left = dict(query(conn, "SELECT effect_id::text, state FROM outbox_effects"))
    assert left == keep
    # Their month went whole, the attempts log with it.
    assert attempts(conn, old_done[0]) == []
    assert month_partition(conn, month_ago(3)) is None
    assert month_partition(conn, month_ago(5)) is not None
    acts = actions(conn, "prune")
    assert [a["detail"]["deleted"] for a in acts] == [2, 2, 1]
    assert all(a["reason"] == "retention: older than 30d" for a in acts)
    assert acts[0]["operator"] == OPERATOR_ROLE      # the login outboxctl used (run_ctl)
    assert "effect_history_" + scalar(conn, f"SELECT to_char({month_ago(3)} AT TIME ZONE 'UTC', "
                                            "'YYYYMM')") in acts[-1]["detail"]["dropped_partitions"]

    # This month is not over: its effects stay, however long ago they ended.
    r = ok(ctl(db, "prune", "--older-than", "1s", "--operator", "kim", "--reason", "disk"))
    assert "pruned 0 " in r.stdout and "1 batch " in r.stdout
    assert dict(query(conn, "SELECT effect_id::text, state FROM outbox_effects")) == keep


def part_oid(conn, n):
    return scalar(conn, "SELECT to_regclass('effect_history_' || "
                        f"to_char(({month_ago(n)}) AT TIME ZONE 'UTC', 'YYYYMM'))::oid")


def history_rows(conn, ids):
    return query(conn, "SELECT history_id, effect_id::text, created_at, attempt, outcome_class, "
                       "state, ended_at FROM effect_history WHERE effect_id = ANY (%s::uuid[]) "
                       "ORDER BY history_id", (list(ids),))


def test_outboxctl_prune_drops_a_finished_month_and_finishes_a_month_around_an_open_effect(db, conn):
    history_months(conn, "now() - interval '7 months'", "now()")
    gone = [old_effect(conn, 4, "completed", "100 days") for _ in range(3)]
    held_open = old_effect(conn, 3, "unknown")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "ended_at, outcome_class) SELECT effect_id, created_at, 1, 'w1', "
                "now() - interval '80 days', now() - interval '80 days', 'ambiguous' "
                "FROM effect_outbox WHERE effect_id = %s", (held_open,))
    held_done = old_effect(conn, 3, "failed", "80 days")
    # Recent evidence about an effect keeps its month.
    recent_log = old_effect(conn, 2, "completed", "50 days")
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "ended_at, outcome_class) SELECT effect_id, created_at, 1, 'w1', now(), now(), "
                "'reconcile_unknown' FROM effect_outbox WHERE effect_id = %s", (recent_log,))
    parts = {n: part_oid(conn, n) for n in (2, 3, 4)}
    assert all(parts.values()), parts
    kept_history = history_rows(conn, [held_open, recent_log])

    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 4 " in r.stdout
    assert month_partition(conn, month_ago(4)) is None
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE effect_id = ANY (%s::uuid[])",
                  (gone + [held_done],)) == 0
    # The open effect lingers in a month of its own: a new partition holds
    # its history, every row of it, and nothing else.
    assert part_oid(conn, 3) not in (None, parts[3])
    assert part_oid(conn, 2) == parts[2]
    assert {e: effect(conn, e)["state"] for e in (held_open, recent_log)} == \
        {held_open: "unknown", recent_log: "completed"}
    assert history_rows(conn, [held_open, recent_log]) == kept_history
    part3 = month_partition(conn, month_ago(3))
    assert scalar(conn, f"SELECT count(DISTINCT effect_id) FROM {part3}") == 1
    # A second run has nothing to gain: the month stays as it is.
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 0 " in r.stdout and part_oid(conn, 3) is not None
    oid3 = part_oid(conn, 3)
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert part_oid(conn, 3) == oid3

    # Once the open one is finished long enough, its month goes whole.
    arrange(conn, held_open, "completed", completed_at="SQL:now() - interval '31 days'")
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 1 " in r.stdout
    assert month_partition(conn, month_ago(3)) is None
    assert part_oid(conn, 2) == parts[2]


def test_outboxctl_prune_finishes_a_month_whatever_few_effects_linger(db, conn):
    """One effect parked at available_at 'infinity' (unknown, or held back
    by a paused scope) kept its whole month from prune: 21 bodies kept
    where a month without it dropped its 20.  Now the month's finished
    effects go, with their history; the two that linger keep every
    history row (and write new ones) in the month's new partition."""
    history_months(conn, "now() - interval '7 months'", "now()")
    done = [old_effect(conn, 3, "completed", "40 days") for _ in range(20)]
    unknown = old_effect(conn, 3, "unknown")
    held = old_effect(conn, 3, "pending")
    query(conn, "UPDATE effect_live SET available_at = 'infinity', held_by = 'host:api.example' "
                "WHERE effect_id = %s", (held,))
    # The reconciler's recent verdicts about the unknown one do not keep the month.
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "ended_at, outcome_class) SELECT effect_id, created_at, 1, 'w1', "
                "now() - interval '10 days', now() - interval '10 days', "
                "'reconcile_unknown' FROM effect_outbox WHERE effect_id = %s", (unknown,))
    before = history_rows(conn, [unknown, held])
    old = part_oid(conn, 3)

    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 20 " in r.stdout, r.stdout
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE effect_id = ANY (%s::uuid[])",
                  (done,)) == 0
    assert scalar(conn, "SELECT count(*) FROM effect_history WHERE effect_id = ANY (%s::uuid[])",
                  (done,)) == 0
    assert part_oid(conn, 3) not in (None, old)
    assert history_rows(conn, [unknown, held]) == before
    assert {effect(conn, e)["state"] for e in (unknown, held)} == {"unknown", "pending"}
    acts = actions(conn, "prune")
    assert month_partition(conn, month_ago(3)) in acts[-1]["detail"]["dropped_partitions"]
    # They keep writing their history there, and finish as ever.
    arrange(conn, unknown, "completed", completed_at="SQL:now() - interval '31 days'")
    arrange(conn, held, "failed", completed_at="SQL:now() - interval '31 days'")
    assert [effect(conn, e)["state"] for e in (unknown, held)] == ["completed", "failed"]
    part3 = month_partition(conn, month_ago(3))
    assert scalar(conn, f"SELECT count(*) FROM {part3} WHERE state IS NOT NULL") == 2
    r = ok(ctl(db, "prune", "--older-than", "5d"))
    assert "pruned 2 " in r.stdout
    assert month_partition(conn, month_ago(3)) is None


def test_outboxctl_prune_keeps_a_month_where_too_many_effects_are_open(db, conn):
    """More open effects than may linger (outbox_prune_linger_max) keep
    their month whole, finished neighbours and all."""
    history_months(conn, "now() - interval '7 months'", "now()")
    done = old_effect(conn, 3, "completed", "40 days")
    n = scalar(conn, "SELECT outbox_prune_linger_max()") + 1
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                f"created_at, available_at) SELECT %s, 'http', 'https://x.example/' || i, '{{}}', "
                f"{month_ago(3)}, {month_ago(3)} FROM generate_series(1, %s) i", (key, n))
    old = part_oid(conn, 3)
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 0 " in r.stdout
    assert effect(conn, done) is not None and part_oid(conn, 3) == old


def test_outboxctl_prune_keeps_an_original_while_its_replacement_exists(db, conn):
    history_months(conn, "now() - interval '7 months'", "now()")
    orig = old_effect(conn, 3, "failed", "40 days")
    ok(ctl(db, "replace", orig, "--new-key", "repl-1", "--operator", "a", "--reason", "r"))
    # An original and its replacement both old and finished go in one pass.
    first = old_effect(conn, 5, "failed", "100 days")
    second = effect_created_at(conn, make_run(conn), month_ago(4), replaces_effect=first)
    arrange(conn, second, "completed", completed_at="SQL:now() - interval '90 days'")

    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 2 " in r.stdout
    assert effect(conn, first) is None and effect(conn, second) is None
    assert month_partition(conn, month_ago(5)) is None
    assert month_partition(conn, month_ago(4)) is None
    # The replacement made this month holds its original's month back.
    assert effect(conn, orig)["state"] == "failed"
    assert month_partition(conn, month_ago(3)) is not None
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 0 " in r.stdout and effect(conn, orig) is not None


def test_outboxctl_prune_skips_rows_someone_holds_instead_of_waiting(db, conn):
    history_months(conn, "now() - interval '7 months'", "now()")
    held, free = old_effect(conn, 3, "completed", "40 days"), old_effect(conn, 3, "completed", "40 days")
    locker = psycopg2.connect(db)
    try:
        query(locker, "SELECT 1 FROM effect_outbox WHERE effect_id = %s FOR UPDATE", (held,))
        r = ok(run_ctl(["--db", db, "prune", "--older-than", "30d"], timeout=20))
        assert "pruned 1 " in r.stdout
        assert effect(conn, held) is not None and effect(conn, free) is None
        assert month_partition(conn, month_ago(3)) is not None   # not empty yet
    finally:
        locker.rollback()
        locker.close()
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 1 " in r.stdout
    assert month_partition(conn, month_ago(3)) is None


def test_outboxctl_prune_leaves_the_drop_to_the_next_run_while_a_reader_holds_the_history(db, conn):
    """Dropping a month takes the history's exclusive lock, which every
    worker's completion queues behind: prune waits a second at most for a
    long reader, keeps the deletes it made, and the next run drops the month."""
    history_months(conn, "now() - interval '7 months'", "now()")
    done = old_effect(conn, 3, "completed", "40 days")
    reader = psycopg2.connect(db)
    try:
        reader.cursor().execute("SELECT count(*) FROM effect_history")
        r = ok(run_ctl(["--db", db, "prune", "--older-than", "30d"], timeout=20))
        assert "pruned 1 " in r.stdout
        assert effect(conn, done) is None
        assert month_partition(conn, month_ago(3)) is not None
    finally:
        reader.rollback()
        reader.close()
    r = ok(ctl(db, "prune", "--older-than", "30d"))
    assert "pruned 0 " in r.stdout
    assert month_partition(conn, month_ago(3)) is None
    assert actions(conn, "prune")[-1]["detail"]["dropped_partitions"] != []


@pytest.mark.parametrize("age,words", [
    ("soon", "invalid input syntax for type interval"),
    ("0d", "must be positive"),
    ("-3 days", "must be positive"),
])
def test_outboxctl_prune_bad_age_is_a_usage_error(db, conn, age, words):
    eid = new_effect(conn)
    arrange(conn, eid, "completed", completed_at="SQL:now() - interval '400 days'")
    fails(ctl(db, "prune", "--older-than", age), 2, words)
    assert effect(conn, eid) is not None


# --- cancel ----------------------------------------------------------------------------

def test_outboxctl_cancel(db, conn):
    eid = new_effect(conn)
    query(conn, "UPDATE effect_live SET available_at = now() + interval '10 minutes' "
                "WHERE effect_id = %s", (eid,))
    r = ok(ctl(db, "cancel", eid, "--reason", "customer withdrew", "--operator", "lee"))
    assert "cancelled" in r.stdout and "never be sent" in r.stdout
    # It says the reason it stored, not a fixed one.
    assert "cancelled: customer withdrew" in r.stdout and "reason 'cancelled'" not in r.stdout
    e = effect(conn, eid)
    assert e["state"] == "failed" and e["last_error_class"] == "cancelled"
    assert "customer withdrew" in e["last_error"]
    acts = actions(conn, "cancel")
    assert [(a["effect_id"], a["operator"], a["reason"]) for a in acts] == \
        [(eid, "lee", "customer withdrew")]

    r = ok(ctl(db, "cancel", eid))
    assert "already cancelled" in r.stdout
    assert len(actions(conn, "cancel")) == 1


def test_outboxctl_cancel_defaults_to_the_login_and_refuses_late(db, conn):
    eid = new_effect(conn)
    ok(ctl(db, "cancel", eid))
    a = actions(conn, "cancel")[0]
    assert a["operator"] == OPERATOR_ROLE      # the login outboxctl used (run_ctl)

    sending = new_effect(conn)
    arrange(conn, sending, "sending", lease_owner=str(uuid.uuid4()), lease_worker="w2",
            sending_since="SQL:now()", lease_expires_at="SQL:now() + interval '1 minute'")
    fails(ctl(db, "cancel", sending), 1, "is sending, not pending", "can no longer be cancelled")
    assert effect(conn, sending)["state"] == "sending"
    done = new_effect(conn)
    arrange(conn, done, "completed")
    fails(ctl(db, "cancel", done), 1, "is completed")
    fails(ctl(db, "cancel", NO_SUCH), 1, "no effect")


# --- roles and the weekly figures -----------------------------------------------------

@pytest.fixture
def login(db, conn):
    made = []

    def make(group):
        name = f"t_ctl_{uuid.uuid4().hex[:8]}"
        query(conn, f'CREATE ROLE "{name}" LOGIN IN ROLE {group}')
        made.append(name)
        return f"{db} user={name}"

    yield make
    for name in made:
        query(conn, f'DROP OWNED BY "{name}"')
        query(conn, f'DROP ROLE IF EXISTS "{name}"')


def test_outboxctl_acts_need_the_operator_role(db, conn, login):
    eid = make_failed(conn)
    producer = login("outbox_producer")
    fails(run_ctl(["--db", producer, "requeue", eid, "--operator", "p", "--reason", "r"]), 3,
          "permission denied")
    fails(run_ctl(["--db", producer, "prune", "--older-than", "1d"]), 3, "permission denied")
    assert effect(conn, eid)["state"] == "failed"

    operator = login("outbox_operator")
    ok(run_ctl(["--db", operator, "requeue", eid, "--operator", "op", "--reason", "r"]))
    ok(run_ctl(["--db", operator, "unknown", "list", "--json"]))
    assert effect(conn, eid)["state"] == "pending"
    for fn in ("outbox_resolve_unknown", "outbox_requeue", "outbox_requeue_failed_since",
               "outbox_replace", "outbox_prune"):
        assert not scalar(conn, "SELECT bool_or(has_function_privilege('public', p.oid, 'EXECUTE')) "
                                "FROM pg_proc p WHERE proname = %s", (fn,)), fn


def test_outboxctl_weekly_stats_view(db, conn):
    # Claims: 4, of which 2 found the key taken.
    for outcome in ("claimed", "claimed", "busy", "done"):
        query(conn, "INSERT INTO run_claims (idempotency_key, outcome) VALUES ('k', %s)", (outcome,))
    # Approvals waited 10, 20 and 30 minutes.
    for minutes in (10, 20, 30):
        key = make_run(conn)
        query(conn, "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, "
                    "expires_at, created_at, consumed_at, decision) "
                    "VALUES (%s, sha256(random()::text::bytea), '{approve}', now() + interval '1 day', "
                    "now() - make_interval(mins => %s), now(), 'approve')", (key, minutes))
    # Effects: 5; 1 human-approved; 1 failed invalid; 2 failed after retries.
    ids = [effect_created_at(conn, make_run(conn), approved_by="sam")]
    ids += [new_effect(conn) for _ in range(4)]
    arrange(conn, ids[1], "failed", last_error_class="invalid", completed_at="SQL:now()")
    arrange(conn, ids[2], "failed", last_error_class="retry", completed_at="SQL:now()")
    arrange(conn, ids[3], "failed", last_error_class="ambiguous", completed_at="SQL:now()")

    with conn.cursor() as c:
        c.execute("SELECT * FROM outbox_weekly_stats LIMIT 1")
        cols = [d[0] for d in c.description]
        w = dict(zip(cols, c.fetchone()))
    assert scalar(conn, "SELECT count(*) FROM outbox_weekly_stats") == 26
    assert w["claims"] == 4 and w["duplicate_claims"] == 2
    assert float(w["duplicate_share"]) == 0.5
    assert w["approvals_consumed"] == 3
    assert abs(float(w["approval_wait_p50_seconds"]) - 1200) < 5
    assert abs(float(w["approval_wait_p95_seconds"]) - 1740) < 5   # 20 + 0.9 * 10 minutes
    assert w["effects_created"] == 5 and w["validation_failures"] == 1
    assert float(w["validation_failure_share"]) == 0.2
    assert w["automatic"] == 4 and w["human_approved"] == 1
    assert float(w["automatic_share"]) == 0.8
    assert w["retries_exhausted"] == 2
    assert scalar(conn, "SELECT has_table_privilege('outbox_operator', 'outbox_weekly_stats', "
                        "'SELECT')")


def test_workers_weekly_figures_are_the_views_current_week(db, conn, login):
    """The workers compute this week only (outbox_weekly_figures); the figures they export
    are the view's newest row, and rows of earlier weeks count in neither."""
    history_months(conn, "now() - interval '2 months'", "now()")
    for ago in ("0", "3 weeks"):
        for outcome in ("claimed", "busy", "claimed"):
            query(conn, "INSERT INTO run_claims (idempotency_key, outcome, claimed_at) "
                        "VALUES ('k', %s, now() - %s::interval)", (outcome, ago))
        for minutes in (5, 50):
            key = make_run(conn)
            query(conn, "INSERT INTO approvals (idempotency_key, token_hash, allowed_decisions, "
                        "expires_at, created_at, consumed_at, decision) "
                        "VALUES (%s, sha256(random()::text::bytea), '{approve}', now() + interval '1 day', "
                        "now() - %s::interval - make_interval(mins => %s), now() - %s::interval, "
                        "'approve')", (key, ago, minutes, ago))
        created = f"now() - interval '{ago} seconds'" if ago == "0" else f"now() - interval '{ago}'"
        key = make_run(conn)
        ids = [effect_created_at(conn, key, created, approved_by="sam")]
        ids += [effect_created_at(conn, key, created) for _ in range(3 if ago == "0" else 1)]
        arrange(conn, ids[1], "failed", last_error_class="invalid", completed_at="SQL:now()")
    with conn.cursor() as c:
        c.execute("SELECT * FROM outbox_weekly_figures('t', 0)")
        cols = [d[0] for d in c.description]
        mine = dict(zip(cols, c.fetchone()))
        c.execute("SELECT * FROM outbox_weekly_stats ORDER BY week_start DESC LIMIT 1")
        cols = [d[0] for d in c.description]
        view = dict(zip(cols, c.fetchone()))
    for k in ("duplicate_share", "approval_wait_p50_seconds", "approval_wait_p95_seconds",
              "validation_failure_share", "automatic_share", "retries_exhausted"):
        assert mine[k] == view[k], (k, mine, view)
    assert view["effects_created"] == 4 and float(view["automatic_share"]) == 0.75
    assert view["claims"] == 3 and view["approvals_consumed"] == 2
    earlier = query(conn, "SELECT effects_created, claims, approvals_consumed FROM outbox_weekly_stats "
                          "WHERE week_start = date_trunc('week', (now() - interval '3 weeks') "
                          "AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'")
    assert earlier == [(2, 3, 2)]
    # Both roles that read the view still do (it calls the function now).
    for role in ("outbox_operator", "outbox_dispatcher"):
        with psycopg2.connect(login(role)) as oc, oc.cursor() as c:
            c.execute("SELECT count(*) FROM outbox_weekly_stats")
            assert c.fetchone()[0] == 26, role
    # A far-off start is bounded: two years of weeks, not thousands.
    assert scalar(conn, "SELECT count(*) FROM outbox_weekly_stats_since('-infinity')") == 105
