# SPDX-License-Identifier: ISC
"""A scripted SMTP peer for the email provider's tests (aiosmtpd).

Behaviour is chosen per message by plus-addressing, so one server can give
several effects different answers in one run:

    recipient  user+MODE@domain      sender  user+MODE@domain

    (no mode)             250 2.0.0 Ok: queued as <QUEUE-ID>
    tempfail-rcpt         RCPT TO -> 450 4.2.1 mailbox busy
    reject-rcpt           RCPT TO -> 550 5.1.1 no such user
    slow-rcpt-MS          RCPT TO answered after MS milliseconds
    drop-rcpt             RCPT TO -> connection closed without a reply
    tempfail-datacmd      DATA    -> 451 4.3.0 try later (nothing received)
    reject-datacmd        DATA    -> 554 5.7.1 no (nothing received)
    tempfail-data         end of data -> 451 4.3.0 (message received, refused)
    reject-data           end of data -> 554 5.6.0 content rejected
    drop-after-data       end of data: message RECEIVED, connection closed
                          without a reply
    silent-after-data     end of data: message RECEIVED, no reply until the
                          client goes away
    slow-data-MS          end of data answered 250 after MS milliseconds
    tempfail-mail         (sender) MAIL FROM -> 451 4.3.2 busy
    reject-mail           (sender) MAIL FROM -> 553 5.7.1 sender refused

    fmt-NAME              end of data -> 250 in the format of MTA NAME
                          (REPLY_FORMATS: postfix, exim, opensmtpd,
                          sendmail, microsoft, ses, gmail, plain); the id
                          it names is the record's "queue_id"

Server-wide options: tls=(certfile, keyfile) offers STARTTLS;
require_starttls; auth={"user": "pass"} offers AUTH (PLAIN, LOGIN) and
requires it; greeting="421 ..." answers every connection with that line
and closes; greeting_delay_ms (every connection), or slow_greeting=(every,
ms): every `every`-th connection (1-based: the every-th, 2*every-th, ...)
waits ms before its greeting; ehlo_reply="554 ..." answers EHLO so;
close_after=k closes a connection right after its k-th answered message
(a relay ending a reused session); pipelining=True offers PIPELINING and
counts, in .pipelined, commands that arrived while an earlier one of the
same write was still unanswered (RCPT TO with DATA behind it).

Per connection: .sessions lists, for each connection, how many messages
got an answer on it; .max_open is the most connections open at once.

Every message that reaches the end of data is recorded (even those that
get no reply): SmtpServer.messages, .count(message_id).  .transactions
lists every MAIL FROM seen, .data_commands counts DATA commands.

In-process: SmtpServer(**options).start() -> port; .stop().
Standalone: python3 smtp_server.py [--port N] (prints the port).
"""
import argparse
import asyncio
import email
import email.policy
import re
import ssl
import threading
import uuid

from asyncio import sslproto

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword, TLSSetupException, syntax

MODE_RE = re.compile(r"\+([a-z0-9-]+)@")


# The 250 after the end of data, as common MTAs word it ({id}: the queue id).
REPLY_FORMATS = {
    "postfix": "250 2.0.0 Ok: queued as {id}",
    "exim": "250 OK id={id}",
    "opensmtpd": "250 2.0.0 {id} Message accepted for delivery",
    "sendmail": "250 2.0.0 {id} Message accepted for delivery",
    "microsoft": "250 2.6.0 <{id}> [InternalId=1236950581346, Hostname=AM0PR01MB1234."
                 "eurprd01.prod.exchangelabs.com] 9154 bytes in 0.112, 79.489 KB/sec "
                 "Queued mail for delivery",
    "ses": "250 Ok {id}",
    "gmail": "250 2.0.0 OK  1700000000 {id} - gsmtp",
    "plain": "250 {id} accepted",
}
REPLY_IDS = {
    "postfix": lambda q: q[:10],
    "exim": lambda q: f"1r{q[:4]}-000{q[4:7]}-AB",
    "opensmtpd": lambda q: q[:8].lower(),
    "sendmail": lambda q: f"4BK{q[:11]}",
    "microsoft": lambda q: f"{q}@AM0PR01MB1234.eurprd01.prod.exchangelabs.com",
    "ses": lambda q: f"0100018c{q.lower()}-00000000",
    "gmail": lambda q: f"{q[:6].lower()}.12",
    "plain": lambda q: q,
}


