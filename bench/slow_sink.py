#!/usr/bin/python3
# SPDX-License-Identifier: ISC
"""bench/slow_sink.py: an HTTP sink that answers every request after a delay.

Used by bench/run.sh to hold many sends in flight at once (the "RSS with
1,000 sends in flight" figure).  Answers 200 {"id":"slow"} DELAY_MS after the
request arrived, keeps connections alive, and writes its peak number of
requests in progress to STATS_FILE (JSON) every half second and on exit.

    slow_sink.py PORT DELAY_MS STATS_FILE
"""
import asyncio
import json
import signal
import sys

PORT, DELAY, STATS = int(sys.argv[1]), int(sys.argv[2]) / 1000.0, sys.argv[3]
state = {"in_progress": 0, "peak": 0, "served": 0}
BODY = b'{"id":"slow"}'
RESP = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            state["in_progress"] += 1
            state["peak"] = max(state["peak"], state["in_progress"])
            try:
                await asyncio.sleep(DELAY)
            finally:
                state["in_progress"] -= 1
            writer.write(RESP)
            await writer.drain()
            state["served"] += 1
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


def dump():
    with open(STATS + ".tmp", "w") as f:
        json.dump(state, f)
    import os
    os.replace(STATS + ".tmp", STATS)


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", PORT, backlog=4096)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        while not stop.is_set():
            dump()
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
    dump()


asyncio.run(main())
