# SPDX-License-Identifier: ISC
"""The email provider against a real Postfix (tests/servers/postfix_relay.py:
Debian's postfix 3.7 binaries, a config of the test's own, loopback only,
delivering into a maildir so that copies are counted per Message-ID), with
CHUNKING on (Debian's default: libesmtp then sends BDAT) and off
(`smtpd_discard_ehlo_keywords = chunking`: DATA).

The commit-point faults go through tests/servers/smtp_fault_proxy.py,
which picks the messages whose recipient has `+fault`:
  a cut before the content (at RCPT TO, with the BDAT chunks behind it),
  a cut after the content, a stall after it past timeout_ms, the final
  reply lost, and every smtpd SIGKILLed mid-stream.
Each asserts what the relay holds: no message twice, none lost (every
`accepted` delivered once, every `retry`/`not_sent` never), `ambiguous`
only where the content had ended, and that the process survived (the
provider_send exit code: libesmtp 1.1.0's crash on a BDAT connection lost
with replies pending is a SIGSEGV there).
"""
import threading
import time

import pytest

from test_email import Direct, eff, payload  # noqa: F401 (fixtures below)
from test_email import provider_send  # noqa: F401 - the fixture
from test_email import email_cfg, key_of, msgid as msgid_of, wait_state
from outbox_test import effect, enqueue, kill_switch

import postfix_relay
from smtp_fault_proxy import SmtpFaultProxy

WHY = postfix_relay.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no private Postfix: {WHY}")
WAYS = pytest.mark.parametrize("chunking", [True, False], ids=["chunking", "no-chunking"])


@pytest.fixture
def direct(provider_send, tmp_path):  # noqa: F811
    return Direct(provider_send, tmp_path)


@pytest.fixture(scope="module")
def relays():
    """One Postfix per way, shared by the module's tests (a start costs
    about a second); every test uses its own Message-IDs."""
    out = {}
    try:
        for chunking in (True, False):
            r = postfix_relay.PostfixRelay(chunking=chunking)
            r.start()
            out[chunking] = r
        yield out
    finally:
        for r in out.values():
            r.stop()


def key(tag, n):
    """An effect key of this test alone (Message-IDs derive from it)."""
    return f"{tag:08x}{n:056x}"


def effs(tag, n, faulted=()):
    return [{**eff(i, f"u{i}{'+fault' if i in faulted else ''}@example.com"),
             "effect_key": key(tag, i)} for i in range(1, n + 1)]


def mid(tag, n):
    return f"<{key(tag, n)}@outbox-dispatcher.invalid>"


def cfg(port, **kw):
    sec = {"server": f"127.0.0.1:{port}", "starttls": "off", "timeout_ms": 3000,
           "connect_timeout_ms": 1000}
    sec.update(kw)
    return sec


TAGS = iter(range(1, 1 << 30))


def check(relay, res, tag, n, rc):
    """The invariants of every fault: no crash, none twice, none lost."""
    assert rc == 0, f"provider_send exit {rc} (signal {-rc if rc < 0 else 0})"
    relay.settle(30)
    got = relay.deliveries()
    by = {}
    for i in range(1, n + 1):
        r = res[f"e{i}"]
        c = got.get(mid(tag, i), 0)
        by.setdefault(r["outcome"], []).append(i)
        assert c <= 1, f"e{i} delivered {c} times ({r})"
        if r["outcome"] == "accepted":
            assert c == 1, f"e{i} accepted but not delivered ({r})"
        if r["outcome"] in ("retry", "not_sent", "terminal"):
            assert c == 0, f"e{i} delivered but recorded {r['outcome']}: {r['error']}"
    return by


# -- plain delivery ------------------------------------------------------------

@WAYS
def test_postfix_delivers_each_once_over_reused_sessions(direct, relays, chunking):
    """30 messages over 2 threads' reused sessions: each accepted, delivered
    once, its provider id Postfix's queue id."""
    relay, tag = relays[chunking], next(TAGS)
    res = direct.run(cfg(relay.port, threads=2), effs(tag, 30))
    by = check(relay, res, tag, 30, direct.rc)
    assert by == {"accepted": list(range(1, 31))}, res
    assert all(len(res[f"e{i}"]["provider_id"]) >= 8 for i in range(1, 31))
    assert len({res[f"e{i}"]["provider_id"] for i in range(1, 31)}) == 30


# -- the commit-point faults -----------------------------------------------------

