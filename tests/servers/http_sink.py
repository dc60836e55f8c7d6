#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""A local HTTP server with fault injection, for the dispatcher's tests,
the demo and the chaos suite.

The path picks the behaviour (query parameters tune it):

  /ok                      200 {"id": "sink-<n>"}
  /status/<code>           that status; ?retry_after=S adds Retry-After
  /delay/<ms>              200 after <ms>
  /close                   read the request, then close without answering
  /close-reused            the first request on a connection: 200; a later request
                           on the same (keep-alive) connection: read it fully, then
                           close without answering (a server that drops a reused
                           connection after taking the request)
  /hang                    read the request, never answer (until shutdown)
  /trickle                 send the status line and headers one byte at a time, slowly
  /flaky/<n>/<code>        the first <n> requests for a key get <code>, then 200
  /idem                    an idempotency-aware endpoint: a repeated key gets the
                           first answer again (and is counted as a replay)
  /drop-unread/<n>         the first <n> requests for a key: close after the headers,
                           the body never read (the request is not taken); then 200
  /echo/<code>             an API that echoes the request: every request header
                           (but framing ones) back as a response header, and the
                           body {"id": <header ?id=NAME>, "error": "rejected
                           credential <header ?quote=NAME>", "headers": {...}}
                           (?decode=NAME: "rejected user <user:pass>", the Basic
                           credential of that header decoded);
                           a 2xx is taken
  /lookup?key=K            what a provider's "find by external id" answers: 200
                           {"id": ...} when a request with Idempotency-Key K was
                           taken (read and processed: ok, delay, hang, close, idem,
                           2xx statuses), else 404

A request is "taken" when the sink read it and acted on it (processed(key)
counts them); a 4xx/5xx refusal, a 429/503 or a drop before reading is not.

Every request is recorded (method, path, headers, body, key, the client's
port and its number on its connection), and counted per Idempotency-Key, so
tests can assert "received once"; accepted TCP connections are counted
(`connections`), so tests can tell keep-alive from one connection per call.

Run standalone: http_sink.py PORT [--quiet] [--log FILE]  (prints
"listening PORT"; --log appends one JSON line per request received).
"""
import base64
import http.server
import json
import socketserver
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit


class Sink:
    def __init__(self, host="127.0.0.1", port=0, quiet=True, log_path=None):
        self.log_file = open(log_path, "a", buffering=1) if log_path else None
        self.lock = threading.Lock()
        self.requests = []
        self.by_key = {}
        self.flaky_seen = {}
        self.idem_answers = {}
        self.taken = {}  # key -> [provider ids of the requests taken]
        self.drop_seen = {}
        self.replays = 0
        self.active = 0
        self.max_active = 0
        self.connections = 0
        self.stopping = threading.Event()
        self.quiet = quiet
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                self.conn_requests = 0  # requests served on this connection
                with sink.lock:
                    sink.connections += 1

            def log_message(self, fmt, *args):
                if not sink.quiet:
                    sys.stderr.write("sink: " + fmt % args + "\n")

            def do_POST(self):
                sink._handle(self)

            do_PUT = do_PATCH = do_DELETE = do_GET = do_POST

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 1024

        self.server = Server((host, port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    # -- what tests read --------------------------------------------------
    def count(self, key=None, path_prefix=None):
        with self.lock:
            return sum(1 for r in self.requests
                       if (key is None or r["key"] == key)
                       and (path_prefix is None or r["path"].startswith(path_prefix)))

    def keys(self):
        with self.lock:
            return dict(self.by_key)

    def received(self):
        with self.lock:
            return list(self.requests)

    def processed(self, key):
        """Requests with this Idempotency-Key the sink took (read and acted on)."""
        with self.lock:
            return len(self.taken.get(key, []))

    def _take(self, key, pid):
        if key:
            with self.lock:
                self.taken.setdefault(key, []).append(pid)

    # -- behaviour --------------------------------------------------------
    def _handle(self, h):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self._serve(h)
        finally:
            with self.lock:
                self.active -= 1

    def _serve(self, h):
        url = urlsplit(h.path)
        if url.path.startswith("/drop-unread/"):
            key = h.headers.get("Idempotency-Key")
            with self.lock:
                seen = self.drop_seen.get(key, 0) + 1
                self.drop_seen[key] = seen
            if seen <= int(url.path.split("/")[2]):
                # The headers were read (by the server), the body never:
                # nothing was taken.  Recorded, with no body.
                with self.lock:
                    n = len(self.requests) + 1
                    self.requests.append({"n": n, "method": h.command, "path": url.path,
                                          "key": key, "headers": {}, "body": None,
                                          "t": time.time(), "client_port": h.client_address[1],
                                          "conn_request": 0})
                    if key:
                        self.by_key[key] = self.by_key.get(key, 0) + 1
                return self._drop(h)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        q = parse_qs(url.query)
        key = h.headers.get("Idempotency-Key")
        h.conn_requests += 1
        with self.lock:
            n = len(self.requests) + 1
            self.requests.append({"n": n, "method": h.command, "path": url.path, "key": key,
                                  "headers": {k.lower(): v for k, v in h.headers.items()},
                                  "body": body, "t": time.time(),
                                  "client_port": h.client_address[1],
                                  "conn_request": h.conn_requests})
            if key:
                self.by_key[key] = self.by_key.get(key, 0) + 1
            if self.log_file:
                self.log_file.write(json.dumps({"n": n, "method": h.command, "path": url.path,
                                                "key": key, "t": time.time()}) + "\n")
        parts = [p for p in url.path.split("/") if p]
        kind = parts[0] if parts else "ok"

        if kind == "echo":
            code = int(parts[1])
            if 200 <= code < 300:
                self._take(key, f"sink-{n}")
            got = {k: v for k, v in h.headers.items()}
            framing = {"content-length", "content-type", "host", "connection", "expect",
                       "transfer-encoding", "idempotency-key"}
            back = {k: v for k, v in got.items() if k.lower() not in framing}
            obj = {}
            if "id" in q:
                obj["id"] = h.headers.get(q["id"][0], "")
            if "quote" in q:
                obj["error"] = f"rejected credential {h.headers.get(q['quote'][0], '')}"
            if "decode" in q:   # a Basic credential, decoded: "user:pass"
                cred = h.headers.get(q["decode"][0], "").partition(" ")[2]
                obj["error"] = f"rejected user {base64.b64decode(cred).decode()}"
            obj["headers"] = got
            return self._reply(h, code, obj, back)
        if kind in ("ok", "delay", "close", "hang", "drop-unread") or (kind == "status" and 200 <= int(parts[1]) < 300):
            self._take(key, f"sink-{n}")
        if kind in ("ok", "drop-unread"):
            return self._reply(h, 200, {"id": f"sink-{n}"})
        if kind == "lookup":
            want = q.get("key", [""])[0]
            with self.lock:
                ids = self.taken.get(want)
            if ids:
                return self._reply(h, 200, {"id": ids[0], "external_id": want})
            return self._reply(h, 404, {"error": "not found"})
        if kind == "status":
            code = int(parts[1])
            extra = {}
            if "retry_after" in q:
                extra["Retry-After"] = q["retry_after"][0]
            return self._reply(h, code, {"error": f"status {code}"} if code >= 300 else {"id": f"sink-{n}"},
                               extra)
        if kind == "delay":
            if self.stopping.wait(int(parts[1]) / 1000.0):
                return
            return self._reply(h, 200, {"id": f"sink-{n}"})
        if kind == "close":
            return self._drop(h)
        if kind == "close-reused":
            if h.conn_requests == 1:
                return self._reply(h, 200, {"id": f"sink-{n}"})
            return self._drop(h)
        if kind == "hang":
            self.stopping.wait(3600)
            h.close_connection = True
            return
        if kind == "trickle":
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
            try:
                for b in head:
                    if self.stopping.wait(0.5):
                        return
                    h.wfile.write(bytes([b]))
                    h.wfile.flush()
                h.wfile.write(b"{}")
            except OSError:
                pass
            return
        if kind == "flaky":
            limit, code = int(parts[1]), int(parts[2])
            with self.lock:
                seen = self.flaky_seen.get(key, 0) + 1
                self.flaky_seen[key] = seen
            if seen <= limit:
                extra = {"Retry-After": q["retry_after"][0]} if "retry_after" in q else {}
                return self._reply(h, code, {"error": "flaky"}, extra)
            return self._reply(h, 200, {"id": f"sink-{n}"})
        if kind == "idem":
            with self.lock:
                if key in self.idem_answers:
                    self.replays += 1
                    return self._reply(h, 200, self.idem_answers[key])
                ans = {"id": f"idem-{n}"}
                self.idem_answers[key] = ans
            self._take(key, ans["id"])
            return self._reply(h, 200, ans)
        return self._reply(h, 404, {"error": "no such path"})

    @staticmethod
    def _drop(h):
        """Close the connection without an answer (the request was read)."""
        h.close_connection = True
        try:
            h.connection.shutdown(2)
        except OSError:
            pass

    @staticmethod
    def _reply(h, code, obj, headers=None):
        data = json.dumps(obj).encode()
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


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    log = sys.argv[sys.argv.index("--log") + 1] if "--log" in sys.argv else None
    s = Sink(port=port, quiet="--quiet" in sys.argv, log_path=log).start()
    print(f"listening {s.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        s.stop()
