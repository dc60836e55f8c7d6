#!/usr/bin/env python3
# SPDX-License-Identifier: ISC
"""examples/n8n/local-sink.py: a stand-in for the three outside services the
kit talks to, for a first try on one machine and for check-with-n8n.sh.
Loopback only, Python 3 standard library only.

  POST /v1/chat/completions   plays an OpenAI-compatible model: answers a
                              valid draft; a message containing REPAIR-ME
                              gets prose the first time (the workflow then
                              repairs once), ALWAYS-INVALID always gets prose;
                              HTML-ONCE gets, the first time, a 200 HTML page
                              (as a proxy in front of a model may answer);
                              SLOW-ONCE is answered only after 90 s the first
                              time (an execution to interrupt)
  POST /notify                plays the approver's chat webhook: prints the
                              message (with the approval link) and keeps it
  POST /deliver               plays the helpdesk API effects are delivered
                              to: prints the body and its Idempotency-Key,
                              answers {"id": "sink-N"} (the provider id)

  python3 examples/n8n/local-sink.py [--port 8099] [--record DIR]

With --record, every request is also appended as one JSON line to
DIR/llm.jsonl, DIR/notify.jsonl or DIR/deliver.jsonl (what the check reads).
Not for production: it accepts anything from anyone who can reach the port.
"""
import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GOOD = json.dumps({"intent": "reply", "subject": "Your quote request",
                   "reply": "Thanks for reaching out. A quote follows today."})
PROSE = "Sure! I would reply that we are happy to help."


class Sink:
    def __init__(self, record_dir):
        self.record_dir = record_dir
        self.lock = threading.Lock()
        self.seen = {}

    def count(self, key):
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + 1
            return self.seen[key]

    def record(self, name, obj):
        if not self.record_dir:
            return
        with self.lock, open(os.path.join(self.record_dir, name + ".jsonl"), "a") as f:
            f.write(json.dumps(obj) + "\n")


def handler(sink):
    class H(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            sys.stderr.write("local-sink: " + (fmt % args) + "\n")

        def say(self, text):
            print(text, flush=True)

        def reply(self, code, obj):
            self.reply_raw(code, "application/json", json.dumps(obj))

        def reply_raw(self, code, content_type, text):
            b = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            try:
                self.wfile.write(b)
            except OSError:
                pass                    # the caller is gone (n8n was stopped)

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n).decode("utf-8", "replace")
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
            if self.path.startswith("/v1/chat/completions"):
                msgs = body.get("messages", []) if isinstance(body, dict) else []
                user = msgs[1].get("content", "") if len(msgs) > 1 else ""
                k = sink.count(user)
                if "HTML-ONCE" in user and k == 1:
                    sink.record("llm", {"user": user, "n": k, "answer": "html"})
                    self.say(f"model: asked about {user[:60]!r}, answered a 200 HTML page")
                    return self.reply_raw(200, "text/html; charset=utf-8",
                                          "<html><body><h1>502 Bad Gateway</h1></body></html>")
                if "SLOW-ONCE" in user and k == 1:
                    sink.record("llm", {"user": user, "n": k, "answer": "slow"})
                    self.say(f"model: asked about {user[:60]!r}, answering in 90 s")
                    time.sleep(90)
                bad = "ALWAYS-INVALID" in user or ("REPAIR-ME" in user and k == 1)
                content = PROSE if bad else GOOD
                sink.record("llm", {"user": user, "n": k, "answer": content,
                                    "model": body.get("model") if isinstance(body, dict) else None})
                self.say(f"model: asked about {user[:60]!r}, answered {'prose' if bad else 'a valid draft'}")
                return self.reply(200, {"id": "cmpl-1", "model": "fake-llm-1",
                                        "choices": [{"index": 0, "message": {"role": "assistant",
                                                                             "content": content}}]})
            if self.path.startswith("/notify"):
                sink.record("notify", body)
                text = body.get("text", body) if isinstance(body, dict) else body
                self.say(f"approver chat: {text}")
                return self.reply(200, {"ok": True})
            if self.path.startswith("/deliver"):
                k = sink.count("deliver")
                headers = {h.lower(): v for h, v in self.headers.items()}
                sink.record("deliver", {"headers": headers, "body": body})
                self.say(f"delivered (Idempotency-Key {headers.get('idempotency-key')}): "
                         f"{json.dumps(body)} -> provider id sink-{k}")
                return self.reply(200, {"id": f"sink-{k}"})
            self.reply(404, {"error": "no such path"})
    return H


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--record", metavar="DIR", help="append every request to DIR/*.jsonl")
    a = ap.parse_args()
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), handler(Sink(a.record)))
    print(f"local-sink: http://127.0.0.1:{a.port} (model /v1/chat/completions, "
          f"approver chat /notify, delivery /deliver)", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