def mode_of(address):
    m = MODE_RE.search(address or "")
    return m.group(1) if m else ""


def delay_of(mode, prefix):
    if mode.startswith(prefix):
        try:
            return int(mode[len(prefix):]) / 1000.0
        except ValueError:
            return None
    return None


class Handler:
    def __init__(self, srv):
        self.srv = srv

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        session.host_name = hostname
        if self.srv.ehlo_reply:
            return [self.srv.ehlo_reply]
        if self.srv.pipelining:
            responses.insert(-1, "250-PIPELINING")
        return responses

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        mode = mode_of(address)
        with self.srv.lock:
            self.srv.transactions.append({"mail_from": address, "conn": server.conn_no,
                                          "auth": bool(session.authenticated),
                                          "tls": server._tls_protocol is not None})
        if mode == "tempfail-mail":
            return "451 4.3.2 system busy, try later"
        if mode == "reject-mail":
            return "553 5.7.1 sender refused"
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Ok"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        mode = mode_of(address)
        d = delay_of(mode, "slow-rcpt-")
        if d:
            await asyncio.sleep(d)
        if mode == "tempfail-rcpt":
            return "450 4.2.1 mailbox busy, try later"
        if mode == "reject-rcpt":
            return "550 5.1.1 no such user here"
        if mode == "drop-rcpt":
            server.transport.abort()
            await asyncio.sleep(3600)
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server, session, envelope):
        modes = [mode_of(r) for r in envelope.rcpt_tos]
        mode = next((m for m in modes if m), "")
        content = envelope.original_content or b""
        msg = email.message_from_bytes(content, policy=email.policy.default)
        queue_id = uuid.uuid4().hex[:12].upper()
        fmt = mode[4:] if mode.startswith("fmt-") else None
        if fmt:
            queue_id = REPLY_IDS[fmt](queue_id)
        rec = {"mail_from": envelope.mail_from, "rcpt_tos": list(envelope.rcpt_tos),
               "data": content, "message_id": msg.get("Message-ID"), "msg": msg,
               "queue_id": queue_id, "mode": mode, "replied": None}
        with self.srv.lock:
            self.srv.messages.append(rec)
        if mode == "tempfail-data":
            reply = "451 4.3.0 temporary failure, try later"
        elif mode == "reject-data":
            reply = "554 5.6.0 content rejected"
        elif mode == "drop-after-data":
            server.transport.abort()
            await asyncio.sleep(3600)
            return None
        elif mode == "silent-after-data":
            await asyncio.sleep(3600)
            return None
        else:
            d = delay_of(mode, "slow-data-")
            if d:
                await asyncio.sleep(d)
            reply = (REPLY_FORMATS[fmt] if fmt else REPLY_FORMATS["postfix"]).format(id=queue_id)
        rec["replied"] = reply
        if reply.startswith("250"):
            server.answered += 1
            with self.srv.lock:
                self.srv.sessions[server.conn_no] = server.answered
            if self.srv.close_after and server.answered >= self.srv.close_after:
                # The reply first, then the connection goes (a relay that
                # ends a session after k messages).
                await server.push(reply)
                server.transport.close()
                await asyncio.sleep(3600)
        return reply


