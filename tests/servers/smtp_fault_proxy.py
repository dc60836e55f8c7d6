# SPDX-License-Identifier: ISC
"""An SMTP-aware TCP proxy that injects faults at the commit point
(loopback only), for the email provider against a real relay.

It reads the client's stream as SMTP (commands, DATA content up to its
terminator, BDAT chunks by their sizes) and the relay's replies in order,
so it knows, per message, where the content ends and which reply answers
that end.  A message is faulted when its RCPT TO address contains
`+fault` (so a test picks exactly which messages); every other byte goes
through unchanged.

Modes (fault=...):
  cut-before     at the faulted message's RCPT TO: the connection is closed
                 on both sides, the RCPT line and all behind it dropped (with
                 CHUNKING and PIPELINING that write also carries the BDAT
                 chunks: the relay gets none of the content)
  after-content  the content up to its end (DATA's ".", BDAT ... LAST)
                 goes to the relay; from then on no reply reaches the client,
                 and the connection is closed `delay_s` later (short: a cut
                 after the content; longer than timeout_ms: a stall)
  lost-final     everything goes to the relay; the reply to the end of the
                 content is dropped and the connection closed at once
  stall-mail     a MAIL FROM whose sender has `+fault` goes to the relay;
                 from then on no reply reaches the client, and the
                 connection is closed `delay_s` later
  none           no fault (with greeting_delay_s: a slow greeting only)

greeting_delay_s holds every connection's greeting that long.
chunking_line, when given, replaces what follows "250-" or "250 " in the
relay's CHUNKING line of EHLO (a spelling that libesmtp reads as CHUNKING
all the same, such as b" CHUNKING").

Counters: .faulted (messages the fault hit), .connections.
In-process: SmtpFaultProxy(upstream_port, fault, delay_s).start() -> port;
.stop().
"""
import asyncio
import re
import socket
import threading

RCPT = re.compile(rb"^RCPT TO:\s*<([^>]*)>", re.I)
MAIL = re.compile(rb"^MAIL FROM:\s*<([^>]*)>", re.I)
BDAT = re.compile(rb"^BDAT\s+(\d+)(\s+LAST)?\s*$", re.I)


class _Conn:
    def __init__(self, proxy, cr, cw, sr, sw):
        self.p = proxy
        self.cr, self.cw, self.sr, self.sw = cr, cw, sr, sw
        self.buf = b""
        self.state = "cmd"      # cmd | data | bdat
        self.left = 0           # bdat bytes still to pass
        self.last = False       # the chunk being passed is LAST
        self.faulted = False    # the current message is faulted
        self.expect = ["greeting"]  # what each coming reply answers
        self.mute = False       # replies are no longer forwarded
        self.closed = False

    def close(self):
        if self.closed:
            return
        self.closed = True
        for w in (self.cw, self.sw):
            try:
                w.transport.abort()
            except Exception:   # noqa: BLE001 - already gone
                pass

    def end_of_content(self):
        """The client's stream reached the end of a message's content."""
        self.expect.append("end-faulted" if self.faulted else "end")
        if self.faulted and self.p.fault == "after-content":
            self.p.faulted += 1
            self.mute = True
            asyncio.get_running_loop().call_later(self.p.delay_s, self.close)

    def feed(self, data):
        """Client bytes in; the bytes to forward out (None: cut here)."""
        self.buf += data
        out = b""
        while self.buf:
            if self.state == "bdat":
                n = min(self.left, len(self.buf))
                out += self.buf[:n]
                self.buf = self.buf[n:]
                self.left -= n
                if self.left:
                    break
                self.state = "cmd"
                if self.last:
                    self.end_of_content()
                else:
                    self.expect.append("chunk")
                continue
            i = self.buf.find(b"\n")
            if i < 0:
                break
            line, self.buf = self.buf[:i + 1], self.buf[i + 1:]
            if self.state == "data":
                out += line
                if line in (b".\r\n", b".\n"):
                    self.state = "cmd"
                    self.end_of_content()
                continue
            word = line.split(b" ", 1)[0].strip().upper()
            m = MAIL.match(line)
            if m and b"+fault" in m.group(1).lower() and self.p.fault == "stall-mail":
                self.p.faulted += 1
                self.mute = True
                asyncio.get_running_loop().call_later(self.p.delay_s, self.close)
            m = RCPT.match(line)
            if m:
                self.faulted = b"+fault" in m.group(1).lower()
                if self.faulted and self.p.fault == "cut-before":
                    self.p.faulted += 1
                    return out, True
            b = BDAT.match(line.rstrip(b"\r\n"))
            out += line
            if b:
                self.left, self.last = int(b.group(1)), bool(b.group(2))
                self.state = "bdat"
                if self.left == 0:
                    self.state = "cmd"
                    if self.last:
                        self.end_of_content()
                    else:
                        self.expect.append("chunk")
                continue
            self.expect.append(word.decode(errors="replace"))
            if word == b"DATA":
                self.state = "data"
        return out, False

    async def client_to_relay(self):
        try:
            while not self.closed:
                data = await self.cr.read(65536)
                if not data:
                    break
                out, cut = self.feed(data)
                if out:
                    self.sw.write(out)
                if cut:
                    self.close()
                    return
        except (ConnectionError, OSError):
            pass
        if not self.mute:
            self.close()

    async def relay_to_client(self):
        rbuf = b""
        if self.p.greeting_delay_s:
            await asyncio.sleep(self.p.greeting_delay_s)
        try:
            while not self.closed:
                data = await self.sr.read(65536)
                if not data:
                    break
                rbuf += data
                while b"\n" in rbuf:
                    i = rbuf.index(b"\n")
                    line, rbuf = rbuf[:i + 1], rbuf[i + 1:]
                    final = len(line) >= 4 and line[3:4] != b"-"
                    what = self.expect.pop(0) if final and self.expect else None
                    if what == "end-faulted" and self.p.fault == "lost-final":
                        self.p.faulted += 1
                        self.close()
                        return
                    if self.p.chunking_line is not None and \
                            line[4:].rstrip(b"\r\n").upper() == b"CHUNKING" and \
                            line[:3] == b"250":
                        line = line[:4] + self.p.chunking_line + b"\r\n"
                    if not self.mute:
                        self.cw.write(line)
        except (ConnectionError, OSError):
            pass
        if not self.mute:
            self.close()


class SmtpFaultProxy:
    def __init__(self, upstream_port, fault, delay_s=0.0, host="127.0.0.1", greeting_delay_s=0.0,
                 chunking_line=None):
        assert fault in ("cut-before", "after-content", "lost-final", "stall-mail", "none")
        self.chunking_line = chunking_line
        self.greeting_delay_s = greeting_delay_s
        self.upstream = (host, upstream_port)
        self.fault = fault
        self.delay_s = delay_s
        self.faulted = 0
        self.connections = 0
        self.port = None
        self._loop = None
        self._thread = None

    async def _handle(self, cr, cw):
        self.connections += 1
        try:
            sr, sw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.transport.abort()
            return
        c = _Conn(self, cr, cw, sr, sw)
        try:
            await asyncio.gather(c.client_to_relay(), c.relay_to_client())
        except asyncio.CancelledError:   # stop() with the connection open
            c.close()
            return
        if not c.mute:
            c.close()

    def start(self):
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, sock=sock))
            ready.set()
            self._loop.run_forever()
            pending = asyncio.all_tasks(self._loop)
            for t in pending:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._server.close()
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.port

    def stop(self):
        if self._loop:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