@WAYS
def test_postfix_cut_before_the_content_is_retry_and_no_crash(direct, relays, chunking):
    """The connection is cut at the RCPT TO of messages 3 and 7 (with
    CHUNKING that write carries the BDAT chunks, RCPT and 3 BDATs
    unanswered): each is `retry` and never reached Postfix; the process
    lives (libesmtp 1.1.0 took SIGSEGV here when the BDATs were pipelined
    behind RCPT TO); the others are delivered once."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "cut-before")
    p.start()
    try:
        res = direct.run(cfg(p.port, threads=1), effs(tag, 9, faulted=(3, 7)))
    finally:
        p.stop()
    by = check(relay, res, tag, 9, direct.rc)
    assert p.faulted == 2
    assert by == {"accepted": [1, 2, 4, 5, 6, 8, 9], "retry": [3, 7]}, res
    assert "nothing sent" in res["e3"]["error"] or "cannot have accepted" in res["e3"]["error"]


@pytest.mark.parametrize("line", [b" CHUNKING", b"\tCHUNKING", b"chunking\t", b"CHUNKING;",
                                  b"CHUNKING(x)"],
                         ids=["space", "tab", "trailing-tab", "semicolon", "paren"])
def test_postfix_cut_before_the_content_other_chunking_spellings(direct, relays, line):
    """CHUNKING offered in a spelling libesmtp reads as CHUNKING (its EHLO
    parser skips blanks and reads an atom) but not written "250 CHUNKING":
    the provider still has RCPT TO answered before the BDAT chunks, so the
    cut at RCPT TO of message 3 is `retry` and the process lives."""
    relay, tag = relays[True], next(TAGS)
    p = SmtpFaultProxy(relay.port, "cut-before", chunking_line=line)
    p.start()
    try:
        res = direct.run(cfg(p.port, threads=1), effs(tag, 5, faulted=(3,)))
    finally:
        p.stop()
    by = check(relay, res, tag, 5, direct.rc)
    assert p.faulted == 1
    assert by == {"accepted": [1, 2, 4, 5], "retry": [3]}, res


@WAYS
@pytest.mark.parametrize("delay_s", [0.3, 5.0], ids=["cut", "stall"])
def test_postfix_no_reply_after_the_content_is_ambiguous_never_resent(direct, relays, chunking,
                                                                      delay_s):
    """The content of messages 2 and 5 reaches Postfix; no reply comes back
    (cut 0.3 s later, or stalled past timeout_ms 3 s): each is `ambiguous`
    (Postfix holds exactly one copy), never `retry` (which would send it a
    second time); the others are delivered once."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "after-content", delay_s=delay_s)
    p.start()
    try:
        res = direct.run(cfg(p.port, threads=1), effs(tag, 6, faulted=(2, 5)))
    finally:
        p.stop()
    by = check(relay, res, tag, 6, direct.rc)
    assert by == {"accepted": [1, 3, 4, 6], "ambiguous": [2, 5]}, res
    assert relay.count(mid(tag, 2)) == 1 and relay.count(mid(tag, 5)) == 1
    assert "may have queued" in res["e2"]["error"], res["e2"]


@WAYS
def test_postfix_lost_final_reply_is_ambiguous(direct, relays, chunking):
    """Postfix answers the end of message 3's content, the answer is lost
    and the connection closed: `ambiguous`, one copy at Postfix; 4 and 5
    go over a new session."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "lost-final")
    p.start()
    try:
        res = direct.run(cfg(p.port, threads=1), effs(tag, 5, faulted=(3,)))
    finally:
        p.stop()
    by = check(relay, res, tag, 5, direct.rc)
    assert by == {"accepted": [1, 2, 4, 5], "ambiguous": [3]}, res
    assert relay.count(mid(tag, 3)) == 1 and p.connections == 2


@WAYS
def test_postfix_smtpd_killed_mid_stream(direct, relays, chunking):
    """120 messages over 4 threads; every smtpd of the relay is SIGKILLed
    twice while they flow: no crash, no copy twice, every `accepted`
    delivered, every `retry`/`not_sent` absent, `ambiguous` only for
    messages whose content had ended (at most one per killed session)."""
    relay, tag = relays[chunking], next(TAGS)
    n = 120
    killed = []

    def killer():
        for _ in range(2):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(relay.deliveries()) < 20 * (len(killed) + 1):
                time.sleep(0.02)
            killed.append(relay.kill_smtpd())

    t = threading.Thread(target=killer)
    t.start()
    try:
        res = direct.run(cfg(relay.port, threads=4, timeout_ms=5000), effs(tag, n), timeout=120)
    finally:
        t.join()
    by = check(relay, res, tag, n, direct.rc)
    assert sum(killed) > 0, killed
    assert len(by.get("ambiguous", [])) <= sum(killed), (by, killed)
    assert len(by.get("accepted", [])) >= n - 2 * sum(killed) - 8, by


# -- margin and monitor ------------------------------------------------------------

@WAYS
def test_postfix_margin_abort_is_not_sent(direct, relays, chunking):
    """A greeting that leaves less than the margin of timeout_ms before the
    end of the content: the message is aborted before its terminator (with
    CHUNKING: before BDAT LAST) and recorded `not_sent`; Postfix has
    nothing."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "none", greeting_delay_s=2.3)
    p.start()
    try:
        res = direct.run(cfg(p.port, threads=1, timeout_ms=3000), effs(tag, 1))
    finally:
        p.stop()
    check(relay, res, tag, 1, direct.rc)
    r = res["e1"]
    assert r["outcome"] == "not_sent", r
    assert "before the end-of-data terminator" in r["error"] and "margin" in r["error"], r


