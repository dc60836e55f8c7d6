# SPDX-License-Identifier: ISC
"""The email provider (providers/email/) against a real SMTP peer
(tests/servers/smtp_server.py, aiosmtpd scripted per recipient).

Two ways in:
  * end to end: real workers (build/outbox-dispatcher) lease the effects,
    the plugin talks SMTP, the database records the outcome;
  * provider_send (tests/tools/provider_send.c): the plugin alone on a
    fresh event loop, for exact outcome classes, status codes and
    reasons, and for paths a worker cannot reach (non-UTF-8 target,
    shutdown with sessions in flight, a saturated pool).

No fixed sleeps: every wait polls a condition with a deadline.  Where a
test asserts that something does NOT happen (no re-send of an unknown
email), it lets a later effect through the same worker first, which
proves the worker went on polling meanwhile.
"""
import json
import os
import subprocess
import time

import pytest

from outbox_test import (BUILD_DIR, ROOT, Dispatcher, attempts, effect, enqueue, kill_switch,
                         make_run, query, run_state, scalar, wait_for, write_config)

from smtp_server import SmtpServer  # noqa: E402

PASSWORD = "s3cret-Pa55word-for-the-relay"
DOMAIN = "outbox-dispatcher.invalid"
FAST = {"backoff_base_ms": 10, "backoff_cap_ms": 50, "max_attempts": 3, "timeout_ms": 3000,
        "connect_timeout_ms": 1000, "breaker_failures": 1000}


# -- fixtures and helpers ---------------------------------------------------

@pytest.fixture(autouse=True)
def sanitizer_clean(tmp_path):
    """Workers write their logs under tmp_path: no sanitizer report in any."""
    yield
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Sanitizer" not in text and "runtime error:" not in text, text[-4000:]


def email_cfg(server, **kw):
    sec = {"server": f"127.0.0.1:{server.port}" if hasattr(server, "port") else server,
           "starttls": "off"}
    sec.update(FAST)
    sec.update(kw)
    return {"provider.email": sec, "provider.http": None, "dispatcher": {"providers": "email"}}


def payload(**kw):
    p = {"from": "Outbox <noreply@example.com>", "subject": "Your refund",
         "text": "Hello,\nyour refund is on its way.\n"}
    p.update(kw)
    return p


def key_of(conn, eid):
    return scalar(conn, "SELECT effect_key FROM outbox_effects WHERE effect_id = %s", (eid,))


def msgid(key):
    return f"<{key}@{DOMAIN}>"


def wait_state(conn, eid, *states, timeout=30):
    return wait_for(lambda: (lambda e: e if e and e["state"] in states else None)(effect(conn, eid)),
                    timeout=timeout, what=f"effect {eid} in {states} (now {effect(conn, eid)})")


def classes(conn, eid):
    return [(a["outcome_class"], a["provider_status"]) for a in attempts(conn, eid)]


def no_secret_in(text):
    assert PASSWORD not in text, "the SMTP password leaked into a log"


@pytest.fixture(scope="session")
def provider_send(tmp_path_factory):
    """Compile tests/tools/provider_send.c against the build's own config
    (config, config_read), util, log and text objects (sanitizer flags when
    the build has them)."""
    out = tmp_path_factory.mktemp("tools") / "provider_send"
    objs = [os.path.join(BUILD_DIR, "obj", f"{n}.o")
            for n in ("lib/config", "lib/config_read", "lib/util",
                      "lib/log", "lib/text")]
    pkgs = ["jansson", "libevent", "libevent_pthreads", "inih", "libcrypto", "libpq", "libsystemd"]
    flags = subprocess.run(["pkg-config", "--cflags", "--libs"] + pkgs, check=True,
                           capture_output=True, text=True).stdout.split()
    san = ["-fsanitize=address,undefined"] if "asan" in os.path.basename(BUILD_DIR) else []
    cmd = (["cc", "-std=c11", "-D_GNU_SOURCE", "-g", "-Wall", "-Wextra", "-Werror",
            "-Wno-unused-parameter", "-I" + os.path.join(ROOT, "lib"),
            "-I" + os.path.join(ROOT, "providers"), "-o", str(out),
            os.path.join(ROOT, "tests", "tools", "provider_send.c")] + objs + san + flags +
           ["-ldl", "-lpthread", "-lm"])
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(out)


class Direct:
    """provider_send runs: results by effect id, the provider's log lines."""

    def __init__(self, tool, tmp_path):
        self.tool = tool
        self.tmp = tmp_path
        self.n = 0

    def run(self, section, effects, exit_after_ms=None, env=None, timeout=60):
        self.n += 1
        ini = write_config(str(self.tmp / f"direct{self.n}.ini"), {"provider.email": section})
        ej = self.tmp / f"effects{self.n}.json"
        ej.write_text(json.dumps(effects))
        plugin = os.path.join(BUILD_DIR, "providers", "outbox_email.so")
        args = [self.tool] + (["--exit-after-ms", str(exit_after_ms)] if exit_after_ms else []) + \
            [plugin, ini, "email", str(ej)]
        e = dict(os.environ)
        e.update(env or {})
        t0 = time.monotonic()
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=e)
        self.elapsed = time.monotonic() - t0
        self.stderr = r.stderr
        self.rc = r.returncode
        assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error:" not in r.stderr, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        self.lines = lines
        return {x.get("effect_id", x["stage"]): x for x in lines}


@pytest.fixture
def direct(provider_send, tmp_path):
    return Direct(provider_send, tmp_path)


def eff(n, target, **kw):
    return {"effect_id": f"e{n}", "effect_key": f"{n:064x}", "target": target,
            "payload": kw.pop("payload", payload()), **kw}


def direct_cfg(server, **kw):
    sec = {"server": f"127.0.0.1:{server.port}", "starttls": "off", "timeout_ms": 3000,
           "connect_timeout_ms": 1000}
    sec.update(kw)
    return sec


# -- accepted ----------------------------------------------------------------

