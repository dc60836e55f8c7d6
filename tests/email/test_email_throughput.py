# SPDX-License-Identifier: ISC
"""The email provider's throughput defaults (providers/email/email.c),
end to end with a real worker, PostgreSQL and the project's SMTP test
server (tests/servers/smtp_server.py).

What limits email throughput is the worker's database cycle, not SMTP
(bench/email_bench.py measures it): a worker leases and records outcomes
in batches of at most the provider's max_in_flight, so email's default
max_in_flight must be well above its threads.  These tests pin that
default and its consequences: batches of the default size, sends beyond
the threads waiting in the provider's queue (not in extra SMTP sessions),
every email delivered once, the start line naming both numbers, and the
note for a queue far deeper than the threads.
"""

import pytest

from outbox_test import enqueue, free_port, kill_switch, query, scalar, scrape, wait_for

from smtp_server import SmtpServer

DEFAULT_THREADS = 8
DEFAULT_MAX_IN_FLIGHT = 32
PAYLOAD = {"from": "Outbox <noreply@example.com>", "subject": "Your receipt",
           "text": "Hello,\nyour receipt.\n"}


@pytest.fixture
def smtp():
    s = SmtpServer(pipelining=True)
    s.start()
    yield s
    s.stop()


def email_cfg(smtp, **kw):
    # Only what the tests need besides the defaults under test: no key
    # here touches threads, max_in_flight or the session settings.
    sec = {"server": f"127.0.0.1:{smtp.port}", "starttls": "off"}
    sec.update(kw)
    return {"provider.email": sec, "provider.http": None, "dispatcher": {"providers": "email"}}


def start_line(worker):
    return next((e.get("msg", "") for e in worker.events()
                 if "relay 127.0.0.1" in str(e.get("msg", ""))), None) or worker.log()


def test_default_marks_batches_of_max_in_flight_through_threads_sessions(conn, dispatchers, smtp):
    """100 emails waiting, one worker at the email defaults: the worker
    takes sends to `sending` in batches (one outbox_mark_sending call, one
    effect_calls row) bounded by max_in_flight, so at the default 32 a batch is
    far more than the 8 threads can send at once (at the former default 8
    it could not exceed 8); the extra sends wait in the provider's queue:
    no more SMTP sessions at once than threads, each email delivered once,
    all completed, no attempt lost to the queue."""
    kill_switch(conn, True)
    ids = [enqueue(conn, "email", f"u{n}@example.com", PAYLOAD) for n in range(100)]
    w = dispatchers(email_cfg(smtp))
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'completed'")
             == len(ids), timeout=90, what="100 emails completed")
    # Each mark call's row (effect_calls) names the effects it moved.
    batches = [r[0] for r in query(conn, "SELECT cardinality(ids) FROM effect_calls ORDER BY 1 DESC")]
    assert 2 * DEFAULT_THREADS < batches[0] <= DEFAULT_MAX_IN_FLIGHT, batches
    # Sessions are reused (a session may still end idle when the machine
    # stalls the worker's database cycle past session_idle_ms, so the
    # count of sessions is not exact), and never more than threads at once.
    assert smtp.max_open <= DEFAULT_THREADS, smtp.sessions
    assert len(ids) / smtp.connections >= 5, smtp.sessions
    assert sum(smtp.sessions.values()) == len(ids)
    keys = [r[0] for r in query(conn, "SELECT effect_key FROM outbox_effects")]
    assert all(smtp.count(f"<{k}@outbox-dispatcher.invalid>") == 1 for k in keys)
    assert scalar(conn, "SELECT count(*) FROM effect_attempts WHERE outcome_class <> 'accepted'") == 0
    line = start_line(w)
    assert f"{DEFAULT_THREADS} threads, max_in_flight {DEFAULT_MAX_IN_FLIGHT}," in line, line
    assert "wait in a queue" not in w.log()


def test_queue_far_deeper_than_threads_gets_a_note(dispatchers, smtp):
    """max_in_flight above 16 x threads is allowed, with a note at start
    naming the queue's bound; 16 x threads exactly gets none."""
    deep = dispatchers(email_cfg(smtp, threads=2, max_in_flight=33), name="deep")
    assert "max_in_flight (33) is more than 16 times threads (2)" in deep.log(), deep.log()
    assert "queue_timeout_ms, 10000 ms, then not_sent" in deep.log()
    edge = dispatchers(email_cfg(smtp, threads=2, max_in_flight=32), name="edge")
    assert "2 threads, max_in_flight 32," in start_line(edge)
    assert "more than 16 times threads" not in edge.log()


def test_batches_do_not_shrink_with_a_slow_relay(conn, dispatchers):
    """Every message answered 80 ms after its end of data (a relay far
    away): answers end one by one, yet a busy provider is marked for only
    once half its max_in_flight is free and its outcomes are recorded
    together, so the database round trips carry many emails each (one
    mark call per freed slot, one outbox_complete() call per answer
    before)."""
    s = SmtpServer(pipelining=True)
    s.start()
    try:
        kill_switch(conn, True)
        n = 160
        for k in range(n):
            enqueue(conn, "email", f"u{k}+slow-data-80@example.com", PAYLOAD)
        dispatchers(email_cfg(s))
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM outbox_effects WHERE state = 'completed'")
                 == n, timeout=120, what=f"{n} emails completed")
    finally:
        s.stop()
    marks = scalar(conn, "SELECT count(*) FROM effect_calls")
    # outbox_complete() stamps its transaction's now(): one value per call
    records = scalar(conn, "SELECT count(DISTINCT completed_at) FROM outbox_effects")
    assert n / marks >= 8, (n, marks)
    assert n / records >= 6, (n, records)
    assert sum(s.sessions.values()) == n


def test_outcomes_held_for_a_slow_relay_are_recorded_at_sigterm(conn, dispatchers):
    """One email answered at once, another stalled at the relay: the first
    one's outcome waits (up to 500 ms) for more answers to share its
    outbox_complete() call.  A SIGTERM with a grace shorter than that wait
    records it at once, so the stop leaves it `completed`, not `sending`
    (which the reaper would make `unknown`)."""
    s = SmtpServer(pipelining=True)
    s.start()
    port = free_port()
    try:
        kill_switch(conn, True)
        fast = enqueue(conn, "email", "fast@example.com", PAYLOAD)
        enqueue(conn, "email", "stalled+slow-data-30000@example.com", PAYLOAD)
        cfg = email_cfg(s)
        cfg["dispatcher"]["shutdown_grace_ms"] = 100
        cfg["metrics"] = {"listen": f"127.0.0.1:{port}"}
        w = dispatchers(cfg)
        # Both messages are at the relay, the fast one answered, the
        # stalled one not: one send in flight in the worker means the fast
        # one's answer is in (its outcome held), the stalled one's not.
        def fast_answered_stalled_waiting():
            with s.lock:
                got = {m["rcpt_tos"][0]: m["replied"] for m in s.messages}
            return (len(got) == 2 and got.get("fast@example.com") is not None
                    and scrape(port).get("outbox_sends_in_flight") == 1)
        wait_for(fast_answered_stalled_waiting, what="the fast email answered, the stalled one in flight")
        w.stop()
        assert scalar(conn, "SELECT state FROM outbox_effects WHERE effect_id = %s", (fast,)) == "completed"
    finally:
        s.stop()
