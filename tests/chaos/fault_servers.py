#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""Fault-rate servers for the chaos run (tests/chaos/chaos.py): an HTTP
webhook sink, a Salesforce-style CRM (upsert and lookup by external id)
and an SMTP relay, in one process, each injecting faults at configured
rates.

The fault for a request is a pure function of (seed, kind, key, n), where
key identifies the effect (HTTP: the Idempotency-Key header; CRM: the
external id; SMTP: the recipient, unique per effect in the chaos run) and n
counts that key's requests so far: a retried effect draws a fresh fault,
and a run with the same seed draws the same faults.

Every request is appended to DIR/receipts.jsonl at once (one JSON object
a line, flushed), so the counts survive anything that happens to the
dispatchers.  Fields:

  kind       http | http_lookup | crm | crm_get | smtp
  key        see above;   n   that key's request number (1, 2, ...)
  fault      what the server does (FAULTS below)
  processed  the server acted on the request (the webhook ran, the record
             was stored, the message was taken at the end of data),
             whether or not the client learns so: the duplicate check
             counts these
  reply_id   the id the client is told (2xx / 250) if it gets an answer
  t          arrival (time.time(), the same clock as the harness)

http_lookup is GET /lookup?key=K, the http provider's reconciliation
(reconcile_url): 200 {"id": reply id} when a request of K was processed,
404 when none was, with faults of its own (a 500, a hang past the
lookup's timeout) that must leave the effect unknown.

SMTP writes one line at RCPT (fault decided, processed false) and, if the
client reaches the end of data, a second line with stage "data".

Usage: fault_servers.py --dir DIR --seed N --token T [--hang-ms MS]
prints one JSON line {"http": port, "crm": port, "smtp": port} when ready.
"""
import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from aiosmtpd.smtp import SMTP

# Fault rates per kind (share of requests), the rest is "ok".  Chosen so a
# 50,000-effect run has every fault many times while most effects finish.
FAULTS = {
    "http": [("status503", 0.04), ("status429", 0.01), ("slow", 0.06), ("hang", 0.006),
             ("drop", 0.006), ("status500", 0.003), ("drop_before_read", 0.004)],
    "http_lookup": [("status500", 0.05), ("hang", 0.03)],
    "crm": [("status503", 0.04), ("status429", 0.01), ("slow", 0.05), ("hang", 0.01),
            ("close", 0.01), ("close_nostore", 0.01), ("status500", 0.01)],
    "smtp": [("tempfail_rcpt", 0.04), ("drop_rcpt", 0.01), ("tempfail_data", 0.02),
             ("slow_data", 0.05), ("silent_after_data", 0.006), ("drop_after_data", 0.006)],
}
PROCESSED = {
    # http: the request was read in full and the webhook "ran".
    "http": {"ok", "slow", "hang", "drop", "status500"},
    # crm: the record was stored (upsert applied).
    "crm": {"ok", "slow", "hang", "close", "status500"},
}


class Recorder:
    def __init__(self, path, seed):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()
        self.counts = {}
        self.seed = seed
        self.seq = 0

    def draw(self, kind, key):
        """The request number for key and its fault."""
        with self.lock:
            n = self.counts.get((kind, key), 0) + 1
            self.counts[(kind, key)] = n
            self.seq += 1
            seq = self.seq
        h = hashlib.sha256(f"{self.seed}|{kind}|{key}|{n}".encode()).digest()
        u = int.from_bytes(h[:8], "big") / 2.0 ** 64
        fault = "ok"
        acc = 0.0
        for name, rate in FAULTS.get(kind, []):
            acc += rate
            if u < acc:
                fault = name
                break
        return n, fault, seq, int.from_bytes(h[8:12], "big")

    def write(self, rec):
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self.lock:
            self.f.write(line)
            self.f.flush()


class Threading(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


def reply(h, code, obj=None, headers=None):
    data = b"" if obj is None else json.dumps(obj).encode()
    try:
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)
    except OSError:
        pass


def drop(h):
    h.close_connection = True
    try:
        h.connection.shutdown(2)
    except OSError:
        pass


# -- HTTP webhook sink -----------------------------------------------------------

def http_server(rec, hang_s, stopping):
    taken = {}  # key -> reply id of its first processed request
    taken_lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            t = time.time()
            m = re.match(r"^/lookup\?key=([0-9a-f]+)$", self.path)
            if not m:
                return reply(self, 404, {"error": "no such path"})
            key = m.group(1)
            n, fault, _, _ = rec.draw("http_lookup", key)
            with taken_lock:
                rid = taken.get(key)
            rec.write({"kind": "http_lookup", "key": key, "n": n, "fault": fault,
                       "processed": False, "found": rid, "t": t})
            if fault == "status500":
                return reply(self, 500, {"error": "lookup broke"})
            if fault == "hang":
                stopping.wait(hang_s)
                return drop(self)
            if rid:
                return reply(self, 200, {"data": {"id": rid, "external_id": key}})
            return reply(self, 404, {"error": "not found"})

        def do_POST(self):
            t = time.time()
            key = self.headers.get("Idempotency-Key") or "-"
            n, fault, seq, rnd = rec.draw("http", key)
            if fault == "drop_before_read":
                # Close before reading the request: the client may or may
                # not have written it; nothing was processed.
                rec.write({"kind": "http", "key": key, "n": n, "fault": fault,
                           "processed": False, "t": t})
                return drop(self)
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            rid = f"h-{seq}"
            rec.write({"kind": "http", "key": key, "n": n, "fault": fault,
                       "processed": fault in PROCESSED["http"], "reply_id": rid, "t": t})
            if fault in PROCESSED["http"]:
                with taken_lock:
                    taken.setdefault(key, rid)
            if fault == "status503":
                return reply(self, 503, {"error": "busy"}, {"Retry-After": str(rnd % 2)})
            if fault == "status429":
                return reply(self, 429, {"error": "slow down"}, {"Retry-After": "1"})
            if fault == "status500":
                return reply(self, 500, {"error": "oops"})
            if fault == "hang":
                stopping.wait(hang_s)
                return drop(self)
            if fault == "drop":
                return drop(self)
            if fault == "slow":
                if stopping.wait((50 + rnd % 1200) / 1000.0):
                    return drop(self)
            return reply(self, 200, {"id": rid})

        do_PUT = do_PATCH = do_POST

    return Threading(("127.0.0.1", 0), H)


# -- CRM: upsert and lookup by external id ---------------------------------------

CRM_RE = re.compile(r"^/services/data/v\d+\.\d+/sobjects/([A-Za-z]\w*)/([A-Za-z]\w*)/([^/?]+)")


def crm_server(rec, token, hang_s, stopping):
    records = {}
    lock = threading.Lock()
    ids = [0]

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _auth(self):
            if self.headers.get("Authorization") != "Bearer " + token:
                reply(self, 401, [{"errorCode": "INVALID_SESSION_ID", "message": "no"}])
                return False
            return True

        def do_GET(self):
            t = time.time()
            m = CRM_RE.match(self.path)
            if not self._auth() or not m:
                return reply(self, 404, [{"errorCode": "NOT_FOUND", "message": "no"}]) if m is None else None
            key = m.group(3)
            n, _, _, _ = rec.draw("crm_get", key)
            with lock:
                r = records.get(key)
            rec.write({"kind": "crm_get", "key": key, "n": n, "fault": "ok", "processed": False,
                       "found": r is not None, "t": t})
            if r is None:
                return reply(self, 404, [{"errorCode": "NOT_FOUND", "message": "not found"}])
            return reply(self, 200, {"attributes": {"type": m.group(1)}, "Id": r})

        def do_PATCH(self):
            t = time.time()
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            m = CRM_RE.match(self.path)
            if not self._auth():
                return
            if m is None:
                return reply(self, 404, [{"errorCode": "NOT_FOUND", "message": "no"}])
            key = m.group(3)
            try:
                json.loads(body or b"null")
            except ValueError:
                return reply(self, 400, [{"errorCode": "JSON_PARSER_ERROR", "message": "bad"}])
            n, fault, seq, rnd = rec.draw("crm", key)
            stored = fault in PROCESSED["crm"]
            created = False
            rid = None
            if stored:
                with lock:
                    rid = records.get(key)
                    if rid is None:
                        ids[0] += 1
                        rid = f"00T{ids[0]:015d}"
                        records[key] = rid
                        created = True
            rec.write({"kind": "crm", "key": key, "n": n, "fault": fault, "processed": stored,
                       "created": created, "reply_id": rid, "t": t})
            if fault == "status503":
                return reply(self, 503, [{"errorCode": "SERVER_UNAVAILABLE", "message": "busy"}],
                             {"Retry-After": str(rnd % 2)})
            if fault == "status429":
                return reply(self, 429, [{"errorCode": "REQUEST_LIMIT_EXCEEDED", "message": "slow"}],
                             {"Retry-After": "1"})
            if fault == "status500":
                return reply(self, 500, [{"errorCode": "UNKNOWN_EXCEPTION", "message": "oops"}])
            if fault == "hang":
                stopping.wait(hang_s)
                return drop(self)
            if fault in ("close", "close_nostore"):
                return drop(self)
            if fault == "slow":
                if stopping.wait((50 + rnd % 1200) / 1000.0):
                    return drop(self)
            return reply(self, 201 if created else 200,
                         {"id": rid, "success": True, "errors": [], "created": created})

    srv = Threading(("127.0.0.1", 0), H)
    srv.records = records
    return srv


# -- SMTP relay ------------------------------------------------------------------

class SmtpHandler:
    def __init__(self, rec, hang_s):
        self.rec = rec
        self.hang_s = hang_s

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        t = time.time()
        n, fault, seq, rnd = self.rec.draw("smtp", address)
        envelope.chaos = (address, n, fault, seq, rnd)
        self.rec.write({"kind": "smtp", "key": address, "n": n, "fault": fault,
                        "stage": "rcpt", "processed": False, "t": t})
        if fault == "tempfail_rcpt":
            return "450 4.2.1 mailbox busy, try later"
        if fault == "drop_rcpt":
            server.transport.abort()
            await asyncio.sleep(1)
            return "421 4.4.2 closing"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server, session, envelope):
        t = time.time()
        address, n, fault, seq, rnd = getattr(envelope, "chaos", ("-", 0, "ok", 0, 0))
        qid = f"Q{seq:09d}"
        processed = fault != "tempfail_data"
        mid = None
        for line in (envelope.original_content or b"").split(b"\r\n"):
            if not line:
                break
            if line.lower().startswith(b"message-id:"):
                mid = line.split(b":", 1)[1].strip().decode("ascii", "replace")
        self.rec.write({"kind": "smtp", "key": address, "n": n, "fault": fault, "stage": "data",
                        "processed": processed, "reply_id": qid if processed else None,
                        "message_id": mid, "t": t})
        if fault == "tempfail_data":
            return "451 4.3.0 temporary failure, try later"
        if fault == "drop_after_data":
            server.transport.abort()
            await asyncio.sleep(1)
            return "421 4.4.2 closing"
        if fault == "silent_after_data":
            await asyncio.sleep(self.hang_s)
            server.transport.abort()
            return "421 4.4.2 closing"
        if fault == "slow_data":
            await asyncio.sleep((50 + rnd % 1200) / 1000.0)
        return f"250 2.0.0 Ok: queued as {qid}"


def smtp_server(rec, hang_s):
    ready = threading.Event()
    box = {}

    def run():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        handler = SmtpHandler(rec, hang_s)
        srv = loop.run_until_complete(loop.create_server(
            lambda: SMTP(handler, hostname="chaos.test", decode_data=False, loop=loop),
            "127.0.0.1", 0, backlog=1024))
        box["port"] = srv.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return box["port"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", default="1")
    ap.add_argument("--token", required=True)
    ap.add_argument("--hang-ms", type=int, default=4000)
    a = ap.parse_args()
    rec = Recorder(os.path.join(a.dir, "receipts.jsonl"), a.seed)
    stopping = threading.Event()
    hang_s = a.hang_ms / 1000.0
    h = http_server(rec, hang_s, stopping)
    c = crm_server(rec, a.token, hang_s, stopping)
    for s in (h, c):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    sp = smtp_server(rec, hang_s)
    print(json.dumps({"http": h.server_address[1], "crm": c.server_address[1], "smtp": sp}),
          flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    stopping.set()
    with open(os.path.join(a.dir, "crm_records.json"), "w") as f:
        json.dump(c.records, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