def test_accepted_stores_queue_id_and_derives_message_id(conn, dispatchers, smtp):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    eid = enqueue(conn, "email", "alice@example.com",
                  payload(subject="Votre remboursement \u2713", html="<p>Hello</p>",
                          headers={"Reply-To": "support@example.com", "X-Campaign": "refunds"}))
    e = wait_state(conn, eid, "completed")
    key = key_of(conn, eid)
    [m] = smtp.received()
    assert e["provider_id"] == m["queue_id"], (e, m["replied"])
    assert e["last_status"] == 250
    assert classes(conn, eid) == [("accepted", 250)]
    assert attempts(conn, eid)[0]["provider_id"] == m["queue_id"]
    msg = m["msg"]
    assert msg["Message-ID"] == msgid(key)
    assert msg["X-Outbox-Effect-Id"] == str(eid)
    assert msg["Subject"] == "Votre remboursement \u2713"
    assert msg["Reply-To"] == "support@example.com" and msg["X-Campaign"] == "refunds"
    assert m["mail_from"] == "noreply@example.com" and m["rcpt_tos"] == ["alice@example.com"]
    assert msg.get_content_type() == "multipart/alternative"
    parts = {p.get_content_type(): p.get_content() for p in msg.iter_parts()}
    assert parts["text/plain"].replace("\r\n", "\n") == "Hello,\nyour refund is on its way.\n"
    assert parts["text/html"].strip() == "<p>Hello</p>"
    assert msg["Date"], "a Date header is present"


def test_message_id_is_the_same_on_every_attempt(conn, dispatchers, smtp):
    """451 after the end of data: the relay saw the message and refused it
    for now; each retry carries the same Message-ID, so a downstream system
    can tell a repeat."""
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    eid = enqueue(conn, "email", "bob+tempfail-data@example.com", payload())
    e = wait_state(conn, eid, "failed")
    key = key_of(conn, eid)
    assert e["attempts"] == 3 and e["last_error_class"] == "retry"
    assert classes(conn, eid) == [("retry", 451)] * 3
    assert smtp.count(msgid(key)) == 3
    assert {m["msg"]["X-Outbox-Effect-Id"] for m in smtp.received()} == {str(eid)}


def test_two_effects_of_one_run_get_different_message_ids(conn, dispatchers, smtp):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    run = make_run(conn)
    a = enqueue(conn, "email", "a@example.com", payload(), key=run)
    b = enqueue(conn, "email", "b@example.com", payload(), key=run)
    wait_state(conn, a, "completed")
    wait_state(conn, b, "completed")
    ids = {m["message_id"] for m in smtp.received()}
    assert ids == {msgid(key_of(conn, a)), msgid(key_of(conn, b))}


# -- 4xx before DATA: pending with backoff, retried ---------------------------

@pytest.mark.parametrize("sender,rcpt,status", [
    ("noreply@example.com", "bob+tempfail-rcpt@example.com", 450),
    ("noreply+tempfail-mail@example.com", "bob@example.com", 451),
    ("noreply@example.com", "bob+tempfail-datacmd@example.com", 451),
], ids=["rcpt-450", "mail-451", "datacmd-451"])
def test_4xx_before_data_is_retried_then_fails(conn, dispatchers, smtp, sender, rcpt, status):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    eid = enqueue(conn, "email", rcpt, payload(**{"from": sender}))
    e = wait_state(conn, eid, "failed")
    assert e["attempts"] == 3 and e["last_error_class"] == "retry", e
    assert classes(conn, eid) == [("retry", status)] * 3
    assert e["last_status"] == status
    assert smtp.received() == [], "nothing was transferred"


def test_4xx_leaves_the_effect_pending_with_backoff(conn, dispatchers, smtp):
    kill_switch(conn, True)
    w = dispatchers(email_cfg(smtp, backoff_base_ms=60000, backoff_cap_ms=60000, max_attempts=5))
    eid = enqueue(conn, "email", "bob+tempfail-rcpt@example.com", payload())
    ev = wait_for(lambda: [e for e in w.events() if e.get("event") == "attempt"
                           and e.get("effect_id") == str(eid)], what="the first attempt")[0]
    assert ev["outcome"] == "retry" and ev["next_state"] == "pending" and "retry_in_ms" in ev, ev
    e = wait_state(conn, eid, "pending")
    assert e["attempts"] == 1 and e["last_error_class"] == "retry"
    assert "450" in e["last_error"] and "RCPT TO" in e["last_error"]


# -- 5xx: failed ----------------------------------------------------------------

@pytest.mark.parametrize("sender,rcpt,status,received,words", [
    ("noreply@example.com", "bob+reject-rcpt@example.com", 550, 0, "RCPT TO refused: 550"),
    ("noreply+reject-mail@example.com", "bob@example.com", 553, 0, "MAIL FROM refused: 553"),
    ("noreply@example.com", "bob+reject-datacmd@example.com", 554, 0, "DATA refused: 554"),
    ("noreply@example.com", "bob+reject-data@example.com", 554, 1, "after the end of data: 554"),
], ids=["rcpt-550", "mail-553", "datacmd-554", "after-data-554"])
def test_5xx_fails_at_once(conn, dispatchers, smtp, sender, rcpt, status, received, words):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    eid = enqueue(conn, "email", rcpt, payload(**{"from": sender}))
    e = wait_state(conn, eid, "failed")
    assert e["attempts"] == 1 and e["last_error_class"] == "terminal", e
    assert classes(conn, eid) == [("terminal", status)]
    assert words in e["last_error"], e
    assert len(smtp.received()) == received


def test_mixed_results_across_the_effects_of_one_run(conn, dispatchers, smtp):
    """One run, four recipients, one relay: each effect gets its own
    recipient's answer."""
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    run = make_run(conn)
    ok = enqueue(conn, "email", "ann@example.com", payload(), key=run)
    busy = enqueue(conn, "email", "ben+tempfail-rcpt@example.com", payload(), key=run)
    gone = enqueue(conn, "email", "cat+reject-rcpt@example.com", payload(), key=run)
    ok2 = enqueue(conn, "email", "dan@example.com", payload(), key=run)
    assert wait_state(conn, ok, "completed")["provider_id"]
    assert wait_state(conn, ok2, "completed")["provider_id"]
    assert wait_state(conn, gone, "failed")["last_error_class"] == "terminal"
    b = wait_state(conn, busy, "failed")
    assert b["last_error_class"] == "retry" and b["attempts"] == 3
    assert sorted(r for m in smtp.received() for r in m["rcpt_tos"]) == \
        ["ann@example.com", "dan@example.com"]
    assert run_state(conn, run) == "failed_terminal"


