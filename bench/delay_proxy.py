# SPDX-License-Identifier: ISC
"""bench/delay_proxy.py: a TCP proxy that makes loopback round trips cost
what a network's do, for `make bench-email` (this kernel has no netem).

    python3 bench/delay_proxy.py --target HOST:PORT --rtt-ms RTT [--port N]

prints the port it listens on (127.0.0.1), then forwards every connection
to the target with one-way delay d = RTT / 2:

  * the connect: a real client's connect() returns after one round trip
    and the server accepts half a round trip later, so its greeting reaches
    the client 4 d after the connect started.  Here the upstream connect
    waits 3 d, and the greeting then travels d like every chunk;
  * every chunk read from one side is written to the other d after it was
    read, in order, in each direction independently (a chunk is held, not
    the stream: several chunks can be on the way at once, as on a wire).
    A close (EOF) travels the same way, after the data before it.

One asyncio loop in its own process, so its CPU is no one else's.  A
client that goes away, or a target that refuses, closes the other side.
"""
import argparse
import asyncio
import sys


class Pipe:
    """One direction of one connection: chunks due at read time + delay."""

    def __init__(self, loop, delay, writer):
        self.loop = loop
        self.delay = delay
        self.writer = writer
        self.queue = asyncio.Queue()

    async def read_from(self, reader):
        try:
            while True:
                data = await reader.read(65536)
                self.queue.put_nowait((self.loop.time() + self.delay, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            self.queue.put_nowait((self.loop.time() + self.delay, b""))

    async def write_out(self):
        try:
            while True:
                due, data = await self.queue.get()
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    await self.writer.drain()
                    return
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass


class DelayProxy:
    def __init__(self, target_host, target_port, rtt_ms):
        self.target = (target_host, target_port)
        self.one_way = rtt_ms / 2000.0

    async def handle(self, c_reader, c_writer):
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(3 * self.one_way)
            u_reader, u_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        up = Pipe(loop, self.one_way, u_writer)      # client -> relay
        down = Pipe(loop, self.one_way, c_writer)    # relay -> client
        try:
            await asyncio.gather(up.read_from(c_reader), up.write_out(),
                                 down.read_from(u_reader), down.write_out())
        finally:
            for w in (u_writer, c_writer):
                w.close()

    async def serve(self, port):
        server = await asyncio.start_server(self.handle, "127.0.0.1", port)
        print(server.sockets[0].getsockname()[1], flush=True)
        async with server:
            await server.serve_forever()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--rtt-ms", type=float, required=True, help="round trip time to add")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    host, _, port = a.target.rpartition(":")
    try:
        asyncio.run(DelayProxy(host, int(port), a.rtt_ms).serve(a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
