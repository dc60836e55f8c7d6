# SPDX-License-Identifier: ISC
"""Housekeeping shared by the fleet: the sweep of effects no provider serves
runs once per interval for the whole fleet, the weekly figures are
computed once per interval, read only this week's rows and are exported
as metrics, and a slow or cut housekeeping pass never stops the next.
"""
import re
import time

from effect_arrange import history_months, month_partition
from outbox_test import (effect, enqueue, free_port, http_cfg, kill_switch, make_run, plans_of,
                         query, scalar, states, wait_for)


def test_weekly_figures_are_exported_as_metrics(conn, dispatchers, sink):
    import urllib.request
    kill_switch(conn, True)
    for i in range(3):
        enqueue(conn, "http", sink.url + f"/ok?{i}", {})
    port = free_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"}, **http_cfg()})
    wait_for(lambda: states(conn).get("completed") == 3, what="delivered")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r"^outbox_week_automatic_share (\S+)$", text, re.M)
        return m and float(m.group(1)) == 1.0 and text
    text = wait_for(scrape, what="weekly gauges")
    for name in ("outbox_week_duplicate_delivery_share", "outbox_week_approval_wait_p95_seconds",
                 "outbox_week_validation_failure_share", "outbox_week_retries_exhausted"):
        assert re.search(rf"^{name} ", text, re.M), name


def hold_the_sweep(conn, db):
    """Make the fleet-wide sweep due and hold its row, so that the next
    housekeeping pass waits there until the returned connection lets go."""
    import psycopg2
    query(conn, "UPDATE outbox_sweeps SET last_run = '2000-01-01'")
    holder = psycopg2.connect(db)
    holder.cursor().execute("SELECT 1 FROM outbox_sweeps WHERE id = 1 FOR UPDATE")
    return holder


def sweep_waiting(conn):
    """The pid of the worker backend whose sweep waits on the held row (in
    this test's database: tests run in parallel on one server)."""
    return scalar(conn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE '%%outbox_sweep%%'")


def scrape_metric(port, name):
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_a_slow_housekeeping_pass_spaces_the_next_ones(conn, db, dispatchers):
    """While vacuum is held back the reaper's and the lag gauge's index scans
    walk dead entries; a pass every maintenance_interval_ms would then spend
    a large share of the records connection and of the database's CPU on
    them.  The next pass starts no sooner than ten times the last one's
    duration after it, and it does start."""
    kill_switch(conn, True)
    # The first pass waits at the sweep.
    holder = hold_the_sweep(conn, db)
    port = free_port()
    # lease_seconds 30: the backoff is capped at half of it.
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"},
                 "dispatcher": {"maintenance_interval_ms": 100, "lease_seconds": 30}, **http_cfg()})

    def metric(name):
        return scrape_metric(port, name)

    wait_for(lambda: sweep_waiting(conn), what="the sweep waiting")
    time.sleep(1.0)   # the pass is slow for this long: the scenario, not a wait
    holder.rollback()
    holder.close()
    wait_for(lambda: (metric("outbox_maintenance_pass_seconds") or 0) >= 1.0, what="the slow pass to end")
    ended = time.monotonic()
    passes = metric("outbox_maintenance_passes_total")
    # At maintenance_interval_ms = 100 there would be some 40 passes in the
    # next four seconds; the backoff allows none before ten seconds.
    time.sleep(4.0)
    assert metric("outbox_maintenance_passes_total") == passes
    wait_for(lambda: metric("outbox_maintenance_passes_total") > passes, timeout=30,
             what="the next pass")
    assert time.monotonic() - ended >= 9.5
    # A fast pass brings the period back to the interval.
    fast = metric("outbox_maintenance_passes_total")
    wait_for(lambda: metric("outbox_maintenance_passes_total") >= fast + 5, timeout=10,
             what="passes at the configured interval again")


def test_a_pass_cut_by_a_lost_connection_does_not_pause_housekeeping(conn, db, dispatchers):
    """The rest of a pass whose connection broke runs after the reconnect;
    timing that pass would charge the outage to housekeeping and pause the
    reaper for ten times as long.  It is not timed: passes resume at the
    configured interval."""
    kill_switch(conn, True)
    holder = hold_the_sweep(conn, db)
    port = free_port()
    dispatchers({"metrics": {"listen": f"127.0.0.1:{port}"},
                 "dispatcher": {"maintenance_interval_ms": 500, "lease_seconds": 60},
                 "database": {"reconnect_min_ms": 20, "reconnect_max_ms": 200}, **http_cfg()})

    def passes():
        return scrape_metric(port, "outbox_maintenance_passes_total") or 0.0

    pid = wait_for(lambda: sweep_waiting(conn), what="the sweep waiting")
    time.sleep(2.0)   # the pass has been running this long when its connection breaks
    query(conn, "SELECT pg_terminate_backend(%s)", (pid,))
    holder.rollback()
    holder.close()
    # Timed, the cut pass would allow no pass for some 20 s (and a pass
    # started before its rest answered would hide that: hence 500 ms).
    wait_for(lambda: passes() >= 4, timeout=8, what="passes at the configured interval after the reconnect")


