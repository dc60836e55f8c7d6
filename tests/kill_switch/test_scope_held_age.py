# SPDX-License-Identifier: ISC
"""A paused scope is not silent: effects it holds are left out of the
queue lag (they are not due), so their count and the oldest one's age are
shown on their own, in `outboxctl status` (text and --json) and in
/metrics (outbox_scope_oldest_held_seconds), with how long the scope has
been paused (outbox_scope_paused_seconds, which OutboxScopePaused
reads)."""
import json
import re
import urllib.request

from outbox_test import enqueue, free_port, http_cfg, kill_switch, query, run_ctl, wait_for


def test_held_effects_age_and_pause_duration_are_shown(db, conn, dispatchers, sink):
    kill_switch(conn, True)
    query(conn, "SELECT * FROM outbox_scope_pause('type', 'http', true, 'test', 'incident 7')")
    ids = [enqueue(conn, "http", sink.url + f"/ok?{i}", {}) for i in range(3)]
    port = free_port()
    dispatchers(dict(http_cfg(), metrics={"listen": f"127.0.0.1:{port}"}))
    wait_for(lambda: query(conn, "SELECT count(*) FROM effect_live WHERE held_by = 'type:http'")
             == [(3,)], what="all three parked")
    # As if paused ten minutes ago and the effects made five minutes ago.
    query(conn, "UPDATE outbox_scopes SET paused_at = now() - interval '10 minutes' "
                "WHERE kind = 'type' AND value = 'http'")
    query(conn, "UPDATE effect_live SET created_at = now() - interval '5 minutes' "
                "WHERE effect_id = ANY(%s::uuid[])", ([str(i) for i in ids],))

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        m = re.search(r'^outbox_scope_oldest_held_seconds\{scope="type:http"\} (\S+)$', text, re.M)
        return text if m and float(m.group(1)) >= 300 else None
    text = wait_for(scrape, timeout=30, what="the held effects' age in /metrics")
    paused = re.search(r'^outbox_scope_paused_seconds\{scope="type:http"\} (\S+)$', text, re.M)
    assert paused and 600 <= float(paused.group(1)) < 700, text

    r = run_ctl(["--db", db, "status"])
    assert r.returncode == 0, r.stderr
    assert "oldest pending age: 0" in r.stdout, r.stdout
    m = re.search(r"^held by scopes: 3, the oldest for ([0-9.]+)s", r.stdout, re.M)
    assert m and 300 <= float(m.group(1)) < 400, r.stdout
    r = run_ctl(["--db", db, "status", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["held"] == 3 and 300 <= out["oldest_held_age_seconds"] < 400, out
    assert sink.count() == 0
