# SPDX-License-Identifier: ISC
"""The kill-switch guarantee under load (docs/design.md, "Kill switch"):
while two workers send a steady stream, `outboxctl kill-switch off`
returns; after that the sink receives no request that is not in the list
the command printed; `on` delivers the rest, each exactly once."""
import re
import time

from outbox_test import make_run, query, run_ctl, scalar, states, wait_for, kill_switch


def test_kill_switch_off_under_load_stops_every_unlisted_send(conn, db, dispatchers, sink):
    kill_switch(conn, True)
    key = make_run(conn)
    n = 600
    query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                "SELECT %s, 'http', %s || '/delay/40?' || g, '{}' FROM generate_series(1, %s) g",
          (key, sink.url, n))
    cfg = {"dispatcher": {"batch_size": 16}, "provider.http": {"max_per_host": 8}}
    dispatchers(cfg, name="a")
    dispatchers(cfg, name="b")
    wait_for(lambda: sink.count() >= 60, what="a steady stream")

    r = run_ctl(["--db", db, "kill-switch", "off", "--operator", "ops", "--reason", "load test"])
    returned = time.time()
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"key=([0-9a-f]{64})", r.stdout))
    m = re.search(r"(\d+) effects? (?:was|were) already in flight", r.stdout)
    assert m and int(m.group(1)) == len(listed), r.stdout

    # Everything in flight finishes (or is recorded); then nothing moves.
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'sending'") == 0,
             what="in-flight sends to finish")
    late = [q for q in sink.received() if q["t"] > returned and q["key"] not in listed]
    assert late == [], f"{len(late)} sends started after the switch was off"
    before = sink.count()
    pending = states(conn).get("pending", 0)
    assert pending > 0, "the switch stopped the stream before it ran dry"
    # A bounded window (several poll intervals of both workers): nothing is sent.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert sink.count() == before
        time.sleep(0.1)
    assert scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'pending' "
                        "AND lease_owner IS NOT NULL AND lease_expires_at > now()") == 0, \
        "blocked leases are released"

    r = run_ctl(["--db", db, "kill-switch", "on", "--operator", "ops", "--reason", "done"])
    assert r.returncode == 0, r.stderr
    wait_for(lambda: states(conn).get("completed") == n, timeout=60, what="the rest delivered")
    counts = sink.keys()
    assert len(counts) == n and set(counts.values()) == {1}, "each effect exactly once"
    assert scalar(conn, "SELECT count(*) FROM effect_attempts") == n
    hist = query(conn, "SELECT enabled, changed_by, reason FROM outbox_control_history "
                       "ORDER BY change_id DESC LIMIT 2")
    assert hist == [(True, "ops", "done"), (False, "ops", "load test")]