def test_sweep_runs_once_per_interval_for_the_whole_fleet(conn):
    query(conn, "UPDATE outbox_sweeps SET last_run = '-infinity'")
    key = make_run(conn)
    old = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                       "created_at) VALUES (%s, 'nobody-serves-this', 'x', '{}', "
                       "now() - interval '1 hour') RETURNING effect_id", (key,))
    assert query(conn, "SELECT * FROM outbox_sweep('a', 60, 30)") == [(old, "nobody-serves-this")]
    assert scalar(conn, "SELECT last_worker FROM outbox_sweeps") == "a"
    # Another worker within the interval: nothing done, nothing waited for.
    key2 = make_run(conn)
    old2 = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                        "created_at) VALUES (%s, 'nobody-serves-this', 'y', '{}', "
                        "now() - interval '1 hour') RETURNING effect_id", (key2,))
    assert query(conn, "SELECT * FROM outbox_sweep('b', 60, 30)") == []
    assert scalar(conn, "SELECT last_worker FROM outbox_sweeps") == "a"
    assert effect(conn, old2)["state"] == "pending"
    # Once the interval has passed, the next caller sweeps.
    query(conn, "UPDATE outbox_sweeps SET last_run = now() - interval '31 seconds'")
    assert query(conn, "SELECT * FROM outbox_sweep('b', 60, 30)") == [(old2, "nobody-serves-this")]
    assert scalar(conn, "SELECT last_worker FROM outbox_sweeps") == "b"


def test_weekly_figures_are_computed_once_per_interval_for_the_fleet(conn):
    """Workers read the cached figures; one recomputes them when they are
    older than the interval."""
    enqueue(conn, "http", "http://127.0.0.1:9/x", {})
    first = query(conn, "SELECT automatic_share, refreshed_at FROM outbox_weekly_figures('a', 300)")
    assert first[0][0] == 1
    assert scalar(conn, "SELECT refreshed_by FROM outbox_weekly_cache") == "a"
    # A human-approved effect halves the automatic share, but within the
    # interval the cached figure is what every worker gets.
    key = make_run(conn)
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, approved_by) "
                "VALUES (%s, 'http', 'http://127.0.0.1:9/y', '{}', 'alice')", (key,))
    assert query(conn, "SELECT automatic_share, refreshed_at FROM outbox_weekly_figures('b', 300)") == first
    assert scalar(conn, "SELECT refreshed_by FROM outbox_weekly_cache") == "a"
    # Past the interval the next caller recomputes.
    assert query(conn, "SELECT automatic_share FROM outbox_weekly_figures('b', 0)")[0][0] == 0.5
    assert scalar(conn, "SELECT refreshed_by FROM outbox_weekly_cache") == "b"


def test_weekly_figures_read_only_this_weeks_rows(conn):
    """The workers' weekly figures (outbox_weekly_figures) read this week's effects through
    the block-range indexes on the bodies' created_at and the history's ended_at, not
    every row: with the view's 26 weeks they read every row kept, some twenty seconds at
    two million."""
    history_months(conn, "now() - interval '4 months'", "now()")
    key = make_run(conn)
    old = [r[0] for r in query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, "
                                     "target, payload, created_at) SELECT %s, 'http', "
                                     "'http://127.0.0.1:9/old' || g, '{}', now() - interval '10 weeks' "
                                     "FROM generate_series(1, 20000) g RETURNING effect_id::text",
                               (key,))]
    query(conn, "WITH gone AS (DELETE FROM effect_live WHERE effect_id = ANY (%s::uuid[]) "
                "RETURNING *) INSERT INTO effect_history (effect_id, created_at, attempt, worker, "
                "started_at, ended_at, state, retry_base) SELECT effect_id, created_at, 0, 'test', "
                "now() - interval '10 weeks', now() - interval '10 weeks', "
                "CASE WHEN random() < 0.1 THEN 'failed' ELSE 'completed' END, 0 FROM gone",
          (old,))
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', 'http://127.0.0.1:9/new' || g, '{}' FROM generate_series(1, 10) g",
          (key,))
    # What autovacuum's autosummarize does for a production table.
    query(conn, "SELECT brin_summarize_new_values('effect_outbox_created_brin')")
    for (ix,) in query(conn, "SELECT i.indexrelid::regclass::text FROM pg_index i "
                             "JOIN pg_inherits p ON p.inhrelid = i.indrelid "
                             "WHERE p.inhparent = 'effect_history'::regclass "
                             "AND i.indexrelid::regclass::text LIKE '%%ended_at%%'"):
        query(conn, "SELECT brin_summarize_new_values(%s)", (ix,))
    query(conn, "ANALYZE effect_outbox")
    query(conn, "ANALYZE effect_history")
    old_month = month_partition(conn, "now() - interval '10 weeks'")
    plans = plans_of(conn, "SELECT * FROM outbox_weekly_figures('t', 0)", ())
    assert "effect_outbox_created_brin" in plans, plans
    assert "Seq Scan on effect_outbox" not in plans, plans
    assert re.search(rf"Bitmap Index Scan on {old_month}_ended_at\w*", plans), plans
    assert f"Seq Scan on {old_month} " not in plans, plans
    assert query(conn, "SELECT automatic_share FROM outbox_weekly_cache")[0][0] == 1