def test_mixed_results_direct(direct, smtp):
    """The same, classified by the plugin alone, several sessions at once."""
    res = direct.run(direct_cfg(smtp, threads=4), [
        eff(1, "ann@example.com"),
        eff(2, "ben+tempfail-rcpt@example.com"),
        eff(3, "cat+reject-rcpt@example.com"),
        eff(4, "dan+reject-data@example.com"),
        eff(5, "eve+tempfail-data@example.com"),
        eff(6, "fay@example.com"),
    ])
    got = {k: (v["outcome"], v["status"]) for k, v in res.items()}
    assert got == {"e1": ("accepted", 250), "e2": ("retry", 450), "e3": ("terminal", 550),
                   "e4": ("terminal", 554), "e5": ("retry", 451), "e6": ("accepted", 250)}
    queue_ids = {m["rcpt_tos"][0]: m["queue_id"] for m in smtp.received()}
    assert res["e1"]["provider_id"] == queue_ids["ann@example.com"]
    assert res["e6"]["provider_id"] == queue_ids["fay@example.com"]
    assert all(v["host_key"] == f"127.0.0.1:{smtp.port}" for v in res.values())
    assert direct.rc == 0


# -- no answer after the end of data: unknown, received once, never re-sent ----

@pytest.mark.parametrize("mode,cfg", [
    ("drop-after-data", {}),
    ("silent-after-data", {"timeout_ms": 2500}),
    ("slow-data-2700", {"timeout_ms": 2500}),
], ids=["disconnect", "no-reply", "reply-too-late"])
def test_no_answer_after_data_is_unknown_and_never_resent(conn, dispatchers, smtp, mode, cfg):
    kill_switch(conn, True)
    w = dispatchers(email_cfg(smtp, **cfg))
    eid = enqueue(conn, "email", f"bob+{mode}@example.com", payload())
    key = key_of(conn, eid)
    if mode.startswith("slow-data"):
        # The late 250 comes 200 ms after the timeout: a loaded machine may
        # record it before this test looks, so the ambiguous attempt is
        # read from the history, whatever the state is by then.
        wait_for(lambda: classes(conn, eid)[:1] == [("ambiguous", None)], timeout=30,
                 what="the ambiguous attempt")
        assert classes(conn, eid) in ([("ambiguous", None)],
                                      [("ambiguous", None), ("reconciled_sent", 250)]), \
            classes(conn, eid)
        assert "end of data" in attempts(conn, eid)[0]["error_text"]
    else:
        e = wait_state(conn, eid, "unknown")
        assert e["attempts"] == 1 and e["last_error_class"] == "ambiguous", e
        assert "end of data" in e["last_error"]
        assert classes(conn, eid) == [("ambiguous", None)]
    # A later effect through the same worker: it kept polling meanwhile.
    later = enqueue(conn, "email", "carol@example.com", payload())
    wait_state(conn, later, "completed")
    assert smtp.count(msgid(key)) == 1, "received exactly once"
    if not mode.startswith("slow-data"):
        assert effect(conn, eid)["state"] == "unknown" and len(attempts(conn, eid)) == 1
    else:
        # The relay did answer 250 in the end: logged, and the proof of
        # acceptance completes the effect with the relay's queue id
        # (tests/reconcile/test_late_acceptance.py has the details).
        qid = wait_for(lambda: [m["queue_id"] for m in smtp.received() if m["replied"]
                                and m["message_id"] == msgid(key)], timeout=15,
                       what="the late 250")[0]
        wait_for(lambda: qid in w.log(), timeout=15, what="the late acceptance in the log")
        assert str(eid) in [ln for ln in w.log().splitlines() if qid in ln][0]
        e = wait_state(conn, eid, "completed")
        assert e["provider_id"] == qid
        assert [a["outcome_class"] for a in attempts(conn, eid)] == ["ambiguous", "reconciled_sent"]


def test_no_answer_after_data_direct(direct, smtp):
    res = direct.run(direct_cfg(smtp, timeout_ms=2500), [
        eff(1, "a+drop-after-data@example.com"),
        eff(2, "b+silent-after-data@example.com"),
    ])
    for k in ("e1", "e2"):
        assert res[k]["outcome"] == "ambiguous" and res[k]["status"] == 0, res[k]
        assert "may have queued" in res[k]["error"]
    assert "timed out" in res["e2"]["error"]
    assert smtp.count(msgid(f"{1:064x}")) == 1 and smtp.count(msgid(f"{2:064x}")) == 1
    assert direct.elapsed < 10


# -- slow relays ------------------------------------------------------------------

def test_slow_relay_within_timeout_is_accepted(conn, dispatchers, smtp):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp, timeout_ms=4000))
    eid = enqueue(conn, "email", "bob+slow-data-1200@example.com", payload())
    e = wait_state(conn, eid, "completed")
    assert classes(conn, eid) == [("accepted", 250)]
    assert e["provider_id"] == smtp.received()[0]["queue_id"]


def test_slow_relay_before_data_beyond_timeout_is_retried(conn, dispatchers, smtp):
    """A RCPT answer later than timeout_ms: nothing was transferred, so the
    effect goes back to the queue.  The given-up sessions still get their
    answer (libesmtp waits a little longer than the loop) and reach DATA:
    they must not transfer the message (no end of data once given up on)."""
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp, timeout_ms=2000, max_attempts=2))
    eid = enqueue(conn, "email", "bob+slow-rcpt-2300@example.com", payload())
    e = wait_state(conn, eid, "failed")
    assert [c for c, _ in classes(conn, eid)] == ["retry", "retry"]
    assert "RCPT TO" in e["last_error"] and "nothing sent" in e["last_error"]
    wait_for(lambda: smtp.data_commands >= 2 or None, timeout=15,
             what="the given-up sessions reached DATA")
    later = enqueue(conn, "email", "carol@example.com", payload())
    wait_state(conn, later, "completed")
    assert [m["rcpt_tos"] for m in smtp.received()] == [["carol@example.com"]]


