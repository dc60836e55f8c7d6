# SPDX-License-Identifier: ISC
"""How an idle worker learns of new effects: LISTEN/NOTIFY wakes it within
milliseconds, and with listening off (poll-only mode) its poll still
delivers everything.
"""
import time

from outbox_test import enqueue, final, http_cfg, kill_switch, scalar, wait_for


def test_poll_only_mode_delivers_without_listen(conn, dispatchers, sink):
    kill_switch(conn, True)
    w = dispatchers({"database": {"poll_only": True}, **http_cfg()})
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid)["state"] == "completed"
    assert scalar(conn, "SELECT count(*) FROM pg_listening_channels()") == 0
    assert w.proc.poll() is None


def test_notify_wakes_an_idle_worker_quickly(conn, dispatchers, sink):
    kill_switch(conn, True)
    dispatchers({"dispatcher": {"poll_interval_ms": 600000}, **http_cfg()})
    # Let the worker go idle (its first lease found nothing).
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_providers") >= 1, what="registered")
    t0 = time.monotonic()
    eid = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, eid, timeout=5)["state"] == "completed"
    assert time.monotonic() - t0 < 2, "NOTIFY, not the (10 minute) poll"
