# SPDX-License-Identifier: ISC
"""A provider's acceptance that arrives after the provider itself gave up
(host->late_result; sql/functions/50_reconcile.sql
outbox_resolve_late_accepted): the relay's 250 after the email provider's
own timeout completes the `unknown` effect with the relay's queue id.

- end to end: a relay that answers the end of data 250 only after the
  provider's timeout -> the worker records `unknown` (ambiguous), the 250
  arrives, the effect ends `completed` with the queue id, received once,
  counted as late_accepted;
- the SQL rules: only `unknown` effects, only the attempt that went
  ambiguous, only its own lease owner (or the owner the reaper's row
  names), repeated calls change nothing, the run advances, and only the
  dispatcher role may call it.

Real workers, real PostgreSQL, the scripted SMTP peer
(tests/servers/smtp_server.py).  No fixed sleeps.
"""
import json

import psycopg2
import pytest

from effect_arrange import arrange
from outbox_test import (attempts, effect, enqueue, free_port, kill_switch, query, scalar,
                         unknown_resolved, wait_for)

OWNER = "11111111-1111-4111-8111-111111111111"
OTHER = "22222222-2222-4222-8222-222222222222"
DOMAIN = "outbox-dispatcher.invalid"


def rows(conn, eid):
    return query(conn, "SELECT attempt, outcome_class, cas_applied, resolution, lease_owner IS NULL, "
                       "provider_id FROM effect_attempts WHERE effect_id = %s ORDER BY attempt_id",
                 (eid,))


def run_state(conn, eid):
    """The run's state as a reader gets it: settled from its effects first."""
    key = scalar(conn, "SELECT idempotency_key FROM effect_outbox WHERE effect_id = %s", (eid,))
    query(conn, "SELECT outbox_settle_runs(ARRAY[%s])", (key,))
    return scalar(conn, "SELECT state FROM workflow_runs WHERE idempotency_key = %s", (key,))


# -- end to end -------------------------------------------------------------

def test_relays_late_250_completes_the_unknown_email(conn, dispatchers, smtp, tmp_path):
    kill_switch(conn, True)
    port = free_port()
    w = dispatchers({"provider.email": {"server": f"127.0.0.1:{smtp.port}", "starttls": "off",
                                        "timeout_ms": 2500, "connect_timeout_ms": 1000,
                                        "max_attempts": 3, "breaker_failures": 1000},
                     "provider.http": None,
                     "metrics": {"listen": f"127.0.0.1:{port}"},
                     "dispatcher": {"providers": "email"}})
    eid = str(enqueue(conn, "email", "bob+slow-data-2900@example.com",
                      {"from": "Outbox <noreply@example.com>", "subject": "Your refund",
                       "text": "Hello,\nyour refund is on its way.\n"}))
    key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    mid = f"<{key}@{DOMAIN}>"
    # First the provider's own verdict: the terminator went out, no reply
    # within timeout_ms -> ambiguous, recorded as unknown (the session's
    # thread keeps reading 800 ms past the deadline, so a 250 at 2.9 s
    # still reaches it) ...
    wait_for(lambda: [a for a in attempts(conn, eid) if a["outcome_class"] == "ambiguous"],
             what="the ambiguous attempt")
    # ... then the relay's 250 completes it with the relay's queue id.
    e = wait_for(lambda: (lambda x: x if x["state"] == "completed" else None)(effect(conn, eid)),
                 timeout=20, what="the late 250 to complete the effect")
    qid = [m["queue_id"] for m in smtp.received() if m["message_id"] == mid and m["replied"]]
    assert len(qid) == 1, "received exactly once, answered once"
    assert e["provider_id"] == qid[0]
    got = rows(conn, eid)
    assert [(r[0], r[1], r[3], r[4]) for r in got] == [
        (1, "ambiguous", None, False),
        (1, "reconciled_sent", "late_accepted", True)], got
    assert got[1][5] == qid[0]
    assert run_state(conn, eid) == "completed"
    wait_for(lambda: unknown_resolved(port, "late_accepted") == 1, what="the late_accepted counter")
    assert any(ev.get("event") == "unknown_resolved" and ev.get("how") == "late_accepted"
               and ev.get("effect_id") == eid for ev in w.events())
    # Never sent again: a later effect through the same worker goes first.
    later = str(enqueue(conn, "email", "carol@example.com",
                        {"from": "noreply@example.com", "subject": "s", "text": "t"}))
    wait_for(lambda: effect(conn, later)["state"] == "completed", what="a later email")
    assert smtp.count(mid) == 1


