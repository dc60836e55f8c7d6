# SPDX-License-Identifier: ISC
"""A worker whose wall clock is off decides nothing by it.

The attempts log's started_at (from which outbox_reconcile_lease computes
the attempt's age, and so when a lookup's "not found" may requeue an
effect) is the database's clock: now() minus how long ago the worker
started the send by its monotonic clock, never before the row went
`sending`, never after now().

- In SQL: outbox_complete dates a send from started_ms_ago, clamps it to
  [sending_since, now()], and ignores a started_at a worker sends.
- Live: a worker run under libfaketime (Debian's libfaketime, see
  scripts/install-deps.sh) 600 s behind and 600 s ahead.  Its send is
  never read by the sink (unknown); its own lookups say "not found".  The
  effect is sent again only once the minimum age has passed since the
  first request really reached the sink (600 s behind used to requeue it
  at once: a double send), and soon after that (600 s ahead used to wait
  ten minutes).
"""
import calendar
import glob
import json
import os
import time
import uuid

import pytest

from outbox_test import effect, enqueue, kill_switch, query, run_ctl, scalar, wait_for

OWNER = str(uuid.uuid4())


def libfaketime():
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert found, "libfaketime is missing: scripts/install-deps.sh installs Debian's libfaketime"
    return found[0]


def faketime_env(offset):
    """A wall clock `offset` ("-600", "+600") seconds off the test's own;
    the monotonic clock untouched, as a real clock error or step leaves it.
    A suite run at another date (scripts/test-at.sh: every clock moved by
    OUTBOX_TEST_CLOCK_OFFSET) moves the worker's by as much again, so the
    worker is `offset` off the database and the test, not off the real
    time.  libfaketime replaces the run's own preload for this worker."""
    asan = os.environ.get("ASAN_OPTIONS", "")
    base = int(os.environ.get("OUTBOX_TEST_CLOCK_OFFSET", "0"))
    offset = f"{int(offset) + base:+d}"
    return {"LD_PRELOAD": libfaketime(), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            # ASan wants to be first in the link order; libfaketime is
            # preloaded ahead of it.
            "ASAN_OPTIONS": (asan + ":" if asan else "") + "verify_asan_link_order=0"}


# -- the SQL -----------------------------------------------------------------

def leased_and_marked(conn, n):
    query(conn, "INSERT INTO workflow_runs (idempotency_key, state, payload_hash) "
                "VALUES ('clock', 'processing', 'h')")
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT 'clock', 'http', 'http://127.0.0.1:9/' || g, '{}' FROM generate_series(1, %s) g", (n,))
    ids = [r[0] for r in query(conn, "SELECT effect_id::text FROM outbox_lease(%s, 'w', %s, 30, "
                                     "'{http}', true)", (OWNER, n))]
    query(conn, "SELECT * FROM outbox_mark_sending(%s, %s::uuid[], true, '{}', 30, %s)",
          (OWNER, ids, str(uuid.uuid4())))
    return ids


