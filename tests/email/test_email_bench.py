# SPDX-License-Identifier: ISC
"""`make bench-email`'s parts, small: bench/delay_proxy.py (the round trips
it adds, the bytes it carries unchanged) and a short run of
bench/email_run.sh at RTT 0 and 10 ms against the test server.

The proxy's delays are asserted from below only (a loaded machine makes
things slower, never faster): the greeting comes no sooner than 2 RTT
after the connect, each command's reply no sooner than 1 RTT after it.
"""
import os
import smtplib
import subprocess
import sys
import time

import pytest

from outbox_test import BUILD_DIR, ROOT

from smtp_server import SmtpServer

RTT_MS = 60


@pytest.fixture
def relay():
    s = SmtpServer(pipelining=True)
    s.start()
    yield s
    s.stop()


@pytest.fixture
def proxy(relay):
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "delay_proxy.py"),
                          "--target", f"127.0.0.1:{relay.port}", "--rtt-ms", str(RTT_MS)],
                         stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    yield port
    p.terminate()
    p.wait(10)


def test_delay_proxy_adds_the_round_trips_and_keeps_the_bytes(relay, proxy):
    rtt = RTT_MS / 1000.0
    t0 = time.monotonic()
    c = smtplib.SMTP("127.0.0.1", proxy, local_hostname="bench.invalid", timeout=10)
    t_greeting = time.monotonic() - t0
    t0 = time.monotonic()
    code, _ = c.noop()
    t_noop = time.monotonic() - t0
    body = "Subject: through the proxy\r\n\r\n" + "".join(f"line {i} {'x' * 70}\r\n"
                                                           for i in range(2000))
    t0 = time.monotonic()
    c.sendmail("a@example.com", ["b@example.com"], body)
    t_send = time.monotonic() - t0
    c.quit()
    assert code == 250
    assert t_greeting >= 2 * rtt * 0.95, t_greeting       # connect + greeting: 4 one-way
    assert t_noop >= rtt * 0.95, t_noop
    # MAIL, RCPT, DATA, the message (smtplib waits for every reply)
    assert t_send >= 4 * rtt * 0.95, t_send
    [m] = relay.received()
    assert m["data"].replace(b"\r\n", b"\n") == body.encode().replace(b"\r\n", b"\n")


def test_delay_proxy_closes_the_client_when_the_target_refuses():
    import socket
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))          # bound, not listening: connects are refused
    port = hold.getsockname()[1]
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "delay_proxy.py"),
                          "--target", f"127.0.0.1:{port}", "--rtt-ms", "10"],
                         stdout=subprocess.PIPE, text=True)
    try:
        pport = int(p.stdout.readline())
        s = socket.create_connection(("127.0.0.1", pport), timeout=10)
        assert s.recv(100) == b""        # closed, not left hanging
        s.close()
    finally:
        p.terminate()
        p.wait(10)
        hold.close()


@pytest.mark.exclusive
def test_bench_email_small_run_at_two_round_trip_times(tmp_path):
    """The bench end to end, small: its own PostgreSQL, both sides at RTT 0
    and 10 ms against the test server, the slow-greeting run at RTT 10 ms;
    each ratio line with PostgreSQL's CPU per email, and no false unknown."""
    env = dict(os.environ, BUILD_DIR=os.path.relpath(BUILD_DIR, ROOT), BENCH_EMAIL_N="60",
               BENCH_EMAIL_ROUNDS="1", BENCH_EMAIL_RELAYS="python", BENCH_EMAIL_RTTS="0,10",
               BENCH_EMAIL_SLOW_N="40", BENCH_EMAIL_NO_REUSE_RUN="0")
    env.pop("PGPORT_FIXED", None)
    r = subprocess.run(["sh", os.path.join(ROOT, "bench", "email_run.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for rtt in ("0", "10"):
        line = next((x for x in out.splitlines()
                     if x.startswith(f"email ratio (python server, RTT {rtt} ms): ")), None)
        assert line and "PostgreSQL CPU" in line and "ms per email" in line, out[-4000:]
        assert float(line.split(": ")[1].split()[0]) > 0, line
    assert "false unknowns: 0" in out, out[-4000:]
    assert "RTT 10 ms): 40 emails, completed 40, unknown 0" in out, out[-4000:]
