# SPDX-License-Identifier: ISC
"""A lease held through a long send, and what becomes of a send whose lease
ran out: renewed while the provider answers, `unknown` past the total cap
or when the worker dies mid-send (never sent again), back to `pending`
for a provider that honours idempotency keys.
"""
import time

from outbox_test import (attempts, effect, enqueue, final, http_cfg, kill_switch, query, scalar,
                         wait_for)


def test_sigkill_during_hanging_send_becomes_unknown_and_is_never_resent(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/hang", {})
    cfg = {"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
           **http_cfg(timeout_ms=30000)}
    w1 = dispatchers(cfg, name="victim")
    wait_for(lambda: sink.count() == 1, what="the send to start")
    w1.kill()
    t0 = time.monotonic()
    dispatchers(cfg, name="survivor")
    # The survivor reaps from when it is up: a start slower than the lease
    # (a loaded machine) moves the earliest reap to its readiness.
    reaps_from = max(t0 + 2, time.monotonic())
    e = wait_for(lambda: (lambda x: x if x["state"] == "unknown" else None)(effect(conn, eid)),
                 timeout=10, what="unknown")
    assert time.monotonic() - reaps_from < 2, "noticed within one lease period (+ a reaper pass)"
    log = attempts(conn, eid)
    assert [a["outcome_class"] for a in log] == ["ambiguous"]
    assert "lost" in log[0]["error_text"]
    # The survivor keeps working and never re-sends the unknown effect.
    canary = enqueue(conn, "http", sink.url + "/ok", {})
    assert final(conn, canary)["state"] == "completed"
    assert effect(conn, eid)["state"] == "unknown"
    key = scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))
    assert sink.count(key=key) == 1


def test_expired_sending_row_of_key_honouring_provider_returns_to_pending(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/hang", {})
    cfg = {"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
           **http_cfg(timeout_ms=30000, honours_idempotency_keys=True)}
    w1 = dispatchers(cfg, name="victim")
    wait_for(lambda: sink.count() == 1, what="the send to start")
    w1.kill()
    query(conn, "UPDATE effect_outbox SET target = %s WHERE effect_id = %s", (sink.url + "/idem", eid))
    dispatchers(cfg, name="survivor")
    e = final(conn, eid)
    assert e["state"] == "completed" and e["attempts"] == 2
    classes = [a["outcome_class"] for a in attempts(conn, eid)]
    assert classes == ["ambiguous", "accepted"]


def test_lease_is_renewed_during_a_long_send(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/delay/4500", {})
    dispatchers({"dispatcher": {"lease_seconds": 2, "maintenance_interval_ms": 200},
                 **http_cfg(timeout_ms=10000)})
    e = final(conn, eid)
    assert e["state"] == "completed" and e["attempts"] == 1


def test_total_lease_cap_makes_an_overlong_send_unknown(conn, dispatchers, sink):
    kill_switch(conn, True)
    eid = enqueue(conn, "http", sink.url + "/delay/6000", {})
    w = dispatchers({"dispatcher": {"lease_seconds": 2, "max_lease_seconds": 3,
                                    "maintenance_interval_ms": 200},
                     **http_cfg(timeout_ms=10000)})
    assert final(conn, eid)["state"] == "unknown"
    # The send still finishes; its late acceptance is evidence from the
    # attempt the reaper gave up on: it completes the effect (outbox_complete).
    log = wait_for(lambda: (lambda a: a if len(a) == 2 else None)(attempts(conn, eid)),
                   what="the late outcome in the attempts log")
    assert log[0]["outcome_class"] == "ambiguous" and log[0]["worker"].startswith("reaper:")
    assert log[1]["outcome_class"] == "accepted" and log[1]["cas_applied"] is True
    assert effect(conn, eid)["state"] == "completed"
    assert effect(conn, eid)["provider_id"] == log[1]["provider_id"]
    assert scalar(conn, "SELECT resolution FROM effect_attempts WHERE effect_id = %s "
                        "AND outcome_class = 'accepted'", (eid,)) == "late_accepted"
    # The worker logs the attempt once outbox_complete has answered, a
    # moment after the row above is visible.
    wait_for(lambda: any(e.get("event") == "attempt" and e.get("lease_held") is False
                         and e.get("resolved") == "late_accepted"
                         for e in w.events()), what="the attempt line with lease_held false")