@WAYS
def test_postfix_monitor_after_the_first_message(direct, relays, chunking):
    """Message 3 of a session (after two BDAT or DATA messages) gets no
    reply to its MAIL FROM within timeout_ms: the provider knows MAIL FROM
    was written (`retry`, "no reply to MAIL FROM"), not a session that
    ended before it; Postfix has no copy."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "stall-mail", delay_s=6)
    p.start()
    e = effs(tag, 3)
    e[2]["payload"] = payload(**{"from": "Outbox <noreply+fault@example.com>"})
    try:
        res = direct.run(cfg(p.port, threads=1), e)
    finally:
        p.stop()
    by = check(relay, res, tag, 3, direct.rc)
    assert by == {"accepted": [1, 2], "retry": [3]}, res
    assert "no reply to MAIL FROM" in res["e3"]["error"], res["e3"]


@WAYS
def test_postfix_refused_recipient_then_the_same_session(direct, relays, chunking):
    """A 550 to RCPT TO in the middle of a session: `terminal` 550, nothing
    delivered, the others delivered once.  With CHUNKING the refusal ends
    the transaction at RCPT TO's reply (no BDAT is sent) and the next
    messages go over the same connection after RSET; with DATA, libesmtp
    looks for a next message before it reports the refused DATA, finds
    none and QUITs, so the next ones take a new connection (session.c)."""
    relay, tag = relays[chunking], next(TAGS)
    p = SmtpFaultProxy(relay.port, "none")
    p.start()
    e = effs(tag, 4)
    e[1]["target"] = "refused@example.com"
    try:
        res = direct.run(cfg(p.port, threads=1), e)
    finally:
        p.stop()
    by = check(relay, res, tag, 4, direct.rc)
    assert by == {"accepted": [1, 3, 4], "terminal": [2]}, res
    assert res["e2"]["status"] == 550 and "RCPT TO refused" in res["e2"]["error"], res["e2"]
    assert p.connections == (1 if chunking else 2)


# -- end to end: workers, the database, Postfix ----------------------------------

@WAYS
@pytest.mark.parametrize("fault", ["after-content", "cut-before"])
def test_postfix_workers_never_send_twice(conn, dispatchers, relays, chunking, fault):
    """Real workers against Postfix through the fault proxy: an email whose
    content reached Postfix and got no answer ends `unknown` with one copy
    at Postfix and is never sent again (the workers' retries would have
    made a second); one cut before its content is retried and delivered
    once; an email after it through the same workers is delivered."""
    relay = relays[chunking]
    p = SmtpFaultProxy(relay.port, fault, delay_s=0.3)
    p.start()
    try:
        kill_switch(conn, True)
        dispatchers(email_cfg(f"127.0.0.1:{p.port}", threads=2))
        eid = enqueue(conn, "email", "bob+fault@example.com", payload())
        if fault == "after-content":
            e = wait_state(conn, eid, "unknown")
            assert e["last_error_class"] == "ambiguous" and e["attempts"] == 1, e
        else:
            e = wait_state(conn, eid, "completed", "failed")
        later = enqueue(conn, "email", "carol@example.com", payload())
        wait_state(conn, later, "completed")
    finally:
        p.stop()
    relay.settle(30)
    if fault == "after-content":
        assert effect(conn, eid)["state"] == "unknown"
        assert relay.count(msgid_of(key_of(conn, eid))) == 1
    else:
        # every attempt is cut before its content: never delivered, retried
        # until max_attempts, never unknown
        assert e["state"] == "failed" and e["last_error_class"] in ("retry", "not_sent"), e
        assert relay.count(msgid_of(key_of(conn, eid))) == 0
    assert relay.count(msgid_of(key_of(conn, later))) == 1
