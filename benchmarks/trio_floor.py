"""The floor of a P/D relay in Python on Trio: a yardstick for the benchmarks, not a router.

It does only what every P/D HTTP relay must do for one request:

1. read the client's request (head and body) and parse its JSON;
2. send it to a prefill worker with ``stream: false``, ``max_tokens: 1`` and
   ``kv_transfer_params.do_remote_decode: true``, and parse P's JSON answer;
3. send the client's request with P's ``kv_transfer_params`` to a decode worker;
4. pass D's chunked event stream to the client byte for byte, one write per read
   (straight to the socket when the kernel takes it at once, as the router writes),
   walking the chunk sizes only to find the stream's end.

Keep-alive connections to the workers (one the worker closed while idle is not
reused: a relay that skipped that check would fail requests), round robin over
each pool.  Nothing else: no health checks, retries, deadlines, cancellation, limits, metrics,
validation, model check, token counting or usage, and a malformed request
simply drops its connection.  What it costs per request is what Python and
Trio cost for the I/O alone; the router's CPU beyond it is what the router's
own guarantees and layers cost.  ``run_router_overhead.py`` runs it as the
``trio-floor-pd`` scenario, beside the router and its peers::

    python benchmarks/trio_floor.py --port 9000 --prefill http://127.0.0.1:8101 \\
        --decode http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import signal
import sys
from urllib.parse import urlsplit

import trio

READ_BYTES = 65536
HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


class Dropped(Exception):
    """A peer closed its connection, or sent what this yardstick does not read."""


class Reader:
    """Buffered reads from one stream: up to a delimiter, or a number of bytes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def fill(self) -> None:
        data = await self.stream.receive_some(READ_BYTES)
        if not data:
            raise Dropped("end of stream")
        self.buffer += data

    async def until(self, delimiter: bytes) -> bytes:
        while (at := self.buffer.find(delimiter)) < 0:
            await self.fill()
        end = at + len(delimiter)
        taken = bytes(self.buffer[:end])
        del self.buffer[:end]
        return taken

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self.fill()
        taken = bytes(self.buffer[:size])
        del self.buffer[:size]
        return taken


async def send(stream: trio.SocketStream, data: bytes) -> None:
    """Write ``data``: what the kernel takes at once without the scheduler, the rest awaited."""
    try:
        sent = os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The first line and the lower-cased headers of a request or response head."""
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


class Upstream:
    """One worker: its address and its idle keep-alive connections."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.idle: list[Reader] = []

    async def post(self, path: str, body: bytes) -> tuple[Reader, dict[str, str]]:
        """Send one POST; return the connection's reader and the answer's headers."""
        reader = self._reusable() or Reader(await self._connect())
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        await send(reader.stream, head.encode("latin-1") + body)
        status, headers = parse_head(await reader.until(b"\r\n\r\n"))
        if " 200 " not in status + " ":
            raise Dropped(f"worker answered {status}")
        return reader, headers

    def _reusable(self) -> Reader | None:
        """An idle connection the worker has not closed (one readable while idle it has)."""
        while self.idle:
            reader = self.idle.pop()
            if not reader.stream.socket.is_readable():
                return reader
            reader.stream.socket.close()
        return None

    async def _connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.host, self.port)


async def relay_chunked(source: Reader, client: trio.SocketStream, head: bytes) -> None:
    """Pass a chunked body from ``source`` to ``client`` as read, up to its last chunk.

    ``head``, the client's response head, goes out with the first bytes of the body.
    """
    left = 0  # bytes of the current chunk (and its CRLF) still to pass
    pending = head + source.buffer
    source.buffer.clear()
    at = len(head)
    while True:
        while at < len(pending):
            if left:
                step = min(left, len(pending) - at)
                at += step
                left -= step
                continue
            line_end = pending.find(b"\r\n", at)
            if line_end < 0:
                break
            size = int(pending[at:line_end].split(b";")[0], 16)
            if size == 0:
                # The last chunk and the empty trailer that ends the body.
                end = pending.find(b"\r\n\r\n", at)
                if end >= 0:
                    await send(client, pending[: end + 4])
                    source.buffer += pending[end + 4 :]
                    return
                break
            at = line_end + 2
            left = size + 2
        # Everything up to ``at`` is whole; pass all read so far, keep the parse state.
        if at < len(pending) and not left:
            if at:
                await send(client, pending[:at])
            rest = pending[at:]
        else:
            await send(client, pending)
            rest = b""
        data = await source.stream.receive_some(READ_BYTES)
        if not data:
            raise Dropped("the decoder closed its stream")
        pending, at = rest + data, 0


class FloorRelay:
    """Round robin over the P and D workers; one task per client connection."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill = itertools.cycle([Upstream(url) for url in prefill])
        self.decode = itertools.cycle([Upstream(url) for url in decode])

    async def serve(self, client: trio.SocketStream) -> None:
        reader = Reader(client)
        try:
            while True:
                request_line, headers = parse_head(await reader.until(b"\r\n\r\n"))
                method, path = request_line.split(" ")[:2]
                if method == "GET":
                    await send(client, HEALTH)
                    continue
                body = await reader.exactly(int(headers.get("content-length", "0")))
                await self.relay(path, json.loads(body), client)
        except (Dropped, trio.BrokenResourceError, KeyError, ValueError):
            pass
        finally:
            await trio.aclose_forcefully(client)

    async def relay(self, path: str, request: dict[str, object], client: trio.SocketStream) -> None:
        prefill = next(self.prefill)
        ask = dict(request, stream=False, max_tokens=1)
        ask.pop("stream_options", None)
        ask["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        reader, headers = await prefill.post(path, json.dumps(ask).encode())
        answer = json.loads(await reader.exactly(int(headers["content-length"])))
        prefill.idle.append(reader)
        request["kv_transfer_params"] = answer["kv_transfer_params"]
        decode = next(self.decode)
        reader, _ = await decode.post(path, json.dumps(request).encode())
        await relay_chunked(reader, client, STREAM_HEAD)
        decode.idle.append(reader)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True, help="a P worker's URL")
    parser.add_argument("--decode", action="append", required=True, help="a D worker's URL")
    args = parser.parse_args()
    relay = FloorRelay(args.prefill, args.decode)
    # SIGTERM ends it as Ctrl-C does, so a profiler around it writes its output.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(functools.partial(trio.serve_tcp, relay.serve, args.port, host=args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
