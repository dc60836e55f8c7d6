# SPDX-License-Identifier: ISC
"""Which effects the http lookup (reconcile_url) answers for, and where it
sends its credential: reconcile_targets is matched against the target's
parsed scheme, host, port and path (a path prefix ends on a segment
boundary), never against the raw text, and {origin} is the parsed
target's scheme://host:port.

- a target whose user-info spells an allowed origin
  (http://<allowed host:port>@<other host:port>/...) is not looked up:
  the reconcile_header credential never reaches the other host, whose
  answer cannot complete the effect;
- a host-name entry means https on port 443 of that host only: a plain
  http target on another port of it is not looked up;
- a path prefix matches whole segments only (/han does not cover /hang);
- a matching target is looked up at its own origin, with the credential.

Real workers, real PostgreSQL, two real sinks on 127.0.0.2 and 127.0.0.3.
"""
import pytest

from http_sink import Sink
from outbox_test import effect, enqueue, kill_switch, run_ctl, scalar, wait_for

SECRET = "Bearer lookup-secret-5b1e"


@pytest.fixture
def two_sinks():
    a = Sink(host="127.0.0.2").start()
    b = Sink(host="127.0.0.3").start()
    a.base = f"http://127.0.0.2:{a.port}"
    b.base = f"http://127.0.0.3:{b.port}"
    yield a, b
    a.stop()
    b.stop()


def start(dispatchers, conn, targets):
    kill_switch(conn, True)
    dispatchers({"provider.http": {
        "allow_hosts": "127.0.0.0/8", "timeout_ms": 800,
        "reconcile_url": "{origin}/lookup?key={key}", "reconcile_targets": targets,
        "reconcile_header": f"Authorization: {SECRET}", "reconcile_min_age_seconds": 3,
        "reconcile_timeout_ms": 1000}})
    wait_for(lambda: scalar(conn, "SELECT can_reconcile FROM outbox_providers WHERE name = 'http'"),
             what="http registered as able to reconcile")


def unknown_effect(conn, target):
    eid = str(enqueue(conn, "http", target, {"body": {"t": target}}))
    wait_for(lambda: effect(conn, eid)["state"] == "unknown", what=f"effect {eid} unknown")
    return eid


def reconcile(db):
    r = run_ctl(["--db", db, "reconcile", "--wait", "30"])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def lookups(sink):
    return [r for r in sink.received() if r["path"] == "/lookup"]


def test_userinfo_spelling_the_allowed_origin_is_not_looked_up(conn, dispatchers, db, two_sinks):
    a, b = two_sinks
    start(dispatchers, conn, a.base)
    eid = unknown_effect(conn, f"http://127.0.0.2:{a.port}@127.0.0.3:{b.port}/hang")
    assert b.count(path_prefix="/hang") == 1      # the send itself went where the URL says
    out = reconcile(db)
    assert "no lookup is configured for this target" in out, out
    assert lookups(b) == [] and lookups(a) == []
    assert all(r["headers"].get("authorization") != SECRET for r in b.received())
    assert effect(conn, eid)["state"] == "unknown"


def test_host_name_entry_means_https_443_only(conn, dispatchers, db, two_sinks):
    a, _ = two_sinks
    start(dispatchers, conn, "127.0.0.2")
    eid = unknown_effect(conn, f"{a.base}/hang")
    out = reconcile(db)
    assert "no lookup is configured for this target" in out, out
    assert lookups(a) == []
    assert effect(conn, eid)["state"] == "unknown"


def test_path_prefix_ends_on_a_segment_boundary(conn, dispatchers, db, two_sinks):
    a, _ = two_sinks
    start(dispatchers, conn, f"{a.base}/han")
    eid = unknown_effect(conn, f"{a.base}/hang")
    out = reconcile(db)
    assert "no lookup is configured for this target" in out, out
    assert lookups(a) == []
    assert effect(conn, eid)["state"] == "unknown"


def test_matching_target_is_looked_up_at_its_origin(conn, dispatchers, db, two_sinks):
    a, b = two_sinks
    # Scheme and host in another case and the default-less port spelled
    # out: the same origin once parsed.
    start(dispatchers, conn, f"HTTP://127.0.0.2:{a.port}/hang, {b.base}/other")
    eid = unknown_effect(conn, f"{a.base}/hang?x=1")
    out = reconcile(db)
    assert "sent: completed" in out, out
    got = lookups(a)
    assert len(got) == 1 and got[0]["headers"].get("authorization") == SECRET
    assert lookups(b) == []
    assert wait_for(lambda: effect(conn, eid)["state"] == "completed", what="completed")