# -- the SQL rules ------------------------------------------------------------

def sending_effect(conn, owner=OWNER):
    eid = str(enqueue(conn, "email", "bob@example.com", {"from": "a@example.com", "text": "t"}))
    arrange(conn, eid, "sending", attempts=1, lease_owner=owner, lease_worker="w",
            leased_at="SQL:now()", sending_since="SQL:now()",
            lease_expires_at="SQL:now() - interval '1 s'")
    return eid


def complete_ambiguous(conn, eid, owner=OWNER):
    res = [{"effect_id": eid, "attempt": 1, "outcome": "ambiguous", "next_state": "unknown",
            "retry_delay_ms": 0, "error": "timed out after the end of data"}]
    return query(conn, "SELECT applied, state FROM outbox_complete(%s, 'w', %s)",
                 (owner, json.dumps(res)))[0]


def late(conn, eid, owner=OWNER, attempt=1, pid="Q1"):
    return scalar(conn, "SELECT outbox_resolve_late_accepted(%s, 'w', %s, %s, 250, %s)",
                  (owner, eid, attempt, pid))


def test_sql_late_acceptance_resolves_only_its_own_ambiguous_attempt(conn):
    a, b, c, d, f = (sending_effect(conn) for _ in range(5))
    for x in (a, b, c, d):
        assert complete_ambiguous(conn, x) == (True, "unknown")
    # The worker's own ambiguous attempt: completed with the id, once.
    assert late(conn, a) == "late_accepted"
    assert (effect(conn, a)["state"], effect(conn, a)["provider_id"]) == ("completed", "Q1")
    assert run_state(conn, a) == "completed"
    # A repeated call (its first answer lost with the connection): the same
    # answer, nothing changes.
    assert late(conn, a, pid="Q2") == "late_accepted"
    assert effect(conn, a)["provider_id"] == "Q1" and len(rows(conn, a)) == 2
    assert [(r[1], r[3]) for r in rows(conn, a)] == [("ambiguous", None), ("reconciled_sent", "late_accepted")]
    # Another owner's evidence: not its attempt.
    assert late(conn, b, owner=OTHER) is None
    # Another attempt (an operator requeued it and it went again): no.
    query(conn, "UPDATE effect_live SET attempts = 2 WHERE effect_id = %s", (c,))
    assert late(conn, c) is None
    # An unknown effect an operator already resolved: no.
    arrange(conn, d, "failed")
    assert late(conn, d) is None
    # Still sending (the worker's own verdict not recorded yet): no.
    assert late(conn, f) is None and effect(conn, f)["state"] == "sending"
    for x in (b, c, d, f):
        assert [r[3] for r in rows(conn, x)] in ([None], []), rows(conn, x)
    # The reaper's row naming this owner is evidence of the attempt too.
    g = sending_effect(conn)
    got = dict(query(conn, "SELECT effect_id::text, state FROM outbox_reap('r', 10)"))
    assert got[g] == "unknown"
    assert late(conn, g) == "late_accepted" and effect(conn, g)["state"] == "completed"


def test_sql_only_the_dispatcher_role_may_resolve(conn, login_as):
    eid = sending_effect(conn)
    complete_ambiguous(conn, eid)
    # (outbox_operator is a member of outbox_dispatcher: it may.)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        late(login_as("outbox_producer"), eid)
    assert late(login_as("outbox_dispatcher"), eid) == "late_accepted"
