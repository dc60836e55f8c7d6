# SPDX-License-Identifier: ISC
"""Signals: SIGTERM finishes the sends in flight and releases the rest, a
second SIGTERM exits at once; a forced exit gives up the claims still on
the wire; SIGHUP applies a good configuration and keeps the old one when
the new file is broken.
"""
import signal
import threading
import time

import psycopg2
import pytest

from outbox_test import (attempts, effect, enqueue, final, http_cfg, kill_switch, query, scalar,
                         wait_for, worker_dsn, write_config)
from pg_cut_proxy import CutProxy


def test_sigterm_finishes_in_flight_and_releases_unstarted(conn, dispatchers, sink):
    kill_switch(conn, True)
    ids = [enqueue(conn, "http", sink.url + f"/delay/800?{i}", {}) for i in range(5)]
    w = dispatchers(http_cfg(max_per_host=1))
    wait_for(lambda: sink.count() == 1, what="first send in flight")
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=15) == 0
    st = [effect(conn, i) for i in ids]
    done = [s for s in st if s["state"] == "completed"]
    assert len(done) >= 1
    for s in st:
        assert s["state"] in ("completed", "pending"), s
        if s["state"] == "pending":
            assert s["attempts"] == 0
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE lease_owner IS NOT NULL") == 0
    assert sink.count() == len(done)


def test_second_sigterm_exits_at_once(conn, dispatchers, sink):
    kill_switch(conn, True)
    enqueue(conn, "http", sink.url + "/hang", {})
    w = dispatchers({"dispatcher": {"shutdown_grace_ms": 60000}, **http_cfg(timeout_ms=60000)})
    wait_for(lambda: sink.count() == 1, what="send in flight")
    w.signal(signal.SIGTERM)
    wait_for(lambda: any(e.get("event") == "stopping" for e in w.events()), what="stopping")
    assert w.proc.poll() is None, "still waiting for the in-flight send"
    t0 = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(timeout=5) == 0
    assert time.monotonic() - t0 < 3


def test_sighup_with_broken_config_keeps_the_old_one(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers(http_cfg())
    with open(w.config_path, "a") as f:
        f.write("[dispatcher]\nlease_seconds = many\n")
    w.signal(signal.SIGHUP)
    ev = wait_for(lambda: [e for e in w.events() if e.get("event") == "reload_failed"],
                  what="reload_failed")
    assert "lease_seconds" in ev[0]["msg"] and w.config_path in ev[0]["msg"]
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert w.proc.poll() is None


def test_sighup_applies_a_good_config(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers(http_cfg())
    sections = dict(w.sections)
    sections["log"] = {"level": "debug"}
    write_config(w.config_path, sections)
    w.signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == "reloaded" for e in w.events()), what="reloaded")


def waiting_claims(conn):
    return scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database() AND query LIKE '%outbox_claim(%'")


def test_a_forced_exit_cancels_and_gives_up_a_claim_still_waiting(conn, db, dispatchers, sink):
    """A worker forced out (shutdown_grace_ms over) with a claim waiting on
    the server (here for the kill switch's lock, held by the test) cancels
    it and gives its call up, so the claim cannot move the rows to
    `sending` once the lock is free: they stay pending, never sent, and
    are claimed again by the next worker."""
    kill_switch(conn, True)
    cfg = {"dispatcher": {"shutdown_grace_ms": 300, "batch_size": 2}, **http_cfg(max_per_host=4)}
    holder = psycopg2.connect(db)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(outbox_kill_switch_lock_key())")
            w = dispatchers(cfg)
            ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(2)]
            wait_for(lambda: waiting_claims(conn) >= 1, what="the claim waiting for the lock")
            w.signal(signal.SIGTERM)
            assert w.wait(timeout=15) == 0
            assert waiting_claims(conn) == 0
            gave_up = [e for e in w.events() if e.get("event") == "gave_up_calls"]
            assert gave_up, w.log()
        holder.rollback()
    finally:
        holder.close()
    # One give-up per claim that was waiting (a head claim on the second
    # connection may have been waiting too).
    assert scalar(conn, "SELECT count(*) FROM outbox_claim_repeats") >= 1
    assert query(conn, "SELECT state, attempts FROM outbox_effects ORDER BY effect_id") == \
        [("pending", 0)] * 2
    dispatchers(http_cfg(), name="w2")
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'completed'")
             == 2, what="sent by the next worker")
    assert [len(attempts(conn, i)) for i in ids] == [1, 1] and sink.count() == 2


@pytest.mark.parametrize("statement,dispatcher", [
    (b"outbox_claim", {"batch_size": 2}),
    (b"outbox_mark_sending", {"claim": False}),
], ids=["claim", "mark"])
def test_a_forced_exit_gives_back_what_a_call_moved_whose_answer_never_came(
        conn, db, dispatchers, sink, statement, dispatcher):
    """The claim (or, with [dispatcher] claim = false, the mark) committed;
    its answer is still on its way (a proxy holds it) when the worker is
    forced out: the give-up puts the rows it moved back to pending with the
    attempt undone, instead of `sending` until the reaper, and teardown
    frees what the call's batch held (the suite's AddressSanitizer build
    checks that for the mark's effects)."""
    proxy, hold = CutProxy().start(), threading.Event()
    try:
        kill_switch(conn, True)
        ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(2)]
        proxy.arm(statement, hold=hold)
        w = dispatchers({"dispatcher": {"shutdown_grace_ms": 300, **dispatcher},
                         "database": {"conninfo": proxy.conninfo(worker_dsn(db))},
                         **http_cfg(max_per_host=4)})
        wait_for(lambda: proxy.cuts == 1, what="the call committed, its answer held")
        assert query(conn, "SELECT state, attempts FROM outbox_effects") == [("sending", 1)] * 2
        w.signal(signal.SIGTERM)
        assert w.wait(timeout=15) == 0, w.log()
        assert query(conn, "SELECT state, attempts, lease_owner FROM outbox_effects") == \
            [("pending", 0, None)] * 2
        assert sink.count() == 0 and all(attempts(conn, i) == [] for i in ids)
    finally:
        hold.set()
        proxy.stop()
