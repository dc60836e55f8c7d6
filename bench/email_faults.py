# SPDX-License-Identifier: ISC
"""bench/email_faults.py: the commit-point fault table against a private
Postfix (tests/servers/postfix_relay.py), CHUNKING on and off.

    python3 bench/email_faults.py PROVIDER_SEND [N]   (root; after make)

FAULTS_ONLY="stall,killed" runs only the faults whose names contain one of
those words.
PROVIDER_SEND is tests/tools/provider_send.c built as tests/email builds
it.  For each fault of tests/servers/smtp_fault_proxy.py (every 20th
message faulted) and for every smtpd SIGKILLed twice mid-stream: N emails
(500) over 4 threads; prints per fault and way the crashes (exit by a
signal), copies delivered twice, lost (accepted but not delivered),
delivered although recorded retry/not_sent, and unknowns (ambiguous) with
how many of them Postfix holds.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "servers")]
import postfix_relay  # noqa: E402
from smtp_fault_proxy import SmtpFaultProxy  # noqa: E402

TOOL = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 500
ONLY = [w for w in os.environ.get("FAULTS_ONLY", "").split(",") if w]   # e.g. "stall,killed"
PLUGIN = os.path.join(ROOT, os.environ.get("BUILD_DIR", "build"), "providers", "outbox_email.so")
FAULTS = [("stall after content", "after-content", 5.0), ("cut 0.3 s after content", "after-content", 0.3),
          ("cut before content", "cut-before", 0), ("final reply lost", "lost-final", 0),
          ("smtpd killed twice", "kill", 0)]


def run(relay, port, tag, faulted, kill=False):
    d = tempfile.mkdtemp()
    ini = os.path.join(d, "c.ini")
    with open(ini, "w") as f:
        f.write(f"[provider.email]\nserver = 127.0.0.1:{port}\nstarttls = off\nthreads = 4\n"
                "timeout_ms = 3000\nmax_in_flight = 64\n"
                # the stalls hold threads: queued sends must not time out
                "queue_timeout_ms = 300000\n")
    effs = [{"effect_id": f"e{i}", "effect_key": f"{tag:08x}{i:056x}",
             "target": f"u{i}{'+fault' if i in faulted else ''}@example.com",
             "payload": {"from": "Outbox <noreply@example.com>", "subject": "s", "text": "hello\n"}}
            for i in range(1, N + 1)]
    ej = os.path.join(d, "e.json")
    with open(ej, "w") as f:
        json.dump(effs, f)
    killed = []

    def killer():
        for k in range(2):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(relay.deliveries()) < (k + 1) * N // 3:
                time.sleep(0.02)
            killed.append(relay.kill_smtpd())
    t = threading.Thread(target=killer) if kill else None
    if t:
        t.start()
    r = subprocess.run([TOOL, PLUGIN, ini, "email", ej], capture_output=True, text=True, timeout=900)
    if t:
        t.join()
    res = {}
    for x in r.stdout.splitlines():
        x = json.loads(x)
        if "effect_id" in x:
            res[x["effect_id"]] = x
    relay.settle(60)
    got = relay.deliveries()
    row = {"crash": int(r.returncode < 0), "answered": len(res), "twice": 0, "lost": 0,
           "sent_but_retry": 0, "unknown": 0, "unknown_held": 0, "retry": 0}
    for e in effs:
        c = got.get(f"<{e['effect_key']}@outbox-dispatcher.invalid>", 0)
        o = res.get(e["effect_id"], {}).get("outcome", "none")
        row["twice"] += c > 1
        row["lost"] += o == "accepted" and c == 0
        row["sent_but_retry"] += o in ("retry", "not_sent") and c > 0
        row["unknown"] += o == "ambiguous"
        row["unknown_held"] += o == "ambiguous" and c > 0
        row["retry"] += o in ("retry", "not_sent")
    row["killed"] = sum(killed)
    return row


def main():
    tag = int(time.time()) & 0xffffff
    for chunking in (True, False):
        relay = postfix_relay.PostfixRelay(chunking=chunking)
        relay.start()
        try:
            for name, mode, delay in FAULTS:
                if ONLY and not any(w in name for w in ONLY):
                    continue
                tag += 1
                faulted = set(range(20, N + 1, 20))
                if mode == "kill":
                    row = run(relay, relay.port, tag, set(), kill=True)
                else:
                    p = SmtpFaultProxy(relay.port, mode, delay_s=delay)
                    p.start()
                    try:
                        row = run(relay, p.port, tag, faulted)
                    finally:
                        p.stop()
                print(f"chunking {'on ' if chunking else 'off'} | {name:24} | " +
                      " ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        finally:
            relay.stop()


main()