def test_slow_greeting_beyond_timeout_is_not_sent(direct):
    s = SmtpServer(greeting_delay_ms=3000)
    s.start()
    try:
        res = direct.run(direct_cfg(s, timeout_ms=700), [eff(1, "bob@example.com")])
        r = res["e1"]
        assert r["outcome"] == "not_sent" and "before MAIL FROM" in r["error"], r
        assert r["elapsed_ms"] < 2500
    finally:
        s.stop()
    assert s.transactions == [] and s.received() == []


def test_reload_applies_new_timeouts(conn, dispatchers, smtp):
    """timeout_ms is a common key: SIGHUP changes it for the next sends."""
    import signal as sig
    kill_switch(conn, True)
    w = dispatchers(email_cfg(smtp, timeout_ms=2500))
    a = enqueue(conn, "email", "a+slow-data-3000@example.com", payload())
    assert wait_state(conn, a, "unknown")["last_error_class"] == "ambiguous"
    w.sections["provider.email"]["timeout_ms"] = 5000
    write_config(w.config_path, w.sections)
    w.signal(sig.SIGHUP)
    wait_for(lambda: any(e.get("event") == "reloaded" for e in w.events()), what="the reload")
    b = enqueue(conn, "email", "b+slow-data-3000@example.com", payload())
    assert wait_state(conn, b, "completed")["provider_id"]


# -- session-level refusals ---------------------------------------------------

@pytest.mark.parametrize("opts,outcome,status,words", [
    ({"greeting": "421 4.3.2 too busy, come back later"}, "retry", 421, "refused the session"),
    ({"greeting": "554 5.7.1 no SMTP service for you"}, "terminal", 554, "refused the session"),
    ({"ehlo_reply": "421 4.7.0 closing"}, "retry", 421, "refused the session"),
], ids=["greeting-421", "greeting-554", "ehlo-421"])
def test_session_refusals(direct, opts, outcome, status, words):
    s = SmtpServer(**opts)
    s.start()
    try:
        res = direct.run(direct_cfg(s), [eff(1, "bob@example.com")])
    finally:
        s.stop()
    r = res["e1"]
    assert (r["outcome"], r["status"]) == (outcome, status), r
    assert words in r["error"]
    assert s.received() == [] and s.transactions == []


def test_connection_refused_is_not_sent_and_retried(conn, dispatchers):
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    kill_switch(conn, True)
    dispatchers(email_cfg(f"127.0.0.1:{port}", max_attempts=2))
    eid = enqueue(conn, "email", "bob@example.com", payload())
    e = wait_state(conn, eid, "failed")
    assert [c for c, _ in classes(conn, eid)] == ["not_sent", "not_sent"]
    assert "cannot connect" in e["last_error"] and "refused" in e["last_error"].lower()


def test_relay_back_after_an_outage_is_used_within_seconds(conn, dispatchers):
    """The relay is down (connection refused) until the breaker opens; then
    it comes back on the same port.  The breaker's half-open probe goes
    after ~1 s (not breaker_open_ms = 30 s), so the waiting emails are
    delivered within 5 s of the relay's return, each once."""
    import socket
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))          # bound, not listening: connects are refused
    port = hold.getsockname()[1]
    kill_switch(conn, True)
    w = dispatchers(email_cfg(f"127.0.0.1:{port}", max_attempts=1000, breaker_failures=2,
                              breaker_open_ms=30000))
    eids = [enqueue(conn, "email", f"u{n}@example.com", payload()) for n in range(4)]
    wait_for(lambda: '"breaker_open"' in w.log(), timeout=20, what="the breaker opened")
    hold.close()
    s = SmtpServer(port=port)
    s.start()
    back = time.monotonic()
    try:
        for eid in eids:
            wait_state(conn, eid, "completed", timeout=max(0.1, back + 5 - time.monotonic()))
        took = time.monotonic() - back
        assert all(s.count(msgid(key_of(conn, eid))) == 1 for eid in eids)
    finally:
        s.stop()
    assert took < 5, took


def test_connect_timeout_is_not_sent(direct):
    """A relay whose accept queue is full: SYNs go unanswered and connect()
    hangs (libesmtp has no connect timeout of its own).  Given up at
    connect_timeout_ms, not timeout_ms."""
    import socket
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    filler = socket.create_connection(lst.getsockname())
    try:
        res = direct.run({"server": f"127.0.0.1:{lst.getsockname()[1]}", "starttls": "off",
                          "timeout_ms": 5000, "connect_timeout_ms": 400},
                         [eff(1, "bob@example.com")])
    finally:
        filler.close()
        lst.close()
    r = res["e1"]
    assert r["outcome"] == "not_sent" and "connect to relay" in r["error"] and \
        "timed out" in r["error"], r
    assert 350 <= r["elapsed_ms"] < 2000, r


def test_unresolvable_relay_is_not_sent(direct):
    res = direct.run({"server": "no-such-relay.invalid:25", "starttls": "off",
                      "timeout_ms": 3000}, [eff(1, "bob@example.com")])
    assert res["e1"]["outcome"] == "not_sent", res


# -- STARTTLS and AUTH --------------------------------------------------------------

@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    return str(cert), str(key)


def test_starttls_required_but_not_offered_is_terminal_nothing_sent(conn, dispatchers, smtp):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp, starttls="required"))
    eid = enqueue(conn, "email", "bob@example.com", payload())
    e = wait_state(conn, eid, "failed")
    assert e["attempts"] == 1 and e["last_error_class"] == "terminal", e
    assert "STARTTLS" in e["last_error"] and "nothing sent" in e["last_error"]
    assert smtp.transactions == [] and smtp.received() == [] and smtp.data_commands == 0


@pytest.mark.parametrize("server", ["localhost", "127.0.0.1"], ids=["untrusted", "wrong-name"])
def test_starttls_with_a_bad_certificate_is_not_sent(direct, tls_files, server):
    """No CA vouches for it (system store only), or the certificate names
    another host: refused before MAIL FROM, nothing sent."""
    s = SmtpServer(host="127.0.0.1", tls=tls_files)
    s.start()
    try:
        cfg = {"server": f"{server}:{s.port}", "starttls": "optional", "timeout_ms": 3000}
        if server != "localhost":
            cfg["ca_file"] = tls_files[0]
        res = direct.run(cfg, [eff(1, "bob@example.com")])
    finally:
        s.stop()
    r = res["e1"]
    assert r["outcome"] == "not_sent" and "certificate" in r["error"], r
    assert r["elapsed_ms"] < 2500
    assert s.transactions == [] and s.received() == []


