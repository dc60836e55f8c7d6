# SPDX-License-Identifier: ISC
"""A PostgreSQL proxy that loses an answer after the server committed it,
or black-holes its connections.

Forwards a loopback TCP port to the test cluster (TCP or its Unix socket).
Armed with a pattern, the first client query whose bytes contain it has
its answer withheld: the proxy reads the server's messages up to and
including ReadyForQuery (the transaction has then committed) and closes
both sides without forwarding any of them.  The client sees a connection
lost with its statement on the wire, the case a repeated statement must
handle.

blackhole() is a network that drops packets without a reset: every
connection open at that moment, and every one accepted until heal(),
stays open and forwards nothing, ever (a peer whose state is gone, a
firewall that drops).  The client's kernel sees its data taken (the proxy
reads and discards it), so TCP keepalives and tcp_user_timeout never fire
on loopback: only the client's own deadlines get it out.  After heal(),
new connections work; the wedged ones stay wedged.

Clients must connect with sslmode=disable and gssencmode=disable
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
        self.holed = False
        self.wedged = set()     # connections black-holed for good
        self.accepted = 0
        self.live = set()
        host = os.environ["PGHOST"]
        port = int(os.environ["PGPORT"])
        if host.startswith("/"):
            self.upstream = (socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}"))
        else:
            self.upstream = (socket.AF_INET, (host, port))

    def start(self, port=0):
        """port: a fixed loopback port (one a client was already pointed
        at while nothing listened there); 0: any free one."""
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
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

    def blackhole(self):
        """From now on nothing passes on the open connections (for good)
        nor on new ones (until heal())."""
        with self.lock:
            self.holed = True
            self.wedged |= self.live

    def heal(self):
        """New connections forward again; the black-holed ones stay so."""
        with self.lock:
            self.holed = False

    def _is_wedged(self, pair):
        with self.lock:
            return pair["id"] in self.wedged

    def conninfo(self, dsn, port=None):
        """dsn (key=value) pointed at the proxy (or at the port it will
        listen on: start(port))."""
        keep = [kv for kv in dsn.split() if not kv.startswith(("host=", "port="))]
        return " ".join(keep + [f"host=127.0.0.1 port={port or self.port}", "sslmode=disable",
                                "gssencmode=disable"])

    def _accept(self):
        while not self.stopping:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.socket(self.upstream[0], socket.SOCK_STREAM)
            u.connect(self.upstream[1])
            with self.lock:
                self.accepted += 1
                pair = {"cut": False, "id": self.accepted}
                self.live.add(pair["id"])
                if self.holed:
                    self.wedged.add(pair["id"])
            threading.Thread(target=self._client_to_server, args=(c, u, pair), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(c, u, pair), daemon=True).start()

    def _client_to_server(self, c, u, pair):
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    break
                if self._is_wedged(pair):
                    continue        # taken and dropped: no reset, no answer
                with self.lock:
                    if self.pattern and self.pattern in data:
                        self.pattern = None
                        pair["cut"] = True
                u.sendall(data)
        except OSError:
            pass
        self._end(c, u, pair, client_gone=True)

    def _end(self, c, u, pair, client_gone=False):
        """A side closed: pass it on, unless the connection is black-holed
        (a client that gives up is not heard of there; the server's side
        is closed so that its backend goes away)."""
        with self.lock:
            self.live.discard(pair["id"])
            wedged = pair["id"] in self.wedged
        if wedged:
            for s in (u, c) if client_gone else (u,):
                try:
                    s.close()
                except OSError:
                    pass
            return
        self._close(c, u)

    def _server_to_client(self, c, u, pair):
        buf = b""
        try:
            while True:
                data = u.recv(65536)
                if not data:
                    break
                if self._is_wedged(pair):
                    continue
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
        self._end(c, u, pair)

    @staticmethod
    def _close(c, u):
        for s in (c, u):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
