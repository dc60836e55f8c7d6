# SPDX-License-Identifier: ISC
"""Effects forced into a state by a test, as the table owner, the way the
functions move them (docs/design.md, "State changes"): an open state
rewrites the effect's live row (an `unknown` one never due, a `sending` one
under a call row of its own, as a claim leaves it); a finished state
deletes the live row and writes the finishing history row in the same
statement; an effect made in an earlier month gets its creation time at
insert (the history's partition key), never by an update.
"""
from outbox_test import query, scalar

# Columns of effect_live a scenario may set; completed_at is the finishing
# row's ended_at.
LIVE_COLUMNS = {
    "attempts", "retry_base", "lease_owner", "lease_worker", "leased_at", "lease_expires_at",
    "sending_since", "mark_token", "sending_idempotent", "provider_id", "last_error_class",
    "last_error", "last_status", "last_reconciled_at", "updated_at", "available_at",
}


def _sets(cols):
    sets, args = [], []
    for k, v in cols.items():
        if k not in LIVE_COLUMNS:
            raise ValueError(f"arrange: {k} is not a column of effect_live")
        if isinstance(v, str) and v.startswith("SQL:"):
            sets.append(f"{k} = {v[4:]}")
        else:
            sets.append(f"{k} = %s")
            args.append(v)
    return sets, args


def _reopen(conn, eid):
    """A finished effect back in the live queue (pending), as a requeue
    leaves it, so that it can be arranged again."""
    query(conn, "INSERT INTO effect_live (effect_id, effect_type, created_at, available_at, "
                "attempts, retry_base, provider_id, last_error_class, last_error, last_status) "
                "SELECT b.effect_id, b.effect_type, b.created_at, now(), h.attempt, "
                "coalesce(h.retry_base, 0), h.last_provider_id, h.last_error_class, h.last_error, "
                "h.provider_status "
                "FROM effect_outbox b JOIN LATERAL (SELECT * FROM effect_history x "
                "  WHERE x.effect_id = b.effect_id AND x.created_at = b.created_at "
                "    AND x.state IS NOT NULL ORDER BY x.history_id DESC LIMIT 1) h ON true "
                "WHERE b.effect_id = %s AND NOT EXISTS "
                "  (SELECT 1 FROM effect_live l WHERE l.effect_id = b.effect_id)", (eid,))


def arrange(conn, eid, state, completed_at=None, **cols):
    """Force an effect into a state, with whatever columns the scenario needs
    (a value "SQL:expr" is an SQL expression)."""
    _reopen(conn, eid)
    if state == "unknown":
        cols.setdefault("available_at", "infinity")
    if state == "sending":
        cols.setdefault("lease_owner", "SQL:gen_random_uuid()")
        cols.setdefault("lease_worker", "test-worker")
        cols.setdefault("leased_at", "SQL:now()")
        cols.setdefault("lease_expires_at", "SQL:now() + interval '5 minutes'")
        cols.setdefault("sending_since", "SQL:now()")
        cols.setdefault("mark_token", "SQL:gen_random_uuid()")
    sets, args = _sets(cols)
    live_state = state if state in ("pending", "sending", "unknown") else None
    if live_state:
        sets.insert(0, "state = %s")
        args.insert(0, live_state)
    if sets:
        query(conn, f"UPDATE effect_live SET {', '.join(sets)} WHERE effect_id = %s",
              args + [eid])
    if state == "sending":
        query(conn, "INSERT INTO effect_calls (call, lease_owner, worker, ids, deadline) "
                    "SELECT mark_token, lease_owner, lease_worker, ARRAY[effect_id], "
                    "lease_expires_at FROM effect_live WHERE effect_id = %s "
                    "ON CONFLICT (call) DO NOTHING", (eid,))
    if live_state:
        return
    if state not in ("completed", "failed"):
        raise ValueError(f"arrange: no such state {state}")
    ended = "now()"
    extra = []
    if isinstance(completed_at, str) and completed_at.startswith("SQL:"):
        ended = completed_at[4:]
    elif completed_at is not None:
        ended = "%s"
        extra = [completed_at]
    query(conn, "WITH gone AS (DELETE FROM effect_live WHERE effect_id = %s RETURNING *) "
                "INSERT INTO effect_history (effect_id, created_at, attempt, worker, started_at, "
                "ended_at, state, last_error_class, last_error, last_provider_id, "
                "provider_status, retry_base) "
                f"SELECT effect_id, created_at, attempts, 'test', {ended}, {ended}, %s, "
                "last_error_class, last_error, provider_id, last_status, retry_base FROM gone",
          [eid] + extra + extra + [state])


def effect_created_at(conn, key, created_at="now()", effect_type="http", target=None,
                      payload="{}", replaces_effect=None, approved_by=None):
    """An effect of run `key` (processing, for the approval gate) created at
    `created_at` (an SQL expression), inserted as the table owner; pending,
    as the producer's insert leaves it."""
    target = target or f"https://sink.example/{scalar(conn, 'SELECT gen_random_uuid()')}"
    return str(scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, "
                            "payload, created_at, available_at, replaces_effect, approved_by) "
                            f"VALUES (%s, %s, %s, %s::jsonb, {created_at}, {created_at}, %s, %s) "
                            "RETURNING effect_id", (key, effect_type, target, payload,
                                                    replaces_effect, approved_by)))


def history_months(conn, before, after):
    """The history's monthly partitions from `before` (an SQL expression)
    to `after`, made where missing (the workers keep only months ahead)."""
    query(conn, f"SELECT outbox_history_partitions({before}, {after})")


def month_partition(conn, at):
    """The name of the history partition of the month holding `at` (SQL),
    or None when that month has none."""
    return scalar(conn, "SELECT to_regclass('effect_history_' || "
                        f"to_char(({at}) AT TIME ZONE 'UTC', 'YYYYMM'))::text")