def test_starttls_optional_with_a_trusted_certificate(direct, tls_files):
    s = SmtpServer(host="127.0.0.1", tls=tls_files)
    s.start()
    try:
        res = direct.run({"server": f"localhost:{s.port}", "starttls": "optional",
                          "ca_file": tls_files[0]},
                         [eff(n, f"u{n}@example.com") for n in range(1, 9)])
    finally:
        s.stop()
    assert {r["outcome"] for r in res.values()} == {"accepted"}, res
    assert all(t["tls"] for t in s.transactions) and len(s.received()) == 8


def test_starttls_and_auth_deliver_and_never_log_the_password(conn, db, tmp_path, tls_files):
    s = SmtpServer(host="127.0.0.1", tls=tls_files, require_starttls=True,
                   auth={"outbox": PASSWORD})
    s.start()
    pw = tmp_path / "smtp_password"
    pw.write_text(PASSWORD + "\n")
    pw.chmod(0o600)
    d = Dispatcher(db, tmp_path, email_cfg(f"localhost:{s.port}", starttls="required",
                                           username="outbox", password=f"file:{pw}",
                                           ca_file=tls_files[0]))
    try:
        kill_switch(conn, True)
        d.start()
        eid = enqueue(conn, "email", "bob@example.com", payload())
        e = wait_state(conn, eid, "completed")
        assert e["provider_id"] == s.received()[0]["queue_id"]
        assert s.transactions[0]["auth"] and s.transactions[0]["tls"]
        assert s.auth_attempts[-1]["ok"] and s.auth_attempts[-1]["login"] == "outbox"
    finally:
        d.stop()
        s.stop()
    no_secret_in(d.log())
    assert "********" in d.log()


def test_auth_rejected_is_terminal_nothing_sent(direct, tls_files):
    s = SmtpServer(host="127.0.0.1", tls=tls_files, require_starttls=True,
                   auth={"outbox": "another password"})
    s.start()
    try:
        res = direct.run({"server": f"localhost:{s.port}", "starttls": "required",
                          "username": "outbox", "password": "env:SMTP_TEST_PASSWORD",
                          "ca_file": tls_files[0], "timeout_ms": 3000},
                         [eff(1, "bob@example.com")], env={"SMTP_TEST_PASSWORD": PASSWORD})
    finally:
        s.stop()
    r = res["e1"]
    assert (r["outcome"], r["status"]) == ("terminal", 535), r
    assert "AUTH" in r["error"] and "nothing sent" in r["error"]
    assert s.received() == [] and s.data_commands == 0
    no_secret_in(direct.stderr)
    no_secret_in(json.dumps(direct.lines))


def test_plain_auth_is_never_sent_without_tls(direct):
    """starttls = optional, a relay without STARTTLS that offers only
    PLAIN/LOGIN: the password does not cross the wire in clear, and the
    message is not handed over unauthenticated."""
    s = SmtpServer(auth={"outbox": PASSWORD})
    s.start()
    try:
        res = direct.run(direct_cfg(s, starttls="optional", username="outbox",
                                    password="env:SMTP_TEST_PASSWORD"),
                         [eff(1, "bob@example.com")], env={"SMTP_TEST_PASSWORD": PASSWORD})
    finally:
        s.stop()
    r = res["e1"]
    assert r["outcome"] == "terminal" and "AUTH" in r["error"], r
    assert s.auth_attempts == [] and s.received() == []


# -- bad input: refused before anything is sent -------------------------------------

INJECTIONS = [
    ("bob@example.com\r\nBcc: victim@example.com", {}, "target: contains CR or LF"),
    ("bob@example.com\nX: y", {}, "target: contains CR or LF"),
    ("bob@example.com", {"subject": "Hi\r\nBcc: victim@example.com"}, "payload.subject: contains CR or LF"),
    ("bob@example.com", {"subject": "Hi\nthere"}, "payload.subject: contains CR or LF"),
    ("bob@example.com", {"from": "a@example.com\r\nBcc: v@example.com"}, "payload.from: contains CR or LF"),
    ("bob@example.com", {"from": "Evil\r\n <a@example.com>"}, "payload.from: contains CR or LF"),
    ("bob@example.com", {"headers": {"X-Tag": "a\r\nBcc: v@example.com"}},
     "payload.headers.X-Tag: contains CR, LF or NUL"),
    ("bob@example.com", {"headers": {"X-Tag\r\nBcc": "v@example.com"}},
     "a header name contains CR or LF"),
    ("bob@example.com", {"headers": {"X-Tag: v\r\nBcc": "x"}}, "a header name contains CR or LF"),
    ("bob@example.com", {"headers": {"Bad Name": "x"}}, "is not a valid header name"),
    ("bob@example.com", {"headers": {"Bcc": "victim@example.com"}}, "payload.headers.Bcc: set by the email provider"),
    ("bob@example.com", {"headers": {"message-id": "<x@y>"}}, "payload.headers.message-id: set by the email provider"),
    ("bob@example.com", {"headers": {"Content-Type": "text/html"}}, "set by the email provider"),
    ("bob@example.com", {"headers": {"X-N": 5}}, "payload.headers.X-N: must be a string"),
    ("bob@example.com", {"headers": ["X-A"]}, "payload.headers: must be an object"),
    ("bob@example.com", {"cc": "victim@example.com"}, "payload.cc: unknown key"),
    ("bob@example.com", {"subject": 5}, "payload.subject: must be a string"),
    ("bob@example.com", {"text": None}, "payload.text: required"),
    ("bob@example.com", {"html": ["x"]}, "payload.html: must be a string"),
    ("bob@example.com", {"from": "not an address"}, "payload.from: the address"),
    ("bob@example.com", {"from": "Name <a@b@c>"}, "payload.from: the address"),
    ("bob@example.com", {"from": "Name <a@example.com"}, "payload.from: expected"),
    ("bob@example.com", {"subject": "bell \u0007"}, "payload.subject: contains control characters"),
    ("bob", {}, "target: the recipient address has no @"),
    ("bob@", {}, "target: the recipient address has an invalid domain"),
    ("bob@-example.com", {}, "target: the recipient address has an invalid domain"),
    (".bob@example.com", {}, "target: the recipient address has a local part"),
    ("b\u00f6b@example.com", {}, "SMTPUTF8 is not supported"),
    ("<bob@example.com>", {}, "target: one address per effect (a list / display name is not allowed)"),
    ("bob@example.com, eve@example.com", {},
     "target: one address per effect (a list / display name is not allowed)"),
    ("Bob <bob@example.com>", {}, "target: one address per effect (a list / display name is not allowed)"),
]


