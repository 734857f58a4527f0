"""Framing the pieces of a streamed HTTP/1.1 response body without h11's state machine.

A streamed response has no ``Content-Length``, so h11 frames its body as
chunked when the client speaks HTTP/1.1 or later, and by the connection's close
for HTTP/1.0 (it adds or leaves out ``Transfer-Encoding: chunked`` in the head
itself; RFC 9112, section 6).  Each ``h11.Data`` it frames costs about 3 µs of
state machine (``benchmarks/per_token_cost.py``), and a streamed response
sends one per token, so the pieces are framed here instead: h11 still writes
the head and the end of the body (``EndOfMessage``), which its state follows.

The caller must use the framer only between the head and the end of one
response, and never with an empty piece's meaning of "end" (an empty piece
frames to nothing, as in h11).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import h11

__all__ = ["body_framer"]


def body_framer(connection: h11.Connection) -> Callable[[bytes], bytes]:
    """How to frame a piece of the body of the response ``connection`` is sending.

    Decided as h11 decides for a body of unknown length: chunked for a client
    of HTTP/1.1 or later, the bytes as they are otherwise (close-delimited).
    """
    version = connection.their_http_version
    if version is not None and version >= b"1.1":
        return _chunk
    return _as_is


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def _as_is(data: bytes) -> bytes:
    return data
