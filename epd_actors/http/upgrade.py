"""Handing a connection's stream on after an upgrade request: its head is replayed.

Theory of operation
-------------------
When a request head asks to switch protocols (``Upgrade: websocket``) the HTTP
server stops serving the connection and gives its stream to whoever speaks the
new protocol.  h11 already consumed the head, and maybe bytes after it, so the
head is rebuilt (:func:`replayed_head`) and put in front of what h11 had
buffered; :class:`ReplayStream` returns those bytes first, then reads the
stream.  A library that reads the opening handshake itself (trio-websocket's
``wrap_server_stream``) then sees the connection as the client sent it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    import h11

__all__ = ["ReplayStream", "replayed_head"]


def replayed_head(request: h11.Request) -> bytes:
    """The request head as the client sent it, in substance (names keep their case)."""
    lines = [request.method + b" " + request.target + b" HTTP/1.1"]
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