@pytest.mark.parametrize("target,change,words", INJECTIONS, ids=[w for _, _, w in INJECTIONS])
def test_invalid_effects_fail_without_a_session(conn, dispatchers, smtp, target, change, words):
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp))
    p = payload()
    p.update(change)
    p = {k: v for k, v in p.items() if not (k == "text" and v is None)}
    eid = enqueue(conn, "email", target, p)
    e = wait_state(conn, eid, "failed")
    assert words in e["last_error"], e
    assert e["attempts"] == 0 and attempts(conn, eid) == []
    assert smtp.connections == 0 and smtp.received() == []


def test_invalid_input_a_database_cannot_hold(direct, smtp):
    """NUL inside a JSON string and a non-UTF-8 target (a SQL_ASCII
    database could hand either over)."""
    res = direct.run(direct_cfg(smtp), [
        eff(1, "bob@example.com", payload=payload(subject="a\u0000Bcc: x")),
        eff(2, "bob@example.com", payload=payload(headers={"X-A": "v\u0000"})),
        eff(3, "", target_hex="626f62ff406578616d706c652e636f6d"),
        eff(4, "bob@example.com", payload=payload(text="nul\u0000in body")),
    ])
    assert "payload.subject: contains a NUL" in res["e1"]["error"]
    assert "payload.headers.X-A: contains CR, LF or NUL" in res["e2"]["error"]
    assert "target: not valid UTF-8" in res["e3"]["error"]
    assert "payload.text: contains a NUL" in res["e4"]["error"]
    assert all(r["stage"] == "validate" for r in res.values())
    assert smtp.connections == 0


def test_long_and_non_ascii_content_is_encoded(direct, smtp):
    long_subject = "S" * 1200
    body = "Z\u00fcrich\n" + "x" * 2000 + "\n.\n..leading dots\n"
    res = direct.run(direct_cfg(smtp), [
        eff(1, "bob@example.com", payload=payload(
            **{"from": "J\u00f6rg \"the\" M\u00fcller <j@example.com>", "subject": long_subject,
               "text": body, "headers": {"X-Note": "caf\u00e9", "X-Enc": "=?UTF-8?B?eA==?="}})),
        eff(2, "bob@example.com", payload=payload(**{"from": "Plain \"Q\" Name <q@example.com>",
                                                     "text": ".\n..two\n.three\nend"})),
    ])
    assert res["e1"]["outcome"] == "accepted", res
    assert res["e2"]["outcome"] == "accepted", res
    m1 = smtp.by_rcpt("bob@example.com")
    msgs = {m["message_id"]: m["msg"] for m in m1}
    a = msgs[msgid(f"{1:064x}")]
    assert a["Subject"] == long_subject
    assert a["From"].addresses[0].display_name == "J\u00f6rg \"the\" M\u00fcller"
    assert a["X-Note"] == "caf\u00e9" and a["X-Enc"] == "=?UTF-8?B?eA==?="
    assert a.get_content().replace("\r\n", "\n") == body
    raw = [m["data"] for m in m1 if m["message_id"] == msgid(f"{1:064x}")][0]
    assert all(len(line) <= 998 for line in raw.split(b"\r\n"))
    b = msgs[msgid(f"{2:064x}")]
    assert b["From"].addresses[0].display_name == "Plain \"Q\" Name" and b["From"].addresses[0].addr_spec == "q@example.com"
    assert b["Content-Transfer-Encoding"] == "7bit"
    assert b.get_content().replace("\r\n", "\n") == ".\n..two\n.three\nend\n"


# -- config -------------------------------------------------------------------------

@pytest.mark.parametrize("section,words", [
    ({"starttls": "sometimes"}, "starttls: must be required, optional or off"),
    ({"server": "relay.example.com"}, "[provider.email] server: "),
    ({"server": "relay.example.com:0"}, "port must be 1..65535"),
    ({"server": "[::1]:25"}, "IPv6 literals are not supported"),
    ({"username": "outbox"}, "username is set but the password is empty"),
    ({"password": "x"}, "a password without a username"),
    ({"username": "outbox", "password": "env:SMTP_PASSWORD_NOT_SET_ANYWHERE"},
     "SMTP_PASSWORD_NOT_SET_ANYWHERE is not set"),
    ({"threads": "0"}, "threads"),
    ({"threads": "many"}, "threads"),
    ({"message_id_domain": "bad domain"}, "message_id_domain: not a valid domain name"),
    ({"helo_name": "my host"}, "helo_name: not a valid host name"),
    ({"ca_file": "/nonexistent/ca.pem"}, "ca_file: cannot load CA certificates"),
    ({"no_such_key": "1"}, "no_such_key"),
])
def test_bad_config_refuses_to_start(db, tmp_path, section, words):
    cfg = email_cfg("127.0.0.1:25")
    cfg["provider.email"].update(section)
    d = Dispatcher(db, tmp_path, cfg)
    d.start(wait_ready=False)
    try:
        rc = d.wait(timeout=30)
    finally:
        d.stop()
    assert rc != 0
    log = d.log()
    assert words in log, log
    assert ".ini:" in log, "the error names the file and line"


def test_config_defaults_and_secret_never_logged(direct, smtp, tmp_path):
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD + "\n")
    res = direct.run({"server": f"127.0.0.1:{smtp.port}", "starttls": "off", "username": "outbox",
                      "password": f"file:{pw}"}, [])
    assert direct.rc == 0 and res == {}
    no_secret_in(direct.stderr)
    assert "8 threads" in direct.stderr and "timeout 10000 ms" in direct.stderr
    assert "auth on (password: ********)" in direct.stderr


# -- the pool, shutdown -----------------------------------------------------------------

