"""Signals: SIGTERM finishes the sends in flight and releases the rest, a
second SIGTERM exits at once; SIGHUP applies a good configuration and
keeps the old one when the new file is broken.
"""
import signal
import time

from outbox_test import (effect, enqueue, final, http_cfg, kill_switch, scalar, wait_for,
                         write_config)


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
    assert scalar(conn, "SELECT count(*) FROM effect_outbox WHERE lease_owner IS NOT NULL") == 0
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