def test_sweep_keeps_history_months_ahead_once_an_hour(conn):
    """The fleet's first sweep of each hour makes the history partitions of the
    months ahead that are missing; the other sweeps of the hour make none."""
    ahead = "now() + interval '2 months'"
    name = month_partition(conn, ahead)
    assert name

    def drop_it():
        query(conn, f"ALTER TABLE effect_history DETACH PARTITION {name}")
        query(conn, f"DROP TABLE {name}")
    drop_it()
    query(conn, "UPDATE outbox_sweeps SET last_run = date_trunc('hour', now())")
    query(conn, "SELECT * FROM outbox_sweep('a', 60, 0)")
    assert month_partition(conn, ahead) is None     # this hour's first sweep was before
    query(conn, "UPDATE outbox_sweeps SET last_run = date_trunc('hour', now()) - interval '1 second'")
    query(conn, "SELECT * FROM outbox_sweep('a', 60, 0)")
    assert month_partition(conn, ahead) == name

    # A long reader of the history holds the lock a new partition needs: the
    # sweep does its other work and leaves the months to a later hour.
    import psycopg2
    drop_it()
    key = make_run(conn)
    stray = scalar(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, "
                         "created_at) VALUES (%s, 'nobody-serves-this', 'x', '{}', "
                         "now() - interval '1 hour') RETURNING effect_id", (key,))
    reader = psycopg2.connect(conn.dsn)
    try:
        reader.cursor().execute("SELECT count(*) FROM effect_history")
        query(conn, "UPDATE outbox_sweeps SET last_run = '-infinity'")
        t0 = time.monotonic()
        assert query(conn, "SELECT * FROM outbox_sweep('a', 60, 0)") == [(stray, "nobody-serves-this")]
        assert time.monotonic() - t0 < 5
        assert month_partition(conn, ahead) is None
    finally:
        reader.rollback()
        reader.close()


def test_the_history_months_a_worker_or_operator_may_make_are_bounded(conn, login_as):
    """outbox_history_partitions made any range it was given: a dispatcher
    asking for 24,000 months ran until its statement timeout.  The workers
    and operators may make at most 24 months a call, from ten years back
    to a year ahead (outbox_history_months); the unbounded maker is the
    owner's (migrations, the sweep)."""
    import psycopg2
    import pytest
    d, o = login_as("outbox_dispatcher"), login_as("outbox_operator")
    query(d, "SET statement_timeout = '5s'")
    for c in (d, o):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            query(c, "SELECT outbox_history_partitions(now(), now() + interval '24000 months')")
    before = scalar(conn, "SELECT count(*) FROM pg_inherits WHERE inhparent = 'effect_history'::regclass")
    for rng in (("now()", "now() + interval '24000 months'"),
                ("now() - interval '2000 years'", "now() - interval '1990 years'"),
                ("now() + interval '13 months'", "now() + interval '14 months'"),
                ("now() - interval '30 months'", "now()"),
                ("'-infinity'", "now()"), ("now()", "'infinity'"), ("NULL", "now()")):
        for c in (d, o):
            with pytest.raises(psycopg2.errors.InvalidParameterValue):
                query(c, f"SELECT outbox_history_months({rng[0]}, {rng[1]})")
    assert scalar(conn, "SELECT count(*) FROM pg_inherits "
                        "WHERE inhparent = 'effect_history'::regclass") == before
    # What the fleet needs goes through: the months ahead, some months back.
    assert scalar(d, "SELECT outbox_history_months(now() - interval '20 months', "
                     "now() + interval '3 months')") >= 19
    assert month_partition(conn, "now() - interval '19 months'")
    assert scalar(o, "SELECT outbox_history_months(now(), now() + interval '12 months')") >= 0
