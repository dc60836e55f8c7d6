# SPDX-License-Identifier: ISC
"""A local stand-in for Salesforce's REST API, as far as the crm provider
uses it: upsert by External ID and lookup by External ID.

    PATCH /services/data/vNN.N/sobjects/{Object}/{ExtField}/{value}
        body: JSON object of fields
        201 {"id": "00T...", "success": true, "errors": [], "created": true}
        200 {"id": "00T...", "success": true, "errors": [], "created": false}
            (or 204 with no body: update_status=204, as before API v46.0)
        300 ["/services/data/vNN.N/sobjects/{Object}/{Id}", ...]  several matches
        400 [{"errorCode": "...", "message": "..."}]  bad body
    GET  same path [?fields=A,B]
        200 {"attributes": {...}, "Id": "00T...", ...}
        404 [{"errorCode": "NOT_FOUND", "message": "The requested resource does not exist"}]
        300 for a key configured as ambiguous
    Any request without "Authorization: Bearer <token>":
        401 [{"errorCode": "INVALID_SESSION_ID", "message": "Session expired or invalid"}]

Faults are queued per (method, external id) and consumed one per request:
    ("status", code, retry_after[, errorCode])
                 answer code (500/502/503/429/409, ...) without touching the
                 data; retry_after (seconds, a date or None) becomes
                 Retry-After; errorCode overrides the error array's code
    ("hang",)    read the body, STORE the record, then send nothing until
                 the client gives up (an ambiguous outcome that did happen)
    ("close",)   read the body, store the record, close without an answer
    ("close_nostore",)  read the body, close without storing

Used in-process by the tests (CrmServer(...).start()), or standalone:
    python3 crm_server.py --token T [--port N]
"""
import argparse
import json
import re
import ssl
import sys
import threading
import time
from collections import Counter, defaultdict, deque, namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Request = namedtuple("Request", "method path headers body ext at")

PATH_RE = re.compile(r"^/services/data/(v\d+\.\d+)/sobjects/([A-Za-z][A-Za-z0-9_]*)/"
                     r"([A-Za-z][A-Za-z0-9_]*)/([^/?]+)(?:\?(.*))?$")

# Salesforce key prefixes of a few objects; anything else gets "a00".
KEY_PREFIX = {"Task": "00T", "Account": "001", "Contact": "003", "Lead": "00Q", "Case": "500"}


