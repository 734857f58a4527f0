"""The floor of a P/D relay in Python on Trio: a yardstick for the benchmarks, not a router.

It does only what every P/D HTTP relay must do for one request:

1. read the client's request (head and body) and parse its JSON;
2. send it to a prefill worker with ``stream: false``, ``max_tokens: 1`` and
   ``kv_transfer_params.do_remote_decode: true``, and parse P's JSON answer;
3. send the client's request with P's ``kv_transfer_params`` to a decode worker;
4. pass D's chunked event stream to the client byte for byte, one write per read
   (straight to the socket when the kernel takes it at once, as the router writes),
   walking the chunk sizes only to find the stream's end.

With ``--hub``, one task reads every D stream, as the router's read hub does
(``epd_actors/transport/read_hub.py``): their sockets sit in a level-triggered
``epoll`` set of its own, which Trio watches as one descriptor, and each pass
reads every readable stream once and writes what it read to its client, in
that task; a client write that the kernel does not take at once hands the
stream back to its request's task, which finishes the write and hands it over
again.  That is what a Trio relay's per-token I/O costs without a task
wake-up per stream and token.

Keep-alive connections to the workers (one the worker closed while idle is not
reused: a relay that skipped that check would fail requests), round robin over
each pool.  Nothing else: no health checks, retries, deadlines, cancellation, limits, metrics,
validation, model check, token counting or usage, and a malformed request
simply drops its connection.  What it costs per request is what Python and
Trio cost for the I/O alone; the router's CPU beyond it is what the router's
own guarantees and layers cost.  ``run_router_overhead.py`` runs it as the
``trio-floor-pd`` scenario, beside the router and its peers::

    python benchmarks/trio_floor.py --port 9000 --prefill http://127.0.0.1:8101 \\
        --decode http://127.0.0.1:8102 [--hub]

(``trio-floor-hub-pd`` with ``--hub``.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import select
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


class ChunkedWalk:
    """Where a chunked body's framing stands, across reads: sizes only, the bytes pass as read."""

    def __init__(self) -> None:
        self.left = 0  # bytes of the current chunk (and its CRLF) still to pass
        self.rest = b""  # a chunk-size line or the last chunk's trailer, not whole yet

    def take(self, data: bytes) -> tuple[bytes, bytes | None]:
        """What may pass now of the bytes held back and ``data``; and, once the body
        ended (its last chunk and empty trailer passed), the bytes after it (else None)."""
        pending = self.rest + data if self.rest else data
        at, left, size_of = 0, self.left, len(pending)
        while at < size_of:
            if left:
                step = min(left, size_of - at)
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
                    self.left, self.rest = 0, b""
                    return pending[: end + 4], pending[end + 4 :]
                break
            at = line_end + 2
            left = size + 2
        self.left = left
        # Everything up to ``at`` is whole; an incomplete line is held back.
        if at < size_of and not left:
            self.rest = pending[at:]
            return pending[:at], None
        self.rest = b""
        return pending, None


async def relay_chunked(source: Reader, client: trio.SocketStream, head: bytes) -> None:
    """Pass a chunked body from ``source`` to ``client`` as read, up to its last chunk.

    ``head``, the client's response head, goes out with the first bytes of the body.
    """
    walk = ChunkedWalk()
    data = bytes(source.buffer)
    source.buffer.clear()
    while True:
        out, after = walk.take(data)
        out, head = head + out, b""
        if after is not None:
            await send(client, out)
            source.buffer += after
            return
        if out:
            await send(client, out)
        data = await source.stream.receive_some(READ_BYTES)
        if not data:
            raise Dropped("the decoder closed its stream")


class HubStream:
    """One D stream the hub reads: its source, its client's socket, and how it stands."""

    def __init__(self, source: Reader, client: trio.SocketStream, walk: ChunkedWalk) -> None:
        self.source = source
        self.walk = walk
        self.client_fd = client.socket.fileno()
        self.woken = trio.Event()
        self.unsent = b""  # what the client's socket did not take: the request's task sends it
        self.ended = False
        self.failure: Exception | None = None


class ReadHub:
    """One task reads every D stream (``--hub``): see the module docstring."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.streams: dict[int, HubStream] = {}

    async def run(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self.epoll.fileno())
            for fd, _ in self.epoll.poll(0):
                stream = self.streams.get(fd)
                if stream is not None:
                    self._pass(fd, stream)

    def _pass(self, fd: int, stream: HubStream) -> None:
        """Read ``stream`` once and write what it read to its client, in the hub's task."""
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._hand_back(fd, stream, failure=Dropped(f"reading the decoder: {exc}"))
            return
        if not data:
            self._hand_back(fd, stream, failure=Dropped("the decoder closed its stream"))
            return
        out, after = stream.walk.take(data)
        if after is not None:
            stream.ended = True
            stream.source.buffer += after
        try:
            sent = os.write(stream.client_fd, out) if out else 0
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._hand_back(fd, stream, failure=Dropped(f"writing to the client: {exc}"))
            return
        if sent < len(out) or stream.ended:
            stream.unsent = out[sent:]
            self._hand_back(fd, stream)

    def _hand_back(self, fd: int, stream: HubStream, failure: Exception | None = None) -> None:
        self.epoll.unregister(fd)
        del self.streams[fd]
        stream.failure = failure
        stream.woken.set()

    async def relay(self, source: Reader, client: trio.SocketStream, head: bytes) -> None:
        """What :func:`relay_chunked` does, with the hub reading the body after its first bytes."""
        walk = ChunkedWalk()
        out, after = walk.take(bytes(source.buffer))
        source.buffer.clear()
        await send(client, head + out)
        if after is not None:
            source.buffer += after
            return
        fd = source.stream.socket.fileno()
        while True:
            stream = HubStream(source, client, walk)
            self.streams[fd] = stream
            self.epoll.register(fd, select.EPOLLIN)
            try:
                await stream.woken.wait()
            finally:
                if fd in self.streams:  # cancelled while the hub had it
                    self.epoll.unregister(fd)
                    del self.streams[fd]
            if stream.failure is not None:
                raise stream.failure
            if stream.unsent:
                await client.send_all(stream.unsent)
            if stream.ended:
                return


class FloorRelay:
    """Round robin over the P and D workers; one task per client connection."""

    def __init__(self, prefill: list[str], decode: list[str], hub: ReadHub | None = None) -> None:
        self.prefill = itertools.cycle([Upstream(url) for url in prefill])
        self.decode = itertools.cycle([Upstream(url) for url in decode])
        self.hub = hub

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
        if self.hub is None:
            await relay_chunked(reader, client, STREAM_HEAD)
        else:
            await self.hub.relay(reader, client, STREAM_HEAD)
        decode.idle.append(reader)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True, help="a P worker's URL")
    parser.add_argument("--decode", action="append", required=True, help="a D worker's URL")
    parser.add_argument("--hub", action="store_true", help="one task reads every D stream")
    args = parser.parse_args()
    hub = ReadHub() if args.hub else None
    relay = FloorRelay(args.prefill, args.decode, hub)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            if hub is not None:
                nursery.start_soon(hub.run)
            await trio.serve_tcp(relay.serve, args.port, host=args.host)

    # SIGTERM ends it as Ctrl-C does, so a profiler around it writes its output.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
