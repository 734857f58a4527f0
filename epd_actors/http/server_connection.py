"""The byte side of one server connection: h11, its reader task, bounded reads and writes.

Theory of operation
-------------------
:class:`ServerConnection` is what :class:`~.server.HttpServer` keeps per
connection and hands to the code that answers its requests:

* *one reader*: :meth:`ServerConnection.run` runs a reader task next to the
  request loop for as long as the connection is served.  It feeds what
  arrives to h11 and wakes the loop when that waits for bytes.  While a
  response is produced it keeps reading, so that the client's EOF is seen at
  once: it cancels the :attr:`~ServerConnection.response` scope (when one is
  set) and sets :attr:`~ServerConnection.saw_eof`.  At most
  ``max_pipelined_bytes`` of the client's next requests are buffered that
  way; beyond that it reads only when the loop asks.  One task per
  connection, not one per request: between two requests it stays parked in
  its read.
* *heads and bodies*: :meth:`~ServerConnection.next_head` reads a request head
  under ``keep_alive_timeout_s`` (a silent close when the connection idles
  out, 408 when part of a head had arrived, 431 past ``max_header_bytes``, 400
  for what h11 cannot parse); :meth:`~ServerConnection.read_body` refuses a
  declared ``Content-Length`` (as the caller read it) over its limit before
  reading (413), tells a
  client waiting for ``100 Continue`` to go on, and reads the body under
  ``body_timeout_s`` (408), counting (413 as soon as it passes the limit).
  Refusals are :class:`Refusal` (status and message): the caller answers them
  in its own error shape.
* *writes*: :meth:`~ServerConnection.write` hands the kernel what it takes at
  once (:class:`~epd_actors.transport.nowait.NowaitWriter`, not a checkpoint
  when it took everything) and awaits the rest for at most
  ``write_timeout_s``; a failed or slow write is :class:`ClientGone`.
  :attr:`~ServerConnection.writer` is that writer, for code that writes from
  other tasks between the connection's own writes.
* *the end*: an upgrade (:attr:`~ServerConnection.upgrade` set by the answering
  code) ends HTTP and :meth:`~ServerConnection.upgraded_stream` gives the
  stream on, head replayed (:mod:`.upgrade`); otherwise
  :meth:`~ServerConnection.close` says EOF and lingers up to ``linger_s``
  draining what the client still sends, so it reads the last answer instead
  of a reset, then closes the stream.

Cancellation: cancelling :meth:`~ServerConnection.run` cancels the reader
and the loop; nothing received is lost (it is in h11's buffer).
Backpressure: one reader, bounded read-ahead; every write waits for the
socket, bounded in time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Final

import h11
import trio

from .._groups import single_exception
from ..limits import RECEIVE_CHUNK_BYTES
from ..transport.nowait import NowaitWriter
from .upgrade import ReplayStream, replayed_head

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

__all__ = ["ClientGone", "Refusal", "ServerConnection", "ServerLimits", "whole_response"]

logger = logging.getLogger(__name__)

_CONTINUE: Final = h11.InformationalResponse(status_code=100, headers=[])


def whole_response(
    connection: h11.Connection,
    status: int,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    head_only: bool,
    reason: bytes = b"",
) -> bytes:
    """The bytes of one whole response through ``connection``, for one write.

    ``Content-Length`` is added, except on a 204, which has neither it nor a
    body (RFC 9110 8.6, 15.3.5); the answer to a ``HEAD`` (``head_only``) is
    the head a ``GET`` would get, its ``Content-Length`` included, and no
    body (RFC 9110 9.3.2).
    """
    if status == 204:
        head = h11.Response(status_code=status, headers=list(headers), reason=reason)
        return (connection.send(head) or b"") + (connection.send(h11.EndOfMessage()) or b"")
    sized = [*headers, ("content-length", str(len(body)))]
    data = connection.send(h11.Response(status_code=status, headers=sized, reason=reason)) or b""
    if body and not head_only:
        data += connection.send(h11.Data(data=body)) or b""
    return data + (connection.send(h11.EndOfMessage()) or b"")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Sizes (bytes) and timeouts (seconds) of one HTTP server.

    Attributes:
        max_header_bytes: largest request head (431 above).
        max_body_bytes: largest request body (413 above).
        keep_alive_timeout_s: idle time allowed before (and while sending) a head.
        body_timeout_s: time to receive one body (408 after).
        write_timeout_s: time one write may take before the client counts as gone.
        max_connections: connections served at once; more are refused at once.
        linger_s: on close, how long to drain what the client still sends so that
            it reads the last answer (0: close at once).
        receive_bytes: bytes asked of the stream per read.
        max_pipelined_bytes: bytes of the client's next requests read ahead while
            a request is answered.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 1 << 20
    keep_alive_timeout_s: float = 75.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_connections: int = 1024
    linger_s: float = 0.0
    receive_bytes: int = RECEIVE_CHUNK_BYTES
    max_pipelined_bytes: int = 64 * 1024

    @classmethod
    def of(cls, settings: object) -> ServerLimits:
        """The limits a server's settings name: each field of this class that
        ``settings`` has an attribute of the same name for, the defaults for the rest."""
        named = (field.name for field in fields(cls))
        return cls(**{name: getattr(settings, name) for name in named if hasattr(settings, name)})


class ClientGone(Exception):
    """The client closed, reset, or stopped reading (a write failed or timed out)."""


class Refusal(Exception):
    """A request the server refuses before its handler answers: a status and a message.

    After a refusal of a head or a body the connection cannot be reused.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ServerConnection:
    """One client connection's HTTP/1.1 state (see the module docstring).

    Attributes:
        stream: the connection's byte stream.
        h11: its state machine (server side).
        writer: every response byte goes through it.
        saw_eof: the client closed its side (or the stream broke).
        close_after: the connection ends after the current answer.
        upgrade: the request that switched protocols, ending HTTP.
        response: a scope the reader cancels when the client leaves (set it
            around work that a client leaving should cancel).
    """

    __slots__ = (
        "_arrived",
        "_eof",
        "_waiting",
        "_wanted",
        "close_after",
        "h11",
        "limits",
        "response",
        "saw_eof",
        "stream",
        "upgrade",
        "writer",
    )

    def __init__(self, stream: trio.abc.Stream, limits: ServerLimits) -> None:
        self.stream = stream
        self.limits = limits
        self.writer = NowaitWriter(stream)
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.saw_eof = False
        self.close_after = False
        self.upgrade: h11.Request | None = None
        self.response: trio.CancelScope | None = None
        self._arrived = trio.Event()  # set by the reader when it fed h11 (or saw EOF)
        self._wanted = trio.Event()  # set by the loop when it waits for bytes
        self._eof = trio.Event()  # set by the reader at EOF
        self._waiting = False  # the loop waits for bytes

    def __repr__(self) -> str:
        return f"<ServerConnection state={self.h11.states}>"

    @property
    def reusable(self) -> bool:
        """Whether the exchange ended so that the next request may follow."""
        return (
            self.upgrade is None
            and not self.close_after
            and self.h11.our_state is h11.DONE
            and self.h11.their_state is h11.DONE
        )

    @property
    def started(self) -> bool:
        """Whether a response head is out (an error can no longer be a status)."""
        return self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE)

    async def run(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` (the request loop) with the connection's reader task beside it.

        Cancellation: cancels both; the reader is cancelled when ``loop`` returns.
        """
        with single_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop, name=f"http-reader:{id(self):x}")
                try:
                    await loop()
                finally:
                    nursery.cancel_scope.cancel(reason="connection done")

    # -- reading

    async def next_head(self) -> h11.Request | None:
        """The next request head, or None when the connection should close quietly.

        Raises:
            Refusal: 400 (unparsable), 431 (too large), 408 (part of a head
                arrived, then the keep-alive time ran out).
        """
        with trio.move_on_after(self.limits.keep_alive_timeout_s):
            try:
                event = await self.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                text = "request head too large" if status == 431 else f"bad request: {exc}"
                raise Refusal(status, text) from None
            return event if isinstance(event, h11.Request) else None
        if self.h11.their_state is h11.IDLE and self.h11.trailing_data[0]:
            raise Refusal(408, "request head timed out")
        return None

    async def read_body(self, limit: int, *, declared: int | None = None) -> bytes:
        """The request body, at most ``limit`` bytes, within ``body_timeout_s``.

        ``declared`` is the request's ``Content-Length``, when the caller read
        it from the head: over ``limit``, the body is refused before any of it
        is read.  A client waiting for ``100 Continue`` is told to go on first
        (unless ``limit`` is 0: no body is wanted).

        Raises:
            Refusal: 413 (declared or sent beyond ``limit``), 408 (too slow),
                400 (malformed, or cut short by the client's EOF).
            ClientGone: the connection closed mid-body.
        """
        if declared is not None and declared > limit:
            raise Refusal(413, f"request body exceeds {limit} bytes")
        if limit and self.h11.they_are_waiting_for_100_continue:
            await self.write(self.h11.send(_CONTINUE) or b"")
        chunks: list[bytes] = []
        size = 0
        # The deadline is set now; a timeout scope is opened only to wait for
        # more bytes, which a body that came with its head never does.
        deadline = trio.current_time() + self.limits.body_timeout_s
        while True:
            try:
                event: object = self.h11.next_event()
                if event is h11.NEED_DATA:
                    with trio.move_on_at(deadline):
                        event = await self.next_event()
                    if event is h11.NEED_DATA:
                        raise Refusal(408, "request body timed out")
            except h11.RemoteProtocolError as exc:
                raise Refusal(400, f"malformed request body: {exc}") from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise Refusal(413, f"request body exceeds {limit} bytes")
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise ClientGone("connection closed while sending the body")

    def body_complete(self) -> bool:
        """Consume what is left of the request body if it is already buffered."""
        while self.h11.their_state is h11.SEND_BODY:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                return False
            if not isinstance(event, h11.Data | h11.EndOfMessage):
                return False
        return self.h11.their_state is h11.DONE

    async def next_event(self) -> object:
        """The next h11 event (never ``NEED_DATA``: waits for the reader until there is one)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._arrived = trio.Event()
            self._waiting = True
            self._wanted.set()
            try:
                await self._arrived.wait()
            finally:
                self._waiting = False

    async def wait_disconnected(self) -> None:
        """Return once the client closed its side (EOF seen by the reader).

        Cancellation: safe; nothing received is lost.
        """
        await self._eof.wait()

    async def _read_loop(self) -> None:
        limit = self.limits.max_pipelined_bytes
        while True:
            if len(self.h11.trailing_data[0]) > limit and not self._waiting:
                self._wanted = trio.Event()
                await self._wanted.wait()
                continue
            data = await self._receive()
            self.h11.receive_data(data)
            self._arrived.set()
            if not data:
                if self.response is not None:
                    self.response.cancel(reason="client disconnected")
                self._eof.set()
                return

    async def _receive(self) -> bytes:
        try:
            data = await self.stream.receive_some(self.limits.receive_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.saw_eof = True
        return bytes(data) if isinstance(data, bytearray) else data

    # -- writing

    async def send(self, *events: h11.Event) -> None:
        """Write ``events`` (h11 events of the response) in one write."""
        await self.write(b"".join(self.h11.send(event) or b"" for event in events))

    async def write(self, data: bytes) -> None:
        """Write ``data``: at once when the socket has room, else waiting for it.

        The awaited part (what the kernel did not take at once) is bounded by
        ``write_timeout_s``.  Not a checkpoint when the socket took it all.

        Raises:
            ClientGone: the write failed or was too slow (the connection ends).
        """
        try:
            written = self.writer.send_some_nowait(data)
        except trio.BrokenResourceError:
            self.close_after = True
            raise ClientGone("the client stopped reading") from None
        if written == len(data):
            return
        with trio.move_on_after(self.limits.write_timeout_s):
            try:
                await self.writer.send_all(data[written:])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close_after = True
                raise ClientGone("the client stopped reading") from None
            return
        self.close_after = True
        raise ClientGone(f"a write took longer than {self.limits.write_timeout_s:g}s")

    # -- the end

    def upgraded_stream(self) -> trio.abc.Stream:
        """The connection's stream, from the upgrade request's first byte on.

        Call once :meth:`run` returned with :attr:`upgrade` set: the reader
        task is gone, so what it had received is in h11's buffer, replayed
        after the rebuilt head.
        """
        assert self.upgrade is not None
        return ReplayStream(self.stream, replayed_head(self.upgrade) + self.h11.trailing_data[0])

    async def close(self) -> None:
        """Say EOF, let the client read the last answer, then close the stream.

        Cancellation: the linger is bounded by ``linger_s`` and ends at once
        when the connection's task is cancelled; the stream is closed either
        way, forcefully, without waiting.
        """
        try:
            if self.limits.linger_s > 0 and not self.saw_eof and self.upgrade is None:
                with trio.move_on_after(self.limits.linger_s):
                    await self._linger()
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        """Send EOF, then discard what the client still sends until it closes.

        Closing a TCP socket with unread input makes the kernel send a reset,
        which can destroy the answer before the client reads it (a 413 to a
        client still uploading): reading to EOF first avoids that.
        """
        try:
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()
            drained = 0
            while drained <= self.limits.max_body_bytes:
                data = await self.stream.receive_some(self.limits.receive_bytes)
                if not data:
                    return
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            logger.debug("connection reset while closing")