class ScriptedSMTP(SMTP):
    answered = 0
    conn_no = 0

    async def _handle_client(self):
        srv = self.event_handler.srv
        with srv.lock:
            srv.connections += 1
            self.conn_no = srv.connections
            srv.sessions[self.conn_no] = 0
            srv.open_now += 1
            srv.max_open = max(srv.max_open, srv.open_now)
        try:
            delay = srv.greeting_delay_ms
            if srv.slow_greeting and self.conn_no % srv.slow_greeting[0] == 0:
                delay = srv.slow_greeting[1]
            if delay:
                await asyncio.sleep(delay / 1000.0)
            if srv.greeting:
                await self.push(srv.greeting)
                self.transport.close()
                return
            await super()._handle_client()
        finally:
            with srv.lock:
                srv.open_now -= 1

    @syntax("STARTTLS", when="tls_context")
    async def smtp_STARTTLS(self, arg):
        """aiosmtpd's own, except that "220" is written and the TLS layer
        installed in the same loop step: aiosmtpd awaits the write first, and
        a client quick enough to send its ClientHello meanwhile loses it to
        the plain-text reader (the handshake then hangs)."""
        if arg:
            await self.push("501 Syntax: STARTTLS")
            return
        waiter = self.loop.create_future()
        self._tls_protocol = sslproto.SSLProtocol(self.loop, self, self.tls_context, waiter,
                                                  server_side=True)
        self.transport.write(b"220 Ready to start TLS\r\n")
        self._original_transport = self.transport
        self._original_transport.set_protocol(self._tls_protocol)
        self.transport = self._tls_protocol._app_transport
        self._tls_protocol.connection_made(self._original_transport)
        try:
            await waiter
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise TLSSetupException() from error

    async def smtp_RCPT(self, arg):
        srv = self.event_handler.srv
        if srv.pipelining and len(getattr(self._reader, "_buffer", b"")) > 0:
            with srv.lock:
                srv.pipelined += 1
        await super().smtp_RCPT(arg)

    async def smtp_DATA(self, arg):
        srv = self.event_handler.srv
        with srv.lock:
            srv.data_commands += 1
        mode = next((mode_of(r) for r in self.envelope.rcpt_tos if mode_of(r)), "")
        if mode == "tempfail-datacmd":
            await self.push("451 4.3.0 cannot take data now")
            return
        if mode == "reject-datacmd":
            await self.push("554 5.7.1 transaction refused")
            return
        await super().smtp_DATA(arg)


class SmtpServer:
    def __init__(self, host="127.0.0.1", port=0, tls=None, require_starttls=False, auth=None,
                 greeting=None, greeting_delay_ms=0, ehlo_reply=None, slow_greeting=None,
                 close_after=0, pipelining=False):
        self.host = host
        self.port = port
        self.tls = tls
        self.require_starttls = require_starttls
        self.auth = auth
        self.greeting = greeting
        self.greeting_delay_ms = greeting_delay_ms
        self.ehlo_reply = ehlo_reply
        self.slow_greeting = slow_greeting
        self.close_after = close_after
        self.pipelining = pipelining
        self.pipelined = 0
        self.sessions = {}
        self.lock = threading.Lock()
        self.messages = []
        self.transactions = []
        self.auth_attempts = []
        self.data_commands = 0
        self.connections = 0
        self.open_now = 0
        self.max_open = 0
        self._loop = None
        self._server = None
        self._thread = None

    # -- what was received ---------------------------------------------------
    def count(self, message_id):
        with self.lock:
            return sum(1 for m in self.messages if m["message_id"] == message_id)

    def received(self):
        with self.lock:
            return list(self.messages)

    def by_rcpt(self, address):
        with self.lock:
            return [m for m in self.messages if address in m["rcpt_tos"]]

    # -- running ---------------------------------------------------------------
    def _authenticator(self, server, session, envelope, mechanism, auth_data):
        ok = (isinstance(auth_data, LoginPassword) and self.auth is not None and
              self.auth.get(auth_data.login.decode()) == auth_data.password.decode())
        with self.lock:
            self.auth_attempts.append({"mechanism": mechanism,
                                       "login": auth_data.login.decode()
                                       if isinstance(auth_data, LoginPassword) else None,
                                       "ok": ok})
        return AuthResult(success=ok, handled=False)

    def _factory(self):
        kw = {}
        if self.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self.tls)
            kw["tls_context"] = ctx
            kw["require_starttls"] = self.require_starttls
        if self.auth is not None:
            kw["authenticator"] = self._authenticator
            kw["auth_required"] = True
            kw["auth_require_tls"] = bool(self.tls)
        return ScriptedSMTP(Handler(self), hostname="smtp.test", decode_data=False,
                            loop=self._loop, **kw)

    def start(self):
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                self._loop.create_server(self._factory, self.host, self.port))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._server.close()
            self._loop.run_until_complete(self._server.wait_closed())
            for t in asyncio.all_tasks(self._loop):
                t.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="smtp-server")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("SMTP server did not start")
        return self.port

    def stop(self):
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--slow-greeting", default="",
                    help="EVERY:MS: every EVERY-th connection waits MS before its greeting")
    ap.add_argument("--pipelining", action="store_true")
    a = ap.parse_args()
    slow = tuple(int(x) for x in a.slow_greeting.split(":")) if a.slow_greeting else None
    s = SmtpServer(a.host, a.port, slow_greeting=slow, pipelining=a.pipelining)
    print(s.start(), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        s.stop()


if __name__ == "__main__":
    main()