def sf_errors(code, message, fields=None):
    return [{"errorCode": code, "message": message, "fields": fields or []}]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "crm-test"

    def log_message(self, fmt, *args):  # quiet
        pass

    # -- plumbing ---------------------------------------------------------
    def _send(self, code, body=None, headers=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body is not None:
            self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # -- requests ---------------------------------------------------------
    def do_PATCH(self):
        self._handle("PATCH")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")

    def _handle(self, method):
        srv = self.server.crm
        body = self._read_body()
        m = PATH_RE.match(self.path)
        ext = m.group(4) if m else None
        srv._log(method, self.path, dict(self.headers), body, ext)
        if self.headers.get("Authorization") != "Bearer " + srv.token:
            msg = "Session expired or invalid"
            if srv.quote_auth:  # a server that quotes the credential it refused
                msg += f": {self.headers.get('Authorization')}"
            return self._send(401, sf_errors("INVALID_SESSION_ID", msg))
        if m is None:
            return self._send(404, sf_errors("NOT_FOUND", "The requested resource does not exist"))
        if method not in ("PATCH", "GET"):
            return self._send(405, sf_errors("METHOD_NOT_ALLOWED",
                                             f"HTTP Method '{method}' not allowed. Allowed are GET,PATCH"))
        version, obj, field, value = m.group(1), m.group(2), m.group(3), m.group(4)
        query = m.group(5) or ""
        fault = srv._next_fault(method, value)
        if fault and fault[0] == "status":
            code = fault[1]
            retry_after = fault[2] if len(fault) > 2 else None
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
            names = {500: "UNKNOWN_EXCEPTION", 502: "BAD_GATEWAY", 503: "SERVER_UNAVAILABLE",
                     429: "REQUEST_LIMIT_EXCEEDED", 409: "UNABLE_TO_LOCK_ROW",
                     403: "REQUEST_LIMIT_EXCEEDED", 400: "UNABLE_TO_LOCK_ROW"}
            err = fault[3] if len(fault) > 3 else names.get(code, "ERROR")
            return self._send(code, sf_errors(err, f"injected {code}"), headers)
        if method == "GET":
            return self._lookup(version, obj, field, value, query)
        return self._upsert(version, obj, field, value, body, fault)

    def _lookup(self, version, obj, field, value, query):
        srv = self.server.crm
        if value in srv.ambiguous:
            return self._send(300, [f"/services/data/{version}/sobjects/{obj}/{i}"
                                    for i in srv.ambiguous[value]])
        rec = srv.record(obj, field, value)
        if rec is None:
            return self._send(404, sf_errors("NOT_FOUND", "The requested resource does not exist"))
        out = {"attributes": {"type": obj, "url": f"/services/data/{version}/sobjects/{obj}/{rec['Id']}"}}
        wanted = None
        for part in query.split("&"):
            if part.startswith("fields="):
                wanted = [f for f in part[7:].split(",") if f]
        for k, v in rec.items():
            if wanted is None or k in wanted:
                out[k] = v
        return self._send(200, out)

    def _upsert(self, version, obj, field, value, body, fault):
        srv = self.server.crm
        if not (self.headers.get("Content-Type") or "").startswith("application/json"):
            return self._send(415, sf_errors("UNSUPPORTED_MEDIA_TYPE",
                                             "Content-Type header specified in HTTP request is not supported"))
        try:
            fields = json.loads(body or b"null")
        except ValueError:
            return self._send(400, sf_errors("JSON_PARSER_ERROR", "Unexpected character in request body"))
        if not isinstance(fields, dict):
            return self._send(400, sf_errors("JSON_PARSER_ERROR",
                                             "Cannot deserialize instance of SObject from body"))
        for k in fields:
            if k.lower() in ("id", field.lower()):
                return self._send(400, sf_errors("INVALID_FIELD",
                                                 f"No such column '{k}' on sobject of type {obj}"
                                                 if k.lower() == "id" else
                                                 f"{k}: the external id field cannot be in the body", [k]))
            if k in srv.invalid_fields:
                return self._send(400, sf_errors("INVALID_FIELD",
                                                 f"No such column '{k}' on sobject of type {obj}", [k]))
        if value in srv.ambiguous:
            return self._send(300, [f"/services/data/{version}/sobjects/{obj}/{i}"
                                    for i in srv.ambiguous[value]])
        store = not (fault and fault[0] == "close_nostore")
        created, rec_id = (srv._store(obj, field, value, fields) if store else (False, None))
        if fault and fault[0] == "hang":
            srv._hang()
            self.close_connection = True
            return None
        if fault and fault[0] in ("close", "close_nostore"):
            self.close_connection = True
            return None
        if created:
            return self._send(201, {"id": rec_id, "success": True, "errors": [], "created": True})
        if srv.update_status == 204:
            return self._send(204)
        return self._send(200, {"id": rec_id, "success": True, "errors": [], "created": False})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128   # many parallel connects must not hit the backlog
    ssl_context = None

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.ssl_context:
            # The handshake runs in the request's thread (finish_request),
            # never in the accept loop, so one bad client stalls nobody.
            sock = self.ssl_context.wrap_socket(sock, server_side=True,
                                                do_handshake_on_connect=False)
        return sock, addr

    def finish_request(self, request, client_address):
        if self.ssl_context:
            try:
                request.settimeout(10)
                request.do_handshake()
                request.settimeout(None)
            except (OSError, ValueError):
                return  # e.g. the client refused our certificate
        super().finish_request(request, client_address)


class CrmServer:
    def __init__(self, token="test-token", update_status=200, host="127.0.0.1", port=0,
                 tls=None):
        """tls: (certfile, keyfile) to serve https instead of http."""
        self.token = token
        self.update_status = update_status
        self.ambiguous = {}          # external id -> [record ids]: 300
        self.invalid_fields = set()  # field names answered with 400 INVALID_FIELD
        self.quote_auth = False      # a 401 quotes the Authorization line it refused
        self.records = {}            # (obj, field, value) -> dict with "Id"
        self.requests = []           # Request tuples, in arrival order
        self.counts = Counter()      # (method, ext) -> n
        self._faults = defaultdict(deque)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = 0
        self.httpd = _Server((host, port), _Handler)
        self.httpd.crm = self
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.httpd.ssl_context = ctx
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self._thread = None

    # -- test control -----------------------------------------------------
    def start(self):
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def fault(self, method, ext, *actions):
        """Queue faults for the next requests of method on external id ext."""
        with self._lock:
            self._faults[(method, ext)].extend(actions)

    def record(self, obj, field, value):
        with self._lock:
            r = self.records.get((obj, field, value))
            return dict(r) if r else None

    def put(self, obj, field, value, fields=None):
        """Store a record directly (as if an earlier call had reached us)."""
        return self._store(obj, field, value, fields or {})[1]

    def count(self, ext, method=None):
        with self._lock:
            if method:
                return self.counts[(method, ext)]
            return sum(n for (m, e), n in self.counts.items() if e == ext)

    def records_for(self, value):
        with self._lock:
            return [dict(r) for (o, f, v), r in self.records.items() if v == value]

    # -- internals --------------------------------------------------------
    def _log(self, method, path, headers, body, ext):
        with self._lock:
            self.requests.append(Request(method, path, headers, body, ext, time.monotonic()))
            self.counts[(method, ext)] += 1

    def _next_fault(self, method, ext):
        with self._lock:
            q = self._faults.get((method, ext))
            return q.popleft() if q else None

    def _store(self, obj, field, value, fields):
        with self._lock:
            key = (obj, field, value)
            rec = self.records.get(key)
            if rec is None:
                self._seq += 1
                prefix = KEY_PREFIX.get(obj, "a00")
                rec = {"Id": f"{prefix}{self._seq:015d}"[:18], field: value}
                rec.update(fields)
                self.records[key] = rec
                return True, rec["Id"]
            rec.update(fields)
            return False, rec["Id"]

    def _hang(self):
        # Long past any sane client timeout; released when the server stops.
        self._stop.wait(120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token", required=True)
    ap.add_argument("--update-status", type=int, choices=(200, 204), default=200)
    a = ap.parse_args()
    s = CrmServer(token=a.token, update_status=a.update_status, port=a.port)
    print(s.port, flush=True)
    try:
        s.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
