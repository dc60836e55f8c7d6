# SPDX-License-Identifier: ISC
"""Effects in every state for the console's tests."""
import uuid

from outbox_test import query


HOSTILE_KEY = "run-<script>alert(1)</script>-\"q'-\u202egnp.exe"


def new_effect(conn, key=None, target=None, effect_type="http", payload=None, run=True):
    """A pending effect in a run of its own (key), or, with run=False, in
    the existing run key; the run is left approved."""
    from outbox_test import enqueue, make_run
    if run:
        key = make_run(conn, key=key)
    query(conn, "UPDATE workflow_runs SET state = 'processing' WHERE idempotency_key = %s", (key,))
    eid = str(enqueue(conn, effect_type, target or f"https://sink.example/{uuid.uuid4().hex[:6]}",
                      payload or {"body": {"n": 1}}, key=key))
    query(conn, "UPDATE workflow_runs SET state = 'approved' WHERE idempotency_key = %s", (key,))
    return eid


def new_unknown(conn, attempts, last_error, worker, status, reply):
    """An effect left unknown by an ambiguous call: its attempt in the
    history with the worker, the provider's status and reply."""
    from effect_arrange import arrange
    u = new_effect(conn)
    arrange(conn, u, "unknown", attempts=attempts, last_error_class="ambiguous",
            last_error=last_error)
    query(conn, "INSERT INTO effect_history (effect_id, created_at, attempt, lease_owner, "
                "worker, started_at, outcome_class, provider_status, error_text) SELECT "
                "effect_id, created_at, %s, gen_random_uuid(), %s, now(), 'ambiguous', %s, %s "
                "FROM effect_outbox WHERE effect_id = %s", (attempts, worker, status, reply, u))
    return u


def populate(conn):
    """Effects in every state (two unknown with an ambiguous call each,
    two failed), one under a producer's hostile run key."""
    from effect_arrange import arrange
    ids = {"pending": [new_effect(conn, key=HOSTILE_KEY)]}
    s = new_effect(conn)
    arrange(conn, s, "sending", lease_owner=str(uuid.uuid4()), lease_worker="w1",
            sending_since="SQL:now()", lease_expires_at="SQL:now() + interval '1 minute'")
    ids["sending"] = [s]
    ids["completed"] = []
    for _ in range(2):
        c = new_effect(conn)
        arrange(conn, c, "completed", completed_at="SQL:now() - interval '5 minutes'")
        ids["completed"].append(c)
    ids["failed"] = []
    for _ in range(2):
        f = new_effect(conn, target="https://failing.example/x")
        arrange(conn, f, "failed", attempts=5, last_error_class="retry",
                last_error="retry: gave up", completed_at="SQL:now() - interval '10 minutes'")
        ids["failed"].append(f)
    ids["unknown"] = []
    for _ in range(2):
        ids["unknown"].append(new_unknown(conn, 1, "timeout after the request was sent", "w1",
                                          504, "gateway timeout"))
    return ids
