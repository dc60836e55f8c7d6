# SPDX-License-Identifier: ISC
"""A PostgreSQL proxy that loses an answer after the server committed it.

Forwards a loopback TCP port to the test cluster (TCP or its Unix socket).
Armed with a pattern, the first client query whose bytes contain it has
its answer withheld: the proxy reads the server's messages up to and
including ReadyForQuery (the transaction has then committed) and closes
both sides without forwarding any of them.  The client sees a connection
lost with its statement on the wire, the case a repeated statement must
handle.  Clients must connect with sslmode=disable and gssencmode=disable
(the proxy reads the server's stream as typed messages from the start).
"""
import os
import socket
import struct
import threading


class CutProxy:
    def __init__(self):
        self.port = None
        self.pattern = None
        self.hold = None
        self.cuts = 0
        self.lock = threading.Lock()
        self.srv = None
        self.stopping = False
        host = os.environ["PGHOST"]
        port = int(os.environ["PGPORT"])
        if host.startswith("/"):
            self.upstream = (socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}"))
        else:
            self.upstream = (socket.AF_INET, (host, port))

    def start(self):
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self):
        self.stopping = True
        self.srv.close()

    def arm(self, pattern, hold=None):
        """hold: a threading.Event; the cut (the answer read, counted in
        `cuts`, nothing forwarded) then waits for it before closing, so a
        test can change the world between the commit and the repeat."""
        with self.lock:
            self.pattern = pattern
            self.hold = hold

    def conninfo(self, dsn):
        """dsn (key=value) pointed at the proxy."""
        keep = [kv for kv in dsn.split() if not kv.startswith(("host=", "port="))]
        return " ".join(keep + [f"host=127.0.0.1 port={self.port}", "sslmode=disable",
                                "gssencmode=disable"])

    def _accept(self):
        while not self.stopping:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.socket(self.upstream[0], socket.SOCK_STREAM)
            u.connect(self.upstream[1])
            pair = {"cut": False}
            threading.Thread(target=self._client_to_server, args=(c, u, pair), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(c, u, pair), daemon=True).start()

    def _client_to_server(self, c, u, pair):
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    break
                with self.lock:
                    if self.pattern and self.pattern in data:
                        self.pattern = None
                        pair["cut"] = True
                u.sendall(data)
        except OSError:
            pass
        self._close(c, u)

    def _server_to_client(self, c, u, pair):
        buf = b""
        try:
            while True:
                data = u.recv(65536)
                if not data:
                    break
                if not pair["cut"]:
                    c.sendall(data)
                    continue
                # Withhold everything up to the ReadyForQuery after the
                # armed query: it committed; its answer is lost.
                buf += data
                while len(buf) >= 5:
                    mtype = buf[0:1]
                    (mlen,) = struct.unpack("!I", buf[1:5])
                    if len(buf) < 1 + mlen:
                        break
                    buf = buf[1 + mlen:]
                    if mtype == b"Z":
                        with self.lock:
                            self.cuts += 1
                            hold = self.hold
                        if hold is not None:
                            hold.wait(60)
                        self._close(c, u)
                        return
        except OSError:
            pass
        self._close(c, u)

    @staticmethod
    def _close(c, u):
        for s in (c, u):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
