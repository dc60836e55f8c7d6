# SPDX-License-Identifier: ISC
"""The http provider's keep-alive: connections are reused, and a
request is still never sent twice.

libcurl re-sends a request by itself when a *reused* connection dies before
any response byte (a POST too).  providers/http/send.c refuses that resend in
CURLOPT_PREREQFUNCTION; these tests hold it to that with the sink's
/close-reused fault (a server that takes a request on a reused connection
and closes without answering), and check that keep-alive really reuses
connections and that keepalive_idle_seconds = 0 does not.
"""
import socket

from outbox_test import (attempts, effect, enqueue, http_cfg, kill_switch, make_run, query, states,
                         wait_for)


def enqueue_many(conn, url, n):
    """n effects of one run in one statement (one NOTIFY); their ids."""
    key = make_run(conn)
    rows = query(conn, "INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload) "
                       "SELECT %s, 'http', %s || '?' || g, '{\"body\": {\"n\": 1}}' "
                       "FROM generate_series(1, %s) g RETURNING effect_id", (key, url, n))
    return [r[0] for r in rows]


def keys_of(conn, ids):
    return dict(query(conn, "SELECT effect_id, effect_key FROM outbox_effects "
                            "WHERE effect_id = ANY(%s::uuid[])", ([str(i) for i in ids],)))


def settled(conn, n):
    s = states(conn)
    return s if sum(v for k, v in s.items() if k not in ("pending", "sending")) == n else None


def test_keepalive_reuses_connections(conn, dispatchers, sink):
    n = 60
    kill_switch(conn, True)
    enqueue_many(conn, sink.url + "/ok", n)
    dispatchers(http_cfg(max_per_host=2))
    wait_for(lambda: states(conn).get("completed") == n, timeout=60, what="all delivered")
    assert sink.count() == n and all(v == 1 for v in sink.keys().values())
    # Two sends at a time to one host: a handful of connections, not 60.
    assert sink.connections <= 10, f"{sink.connections} connections for {n} requests"
    assert max(r["conn_request"] for r in sink.received()) > 1


def test_connections_survive_a_pause_between_bursts(conn, dispatchers, sink):
    """libcurl keeps at most 4 x (transfers running right now) idle
    connections unless told otherwise: when a burst of sends finished, it
    closed all but a few of the burst's connections and the next burst
    opened them again (in the bench, 350 connects per 10,000 sends; against
    an HTTPS provider, a TLS handshake each).  The provider keeps up to
    max_in_flight, so bursts of max_per_host sends reuse theirs."""
    kill_switch(conn, True)
    dispatchers(http_cfg(max_per_host=32, keepalive_idle_seconds=30))
    total = 0
    for _ in range(3):
        enqueue_many(conn, sink.url + "/delay/200", 32)
        total += 32
        wait_for(lambda: states(conn).get("completed") == total, timeout=60, what="the burst delivered")
    assert sink.count() == total
    assert sink.connections <= 32, f"{sink.connections} connections for 3 bursts of 32 sends"


def test_keepalive_idle_zero_is_one_connection_per_call(conn, dispatchers, sink):
    n = 20
    kill_switch(conn, True)
    enqueue_many(conn, sink.url + "/ok", n)
    dispatchers(http_cfg(max_per_host=2, keepalive_idle_seconds=0))
    wait_for(lambda: states(conn).get("completed") == n, timeout=60, what="all delivered")
    assert sink.count() == n
    assert sink.connections == n
    assert all(r["conn_request"] == 1 for r in sink.received())


def test_reused_connection_closed_after_the_request_is_never_resent(conn, dispatchers, sink):
    """The first request on a connection is answered; the next one on the
    same connection is read, then the connection is closed.  libcurl would
    send that request again on a new connection (the sink would answer it:
    a duplicate); the provider refuses, and the effect is unknown."""
    n = 20
    kill_switch(conn, True)
    ids = enqueue_many(conn, sink.url + "/close-reused", n)
    keys = keys_of(conn, ids)
    dispatchers(http_cfg(max_per_host=1))
    wait_for(lambda: settled(conn, n), timeout=60, what="all settled")

    # Never received twice: the guard.
    by_key = sink.keys()
    twice = {k: c for k, c in by_key.items() if c != 1}
    assert not twice, f"delivered more than once: {twice}"
    assert len(by_key) == n
    req = {r["key"]: r for r in sink.received()}

    cut = 0
    for i in ids:
        e = effect(conn, i)
        r = req[keys[i]]
        if r["conn_request"] == 1:
            # Answered: the first request on its connection.
            assert e["state"] == "completed", (e, r)
            continue
        # Taken on a reused connection, then cut: ambiguous, not re-sent,
        # and (http does not honour keys by default) left for an operator.
        cut += 1
        assert e["state"] == "unknown", (e, r)
        assert e["attempts"] == 1, e
        assert e["last_error_class"] == "ambiguous", e
        assert "not re-sent" in e["last_error"], e
        log = attempts(conn, i)
        assert [a["outcome_class"] for a in log] == ["ambiguous"], log
        assert "connection closed after the request was written" in log[0]["error_text"], log
    # The fault really happened (keep-alive reused connections).
    assert cut >= 3, f"only {cut} requests were sent on a reused connection"


def test_timeout_on_a_reused_connection_is_ambiguous_not_unsent(conn, dispatchers, sink):
    """The connect time is 0 on a reused connection: a send that hangs on
    one must still be ambiguous (the old classification called it not sent,
    and the effect was sent again)."""
    kill_switch(conn, True)
    dispatchers(http_cfg(timeout_ms=800, max_per_host=1, keepalive_idle_seconds=30))
    first = enqueue(conn, "http", sink.url + "/ok", {})
    wait_for(lambda: effect(conn, first)["state"] == "completed", what="first delivered")
    eid = enqueue(conn, "http", sink.url + "/hang", {})
    e = wait_for(lambda: (lambda x: x if x["state"] not in ("pending", "sending") else None)(
        effect(conn, eid)), timeout=20, what="hang settled")
    hung = [r for r in sink.received() if r["path"] == "/hang"]
    assert len(hung) == 1, hung
    assert hung[0]["conn_request"] == 2, "the hanging request went on the reused connection"
    assert e["state"] == "unknown" and e["last_error_class"] == "ambiguous", e
    assert e["attempts"] == 1


def test_connection_refused_is_still_not_sent_with_keepalive(conn, dispatchers):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    kill_switch(conn, True)
    eid = enqueue(conn, "http", f"http://127.0.0.1:{port}/x", {})
    dispatchers(http_cfg(breaker_failures=100))
    e = wait_for(lambda: (lambda x: x if x["state"] not in ("pending", "sending") else None)(
        effect(conn, eid)), timeout=20, what="settled")
    assert e["state"] == "failed" and e["attempts"] == 3, e
    assert e["last_error_class"] == "not_sent", e
    assert {a["outcome_class"] for a in attempts(conn, eid)} == {"not_sent"}
