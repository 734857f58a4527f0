"""WebSocket upgrades on the HTTP port: recognise the request and hand its stream over.

Theory of operation
-------------------
The HTTP front end reads every request head with h11.  When a head asks for
``Upgrade: websocket`` on the WebSocket path, the connection stops serving
HTTP (its reader task is cancelled, which in Trio loses no byte already
received) and gives the socket to the WebSocket server.  trio-websocket's
``wrap_server_stream`` reads the opening handshake from the stream itself, so
the head h11 already consumed is rebuilt (:func:`replayed_head`) and put in
front of whatever h11 had buffered after it; :class:`ReplayStream` returns
those bytes first, then reads the socket.  wsproto then validates the
handshake exactly as on the separate WebSocket listener (a bad key, version
or missing ``Connection: Upgrade`` is refused there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    import h11


def wants_websocket(method: str, headers: dict[str, str]) -> bool:
    """Whether a request head asks to switch to the WebSocket protocol."""
    if method != "GET":
        return False
    protocols = {item.strip().lower() for item in headers.get("upgrade", "").split(",")}
    return "websocket" in protocols


def replayed_head(request: h11.Request) -> bytes:
    """The request head as the client sent it, in substance (names keep their case)."""
    lines = [b"GET " + request.target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers.raw_items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class ReplayStream(trio.abc.Stream):
    """A stream that returns ``prefix`` before what ``transport_stream`` receives.

    Args:
        transport_stream: the connection (TCP or TLS); closed with this one.
        prefix: bytes already read from it, to be received again.

    Cancellation and backpressure are those of the wrapped stream; the prefix
    is returned without waiting, in pieces of at most ``max_bytes``.
    """

    def __init__(self, transport_stream: trio.abc.Stream, prefix: bytes) -> None:
        self.transport_stream = transport_stream
        self._prefix = prefix

    def __repr__(self) -> str:
        return f"<ReplayStream of {self.transport_stream!r}, {len(self._prefix)}B to replay>"

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            await trio.lowlevel.checkpoint()
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            return data
        return bytes(await self.transport_stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.transport_stream.aclose()


def stream_peer(stream: trio.abc.Stream) -> str:
    """``host:port`` of the client behind ``stream`` (TCP, TLS or replayed), or ``?``."""
    inner: object = stream
    while not isinstance(inner, trio.SocketStream):
        inner = getattr(inner, "transport_stream", None)
        if inner is None:
            return "?"
    try:
        peer = inner.socket.getpeername()
    except OSError:  # already reset
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
