"""The lease keeps using the due index when the table grows under a worker's
session (sql/008_lease_plans.sql).

PL/pgSQL caches a generic plan of a statement after five calls.  Cached
while effect_outbox was empty, the lease's plan read the whole table on
every call until the next ANALYZE (at 1,000 effects/s from an empty table:
26-160 ms per lease and a queue that ran away for a minute).  The plans
are read with auto_explain, sent to this session as NOTICEs.
"""
import uuid

from outbox_test import kill_switch, make_run, query

LEASE = "SELECT count(*) FROM outbox_lease(%s, 'w', %s, 30, '{http}', true, %s, %s)"


def plans_of(conn, sql, args):
    """The plans auto_explain reports for the statements sql runs,
    nested ones included."""
    query(conn, "LOAD 'auto_explain'")
    for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                    "auto_explain.log_level = notice", "client_min_messages = notice"):
        query(conn, "SET " + setting)
    del conn.notices[:]
    query(conn, sql, args)
    query(conn, "SET auto_explain.log_min_duration = -1")
    return "\n".join(conn.notices)


def test_lease_uses_the_due_index_after_the_table_grew_in_the_same_session(conn):
    kill_switch(conn, True)
    owner = str(uuid.uuid4())
    # A fresh install: the table is empty and its statistics say so.
    query(conn, "ANALYZE effect_outbox")
    # More calls than PL/pgSQL needs to settle on a cached plan, from both
    # the head and a position.
    for _ in range(8):
        query(conn, LEASE, (owner, 10, None, None))
        query(conn, LEASE, (owner, 10, "2000-01-01", str(uuid.uuid4())))
    # Then a busy morning, before autoanalyze has looked at the table.
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, 20000) g",
          (key,))
    for args in ((owner, 5, None, None), (owner, 5, "2000-01-01", str(uuid.uuid4()))):
        plans = plans_of(conn, LEASE, args)
        assert "effect_outbox_due_idx" in plans, plans
        assert "Seq Scan on effect_outbox" not in plans, plans