def test_saturated_pool_reports_not_sent(direct, smtp):
    """One thread, held by a relay that never answers the end of data: the
    queued second message is not started within queue_timeout_ms."""
    res = direct.run(direct_cfg(smtp, threads=1, timeout_ms=2500, queue_timeout_ms=1000),
                     [eff(1, "a+silent-after-data@example.com"), eff(2, "b@example.com")])
    assert res["e1"]["outcome"] == "ambiguous"
    assert res["e2"]["outcome"] == "not_sent" and "SMTP threads busy" in res["e2"]["error"]
    assert "queue_timeout_ms" in res["e2"]["error"] and res["e2"]["elapsed_ms"] < 2000
    assert smtp.by_rcpt("b@example.com") == []


def test_shutdown_with_sessions_in_flight(direct, smtp):
    """The provider is shut down while one session waits for its end-of-data
    reply and another is still queued: no callback afterwards, no crash, no
    leak (the suite runs under ASan), and it returns without waiting for
    the relay: the session's budget is an hour, so the run returning within
    run()'s timeout is the proof, however loaded the machine."""
    res = direct.run(direct_cfg(smtp, threads=1, timeout_ms=3600000),
                     [eff(1, "a+silent-after-data@example.com"), eff(2, "b@example.com")],
                     exit_after_ms=500, timeout=120)
    assert res["shutdown"]["abandoned"] == 2
    assert "e1" not in res and "e2" not in res, res
    assert smtp.by_rcpt("b@example.com") == []


def test_worker_stops_with_a_session_hanging(conn, dispatchers, smtp):
    kill_switch(conn, True)
    w = dispatchers(email_cfg(smtp, timeout_ms=30000))
    eid = enqueue(conn, "email", "bob+silent-after-data@example.com", payload())
    wait_for(lambda: smtp.received(), what="the message to reach the relay")
    t0 = time.monotonic()
    assert w.stop(timeout=60) == 0
    assert time.monotonic() - t0 < 45
    assert effect(conn, eid)["state"] in ("sending", "unknown")


# -- queue wait, the margin before the terminator, session reuse ------

def test_queue_wait_does_not_eat_the_smtp_budget(direct, smtp):
    """One thread, two messages that each take 2 s to be answered, timeout
    3 s: the second waits 2 s in the queue and still gets its whole budget
    (timeout_ms counts from the moment a thread takes it)."""
    res = direct.run(direct_cfg(smtp, threads=1, timeout_ms=3000, queue_timeout_ms=10000),
                     [eff(1, "a+slow-data-2000@example.com"), eff(2, "b+slow-data-2000@example.com")])
    assert {k: v["outcome"] for k, v in res.items()} == {"e1": "accepted", "e2": "accepted"}, res
    assert res["e2"]["elapsed_ms"] >= 3500, "it did wait in the queue"


def test_no_terminator_without_the_margin(direct):
    """A greeting that leaves less than the margin (max(1 s, timeout/5)) of
    timeout_ms before the end of data: the message is aborted before its
    terminator (not_sent), and the relay has nothing."""
    s = SmtpServer(greeting_delay_ms=2300)
    s.start()
    try:
        res = direct.run(direct_cfg(s, timeout_ms=3000), [eff(1, "bob@example.com")])
    finally:
        s.stop()
    r = res["e1"]
    assert r["outcome"] == "not_sent", r
    assert "before the end-of-data terminator" in r["error"] and "margin" in r["error"], r
    assert s.received() == [] and s.data_commands == 1


def test_slow_greetings_end_no_effect_unknown(conn, dispatchers):
    """Every third session's greeting takes 2.5 s (timeout 4 s, one session
    per message so that many greetings happen, more sends than threads):
    every effect is delivered exactly once and none ends unknown."""
    s = SmtpServer(slow_greeting=(3, 2500))
    s.start()
    try:
        kill_switch(conn, True)
        dispatchers(email_cfg(s, timeout_ms=4000, threads=2, max_in_flight=6, session_idle_ms=0,
                              max_attempts=5))
        ids = [enqueue(conn, "email", f"u{n}@example.com", payload()) for n in range(12)]
        for eid in ids:
            wait_state(conn, eid, "completed", "failed", "unknown", timeout=90)
        states = {str(eid): effect(conn, eid)["state"] for eid in ids}
        assert set(states.values()) == {"completed"}, states
        for eid in ids:
            assert s.count(msgid(key_of(conn, eid))) == 1
            assert "ambiguous" not in [c for c, _ in classes(conn, eid)]
        assert s.connections >= 12 and any(n % 3 == 0 for n in s.sessions)
    finally:
        s.stop()


def test_sessions_are_reused(direct, smtp):
    """20 messages, 2 threads: a few SMTP sessions carry them all, each
    message its own transaction with its own queue id."""
    res = direct.run(direct_cfg(smtp, threads=2, session_idle_ms=2000),
                     [eff(n, f"u{n}@example.com") for n in range(1, 21)])
    assert {v["outcome"] for v in res.values()} == {"accepted"}, res
    assert smtp.connections <= 4, smtp.sessions
    assert sum(smtp.sessions.values()) == 20 and max(smtp.sessions.values()) >= 5
    qids = {m["rcpt_tos"][0]: m["queue_id"] for m in smtp.received()}
    assert all(res[f"e{n}"]["provider_id"] == qids[f"u{n}@example.com"] for n in range(1, 21))


def test_idle_session_waits_for_the_next_message(conn, dispatchers, smtp):
    """session_idle_ms holds an idle session open: two emails 0.5 s apart
    (well inside the 5 s idle time) go over ONE SMTP session."""
    kill_switch(conn, True)
    dispatchers(email_cfg(smtp, threads=1, session_idle_ms=5000))
    first = enqueue(conn, "email", "a@example.com", payload())
    wait_state(conn, first, "completed")
    time.sleep(0.5)   # the scenario itself: the next email comes 0.5 s later
    second = enqueue(conn, "email", "b@example.com", payload())
    wait_state(conn, second, "completed")
    assert smtp.connections == 1, smtp.sessions
    assert smtp.sessions == {1: 2}


def test_session_max_messages_and_idle_zero(direct, smtp):
    res = direct.run(direct_cfg(smtp, threads=1, session_max_messages=3),
                     [eff(n, f"u{n}@example.com") for n in range(1, 8)])
    assert {v["outcome"] for v in res.values()} == {"accepted"}
    assert sorted(smtp.sessions.values()) == [1, 3, 3]


