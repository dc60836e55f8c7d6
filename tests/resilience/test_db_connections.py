# SPDX-License-Identifier: ISC
"""Which of a worker's two database connections carries what.

Each worker holds a lease connection (lease, mark, renew, release) and a
records connection (housekeeping, invalid rows, reconciliation).  Outcomes
(`outbox_complete_sending`) go on the records connection while the queue is short,
so that a lease never waits for one, and on the lease connection in a
backlog (three full leases in a row), so that a worker keeps one database
backend busy instead of two; `[database] busy_connections = 2` keeps them on
the records connection always.  Observed through pg_stat_activity, where
the connections are named `outbox lease <worker>` and `outbox records
<worker>`: its `query` column is each backend's current or last statement.
"""
import re

import pytest

from outbox_test import enqueue, kill_switch, make_run, query, scalar, states, wait_for


def sample_roles(conn, worker):
    """{role: last statement} of the worker's backends in this database."""
    rows = query(conn, "SELECT application_name, query FROM pg_stat_activity "
                       "WHERE datname = current_database() AND application_name IN (%s, %s)",
                 (f"outbox lease {worker}", f"outbox records {worker}"))
    return {name.split(" ")[1]: q for name, q in rows}


def watch_until(conn, worker, done, timeout=60):
    """Sample the worker's backends until done(); per role, how many samples
    showed a completion (outbox_complete_sending, or outbox_complete_rest
    for the rows it leaves), and how many samples were taken."""
    seen = {"lease": 0, "records": 0}
    n = 0

    def step():
        nonlocal n
        n += 1
        for role, q in sample_roles(conn, worker).items():
            if re.search(r"\boutbox_complete(_sending|_rest)?\(", q or ""):
                seen[role] = seen.get(role, 0) + 1
        return done()

    wait_for(step, timeout=timeout, interval=0.001, what="the run to finish")
    return seen, n


def test_the_connections_are_named_in_pg_stat_activity(conn, dispatchers):
    dispatchers(name="named")
    wait_for(lambda: set(sample_roles(conn, "named")) == {"lease", "records"},
             what="both connections in pg_stat_activity")


def backlog(conn, sink, n):
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/ok?' || g, '{}' FROM generate_series(1, %s) g",
          (key, sink.url, n))


@pytest.mark.parametrize("busy,on_lease", [(1, True), (2, False)])
def test_a_backlogs_outcomes_go_on_the_lease_connection_unless_two_are_busy(
        conn, dispatchers, sink, busy, on_lease):
    kill_switch(conn, True)
    n = 1500
    backlog(conn, sink, n)
    dispatchers({"database": {"busy_connections": busy},
                 "dispatcher": {"batch_size": 8, "complete_batch": 8},
                 "provider.http": {"max_attempts": 1}}, name="drain")
    # Counted from the finishing history rows (one per effect here: one
    # attempt each), cheap enough to sample between statements.
    seen, samples = watch_until(conn, "drain", lambda: scalar(
        conn, "SELECT count(*) FROM effect_history WHERE state = 'completed'") == n)
    assert states(conn) == {"completed": n}
    assert samples > 50, "enough samples to see the statements"
    if on_lease:
        assert seen["lease"] > 0, f"outcomes recorded on the lease connection ({seen}, {samples} samples)"
    else:
        assert seen["lease"] == 0, f"no outcome on the lease connection ({seen}, {samples} samples)"
        assert seen["records"] > 0, f"outcomes on the records connection ({seen})"


def test_single_effects_outcomes_go_on_the_records_connection(conn, dispatchers, sink):
    kill_switch(conn, True)
    dispatchers({"provider.http": {"max_attempts": 1}}, name="single")
    total = {"lease": 0, "records": 0}
    samples = 0
    for i in range(15):
        eid = enqueue(conn, "http", sink.url + f"/ok?{i}", {})
        seen, n = watch_until(conn, "single", lambda: query(
            conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (eid,))[0][0] == "completed")
        samples += n
        for role in total:
            total[role] += seen.get(role, 0)
    assert total["lease"] == 0, f"no outcome on the lease connection ({total}, {samples} samples)"
    assert total["records"] > 0, f"outcomes on the records connection ({total})"