def test_complete_dates_a_send_by_the_database_clock(conn):
    kill_switch(conn, True)
    ids = leased_and_marked(conn, 4)
    # The mark is 2 s in the past, so that "started 1.5 s ago" fits after it.
    query(conn, "UPDATE effect_live SET sending_since = now() - interval '2 seconds' "
                "WHERE effect_id = ANY (%s::uuid[])", (ids,))
    forged = "2000-01-01T00:00:00Z"
    batch = [
        {"effect_id": ids[0], "started_ms_ago": 1500},
        # Longer ago than the row has been `sending`: from sending_since.
        {"effect_id": ids[1], "started_ms_ago": 3600 * 1000},
        # A started_at of the worker's clock counts for nothing.
        {"effect_id": ids[2], "started_ms_ago": 0, "started_at": forged},
        # An older worker sends only started_at: dated now().
        {"effect_id": ids[3], "started_at": forged},
    ]
    for b in batch:
        b.update({"attempt": 1, "outcome": "ambiguous", "next_state": "unknown", "retry_delay_ms": 0})
    got = query(conn, "SELECT applied FROM outbox_complete(%s, 'w', %s)", (OWNER, json.dumps(batch)))
    assert got == [(True,)] * 4, got
    ages = dict(query(conn, "SELECT effect_id::text, extract(epoch FROM now() - started_at)::float8 "
                            "FROM effect_attempts WHERE effect_id = ANY (%s::uuid[])", (ids,)))
    assert 1.4 <= ages[ids[0]] <= 1.9, ages
    assert 1.9 <= ages[ids[1]] <= 2.4, ages
    assert 0 <= ages[ids[2]] <= 0.4, ages
    assert 0 <= ages[ids[3]] <= 0.4, ages
    # And the lookup's age is that one.
    query(conn, "SELECT outbox_register_providers('{http}', '{http}')")
    lease_ages = dict(query(conn, "SELECT effect_id::text, attempt_age_ms FROM "
                                  "outbox_reconcile_lease(%s, 'w', '{http}', 10, 0)", (OWNER,)))
    assert 1400 <= lease_ages[ids[0]] <= 1900 and lease_ages[ids[3]] <= 400, lease_ages


# -- a live worker with its clock off -------------------------------------------

MIN_AGE_S = 4


@pytest.mark.parametrize("offset", ["-600", "+600"], ids=["behind", "ahead"])
def test_a_worker_clock_ten_minutes_off_requeues_only_after_the_minimum_age(conn, db, dispatchers,
                                                                           sink, offset):
    kill_switch(conn, True)
    w = dispatchers({"provider.http": {"timeout_ms": 800, "reconcile_url": "{origin}/lookup?key={key}",
                                       "reconcile_targets": sink.url + "/",
                                       "reconcile_min_age_seconds": MIN_AGE_S,
                                       "reconcile_timeout_ms": 1000}},
                    env=faketime_env(offset))
    # The worker's clock really is off (its log lines carry its time).
    logged = calendar.timegm(time.strptime(w.events()[-1]["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
    assert abs((logged - time.time()) - int(offset)) < 30, (logged, time.time())
    wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'http'"),
             what="http registered as able to reconcile")
    eid = str(enqueue(conn, "http", f"{sink.url}/drop-unread/1", {"body": {"clock": offset}}))
    key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    wait_for(lambda: effect(conn, eid)["state"] == "unknown", what="the effect unknown")
    first = [r["t"] for r in sink.received() if r["key"] == key]
    assert len(first) == 1

    # Ask, again and again, until the lookup's "not found" counts.
    def resent():
        r = run_ctl(["--db", db, "reconcile", "--wait", "10"])
        assert r.returncode == 0, r.stdout + r.stderr
        return effect(conn, eid)["state"] in ("pending", "sending", "completed")
    wait_for(resent, timeout=MIN_AGE_S + 20, interval=0.2,
             what="the lookup's not-found to requeue the effect")
    wait_for(lambda: effect(conn, eid)["state"] == "completed", what="sent again and completed")
    times = [r["t"] for r in sink.received() if r["key"] == key]
    assert len(times) == 2 and sink.processed(key) == 1, times
    assert times[1] - times[0] >= MIN_AGE_S, \
        f"sent again {times[1] - times[0]:.2f} s after the first request (minimum age {MIN_AGE_S} s)"
    # What operators see: the attempts log on the database's clock.
    rows = query(conn, "SELECT outcome_class, extract(epoch FROM started_at)::float8, "
                       "extract(epoch FROM ended_at)::float8 FROM effect_attempts "
                       "WHERE effect_id = %s ORDER BY attempt_id", (eid,))
    sends = [r for r in rows if r[0] in ("ambiguous", "accepted")]
    assert len(sends) == 2, rows
    for (_, started, ended), t in zip(sends, times):
        assert started <= ended and abs(started - t) < 2, (rows, times)