def test_relay_closing_after_message_k_of_a_session(direct):
    """The relay ends every session right after answering its 3rd message:
    the next message notices the closed connection before any byte of it
    was taken and goes over a fresh one; every message is accepted once."""
    s = SmtpServer(close_after=3)
    s.start()
    try:
        res = direct.run(direct_cfg(s, threads=1), [eff(n, f"u{n}@example.com") for n in range(1, 11)])
    finally:
        s.stop()
    assert {v["outcome"] for v in res.values()} == {"accepted"}, res
    assert sorted(s.sessions.values()) == [1, 3, 3, 3], s.sessions
    assert all(s.count(msgid(f"{n:064x}")) == 1 for n in range(1, 11))


def test_lost_connection_after_message_k_makes_only_k_unknown(direct, smtp):
    """One thread, one session: message 3's terminator is answered by a
    closed connection.  Only 3 is ambiguous; 1 and 2 have their 250, and
    4 and 5 (not yet handed to libesmtp) go over a new session."""
    res = direct.run(direct_cfg(smtp, threads=1), [
        eff(1, "a@example.com"), eff(2, "b@example.com"), eff(3, "c+drop-after-data@example.com"),
        eff(4, "d@example.com"), eff(5, "e@example.com")])
    got = {k: v["outcome"] for k, v in res.items()}
    assert got == {"e1": "accepted", "e2": "accepted", "e3": "ambiguous", "e4": "accepted",
                   "e5": "accepted"}, res
    assert all(smtp.count(msgid(f"{n:064x}")) == 1 for n in range(1, 6))
    assert smtp.connections == 2


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelining", "no-pipelining"])
def test_commit_point_per_message_on_a_reused_session(direct, pipelining):
    """One session carries 1, 2, 3; the connection is lost after message
    3's terminator: only 3 is ambiguous, 4 and 5 (never handed over) go
    over a new session.  With PIPELINING too: RCPT TO and DATA share a
    write, the terminator is still the commit point."""
    s = SmtpServer(pipelining=pipelining)
    s.start()
    try:
        res = direct.run(direct_cfg(s, threads=1), [
            eff(1, "a@example.com"), eff(2, "b@example.com"),
            eff(3, "c+drop-after-data@example.com"), eff(4, "d@example.com"),
            eff(5, "e@example.com")])
    finally:
        s.stop()
    got = {k: v["outcome"] for k, v in res.items()}
    assert got == {"e1": "accepted", "e2": "accepted", "e3": "ambiguous", "e4": "accepted",
                   "e5": "accepted"}, res
    assert [t["conn"] for t in s.transactions] == [1, 1, 1, 2, 2]
    assert all(s.count(msgid(f"{n:064x}")) == 1 for n in range(1, 6))
    assert (s.pipelined > 0) == pipelining


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelining", "no-pipelining"])
def test_connection_lost_after_the_next_envelope_is_not_ambiguous(direct, pipelining):
    """Message 2 joins the session after 1's 250; the relay drops the
    connection on its RCPT TO (with PIPELINING: RCPT TO and DATA written
    together).  None of 2's content was sent: it is `retry`, never
    `ambiguous`, and the relay holds no copy; 1 keeps its 250 and 3 goes
    over a new session."""
    s = SmtpServer(pipelining=pipelining)
    s.start()
    try:
        res = direct.run(direct_cfg(s, threads=1), [
            eff(1, "a@example.com"), eff(2, "b+drop-rcpt@example.com"), eff(3, "c@example.com")])
    finally:
        s.stop()
    got = {k: (v["outcome"], v["status"]) for k, v in res.items()}
    assert got == {"e1": ("accepted", 250), "e2": ("retry", 0), "e3": ("accepted", 250)}, res
    assert s.count(msgid(f"{2:064x}")) == 0 and s.data_commands == 2
    assert [t["conn"] for t in s.transactions] == [1, 1, 2]


def test_refused_transaction_then_next_message_in_the_same_session(direct, smtp):
    """A 550 RCPT, a 554 after the data and a 553 MAIL FROM in the middle of
    reused sessions: each message gets its own answer.  After the 554 and
    the 553 the session goes on (RSET after the refused end of data); a
    refused DATA command (here: no valid recipient) makes libesmtp decide
    to QUIT before it reports the transaction, so the next message goes
    over a new connection."""
    res = direct.run(direct_cfg(smtp, threads=1), [
        eff(1, "a@example.com"), eff(2, "b+reject-rcpt@example.com"),
        eff(3, "c+reject-data@example.com"),
        eff(4, "d@example.com", payload=payload(**{"from": "x+reject-mail@example.com"})),
        eff(5, "e@example.com")])
    got = {k: (v["outcome"], v["status"]) for k, v in res.items()}
    assert got == {"e1": ("accepted", 250), "e2": ("terminal", 550), "e3": ("terminal", 554),
                   "e4": ("terminal", 553), "e5": ("accepted", 250)}, res
    assert [t["conn"] for t in smtp.transactions] == [1, 1, 2, 2, 2]


@pytest.mark.parametrize("offered", [True, False], ids=["offered", "not-offered"])
def test_pipelining_when_offered(direct, offered):
    s = SmtpServer(pipelining=offered)
    s.start()
    try:
        res = direct.run(direct_cfg(s, threads=1), [eff(n, f"u{n}@example.com") for n in range(1, 6)])
    finally:
        s.stop()
    assert {v["outcome"] for v in res.values()} == {"accepted"}
    if offered:
        assert s.pipelined >= 3, "RCPT TO arrived with DATA behind it"
    else:
        assert s.pipelined == 0


@pytest.mark.parametrize("fmt", ["postfix", "exim", "opensmtpd", "sendmail", "microsoft", "ses",
                                 "gmail", "plain"])
def test_provider_id_from_the_relays_reply(direct, smtp, fmt):
    res = direct.run(direct_cfg(smtp), [eff(1, f"bob+fmt-{fmt}@example.com")])
    [m] = smtp.received()
    r = res["e1"]
    assert r["outcome"] == "accepted", r
    if fmt == "plain":   # no known format: the whole text
        assert r["provider_id"] == f"{m['queue_id']} accepted", (r, m["replied"])
    else:
        assert r["provider_id"] == m["queue_id"], (r, m["replied"])
