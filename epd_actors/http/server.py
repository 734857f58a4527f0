"""One small HTTP/1.1 server shell over h11 and Trio, for the package's side servers.

Theory of operation
-------------------
:class:`HttpServer` serves connections (``serve`` on listeners, or
``handle_connection`` per stream); each connection runs its requests one
after another:

1. the request *head*, read under ``keep_alive_timeout_s`` (the idle time
   between requests; an idle connection closes silently), bounded by
   ``max_header_bytes`` (h11's ``max_incomplete_event_size``: 431).  A head
   h11 cannot parse is answered with h11's status hint (400) and closes;
2. the *body*, read in full under ``body_timeout_s`` (408) and bounded by
   ``max_body_bytes`` (413 for a larger declared ``Content-Length`` before any
   of it is read, or as soon as the bytes pass it, so a large body is never
   buffered); a client that sent ``Expect: 100-continue`` is told to go on
   first.  A client that leaves mid-body ends the connection;
3. the *handler* (:data:`Handler`), called with the :class:`HttpRequest` and
   the request's :class:`Responder`: it returns an :class:`HttpResponse`
   (the shell writes it in one ``send_all``) or streams one itself
   (:meth:`Responder.start`, :meth:`~Responder.send`, :meth:`~Responder.end`)
   and returns None;
4. *keep-alive*: when both sides finished the exchange (and neither asked for
   ``connection: close``) the connection waits for the next request; bytes of
   a pipelined request wait inside h11.

Every connection is its own error boundary: an exception a handler raises is
logged and answered with 500 when nothing was sent yet, and closes that
connection, never the server or another connection.  The shell's own error
answers (400, 408, 413, 431, 500) are built by ``error_response`` (plain
text unless the server is given another shape, e.g. OpenAI's error body).

Cancellation: cancelling ``serve`` stops accepting and cancels every
connection; a connection's stream is always closed (forcefully) on the way
out.  Backpressure: one request at a time per connection; every write waits
for the socket, at most ``write_timeout_s`` (then the client counts as
gone: :class:`ClientGone`); at most ``max_connections`` connections are
served, more are closed at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NoReturn, TypeAlias

import h11
import trio

from ..limits import RECEIVE_CHUNK_BYTES
from .body import body_framer

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ClientGone",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "Responder",
    "ServerLimits",
    "plain_error",
]

logger = logging.getLogger(__name__)

TEXT: Final = "text/plain; charset=utf-8"
JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Sizes (bytes) and timeouts (seconds) of one :class:`HttpServer`.

    Attributes:
        max_header_bytes: largest request head (431 above).
        max_body_bytes: largest request body (413 above).
        keep_alive_timeout_s: idle time allowed before (and while sending) a head.
        body_timeout_s: time to receive one body (408 after).
        write_timeout_s: time one write may take before the client counts as gone.
        max_connections: connections served at once; more are closed at once.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 1 << 20
    keep_alive_timeout_s: float = 75.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_connections: int = 1024


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request, its body read in full.

    Attributes:
        method: e.g. ``GET`` (as sent; methods are case-sensitive).
        target: the request target, query included.
        headers: ``(name, value)`` pairs, names lower-cased, in the order received.
        body: the whole body (``b""`` when there is none).
    """

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def path(self) -> str:
        """The target without its query."""
        return self.target.partition("?")[0]

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), if any."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A whole response; ``content-length`` is added by the shell.

    Attributes:
        status: the status code.
        body: the body (not sent for ``HEAD``).
        content_type: the ``content-type`` header.
        headers: further ``(name, value)`` headers (``connection: close`` ends
            the connection after this answer).
    """

    status: int
    body: bytes = b""
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(
        cls, status: int, obj: object, headers: Sequence[tuple[str, str]] = ()
    ) -> HttpResponse:
        """``obj`` as compact JSON."""
        body = json.dumps(obj, separators=(",", ":")).encode()
        return cls(status, body, JSON, tuple(headers))

    @classmethod
    def text(
        cls,
        status: int,
        text: str,
        content_type: str = TEXT,
        headers: Sequence[tuple[str, str]] = (),
    ) -> HttpResponse:
        """``text`` encoded as UTF-8."""
        return cls(status, text.encode(), content_type, tuple(headers))


class ClientGone(Exception):
    """The client closed, reset, or stopped reading (a write failed or timed out)."""


def plain_error(status: int, message: str) -> HttpResponse:
    """The shell's default error answer: ``message`` as plain text."""
    return HttpResponse.text(status, message + "\n")


class Responder:
    """The answering side of one request: one whole response, or a streamed one.

    Attributes:
        gone: the client was seen leaving (:meth:`wait_disconnected` returned).
    """

    __slots__ = ("_frame", "_h11", "_head_only", "_limits", "_stream", "gone")

    def __init__(
        self,
        stream: trio.abc.Stream,
        connection: h11.Connection,
        limits: ServerLimits,
        *,
        head_only: bool,
    ) -> None:
        self._stream = stream
        self._h11 = connection
        self._limits = limits
        self._head_only = head_only
        self._frame = body_framer(connection)
        self.gone = False

    @property
    def started(self) -> bool:
        """Whether the response head is out (an error can no longer be a status)."""
        return self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE)

    @property
    def finished(self) -> bool:
        """Whether the whole response has been written."""
        return self._h11.our_state in (h11.DONE, h11.MUST_CLOSE)

    async def respond(self, response: HttpResponse) -> None:
        """Write ``response`` whole, in one write.

        Raises:
            ClientGone: the write failed or took longer than ``write_timeout_s``.
            RuntimeError: a response was already started.
        """
        if self.started:
            raise RuntimeError("a response was already started")
        headers = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
            *response.headers,
        ]
        data = self._h11.send(h11.Response(status_code=response.status, headers=headers)) or b""
        if response.body and not self._head_only:
            data += self._h11.send(h11.Data(data=response.body)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        await self._write(data)

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        """Write the head of a streamed response (chunked for HTTP/1.1 clients).

        Raises:
            ClientGone: as for :meth:`respond`.
            RuntimeError: a response was already started.
        """
        if self.started:
            raise RuntimeError("a response was already started")
        head = h11.Response(status_code=status, headers=list(headers))
        await self._write(self._h11.send(head) or b"")

    async def send(self, data: bytes) -> None:
        """Write one piece of a started response's body (nothing for ``HEAD``).

        Raises:
            ClientGone: as for :meth:`respond`.
        """
        if not self._head_only and data:
            await self._write(self._frame(data))

    async def end(self) -> None:
        """End a started response's body.

        Raises:
            ClientGone: as for :meth:`respond`.
        """
        await self._write(self._h11.send(h11.EndOfMessage()) or b"")

    async def wait_disconnected(self) -> None:
        """Return once the client closed its side (setting :attr:`gone`).

        Meant for a sibling task while the handler works, so that a client
        that leaves cancels the work.  Bytes that arrive meanwhile (a
        pipelined request) stay in h11 for the next exchange; past
        ``max_header_bytes`` of them, reading stops (the client waits) and
        this waits until cancelled.

        Cancellation: safe; nothing received is lost.
        """
        while len(self._h11.trailing_data[0]) <= self._limits.max_header_bytes:
            data = await _receive(self._stream)
            self._h11.receive_data(data)
            if not data:
                self.gone = True
                return
        await trio.sleep_forever()

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        with trio.move_on_after(self._limits.write_timeout_s):
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone("the client went away") from None
            return
        raise ClientGone(f"a write took longer than {self._limits.write_timeout_s:g} s")


Handler: TypeAlias = Callable[[HttpRequest, "Responder"], Awaitable[HttpResponse | None]]
"""Answers one request: returns the response, or streams it through the responder and
returns None.  It may raise :class:`ClientGone` (from the responder) or anything else
(a bug: logged, 500 when nothing was sent, the connection closed)."""


class _Refusal(Exception):
    """A request the shell answers itself (status and message), then closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServer:
    """Serves connections with one handler (see the module docstring).

    Args:
        handler: answers each request (:data:`Handler`).
        limits: sizes and timeouts.
        error_response: builds the shell's own error answers from a status and a message.
        name: names the server in logs.
    """

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits | None = None,
        *,
        error_response: Callable[[int, str], HttpResponse] = plain_error,
        name: str = "http",
    ) -> None:
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.error_response = error_response
        self.name = name
        self.connections = 0

    def __repr__(self) -> str:
        return f"<HttpServer {self.name} connections={self.connections}>"

    async def serve(
        self,
        listeners: Sequence[trio.SocketListener],
        *,
        handler_nursery: trio.Nursery | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Serve ``listeners`` until cancelled; reports the listeners once accepting.

        Cancellation: stops accepting and cancels every connection.
        Backpressure: at most ``max_connections`` connections; more are closed.
        """
        await trio.serve_listeners(
            self.handle_connection,
            list(listeners),
            handler_nursery=handler_nursery,
            task_status=task_status,
        )

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it closes, idles out or breaks; never raises but
        cancellation.

        Resource handling: the stream is closed on return.
        """
        if self.connections >= self.limits.max_connections:
            logger.warning(
                "%s: refusing a connection: %d already open", self.name, self.connections
            )
            await trio.aclose_forcefully(stream)
            return
        self.connections += 1
        try:
            await self._serve(stream)
        except ClientGone as exc:
            logger.debug("%s: a client left: %s", self.name, exc)
        except Exception:
            logger.exception("%s: a connection failed", self.name)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)

    async def _serve(self, stream: trio.abc.Stream) -> None:
        limits = self.limits
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        while True:
            event: object = None  # stays None when the connection idles out
            try:
                with trio.move_on_after(limits.keep_alive_timeout_s):
                    event = await _next_event(stream, connection)
                if not isinstance(event, h11.Request):
                    return
                body = await self._read_body(stream, connection, event)
            except h11.RemoteProtocolError as exc:
                await self._refuse(stream, connection, exc.error_status_hint, f"bad request: {exc}")
                return
            except _Refusal as exc:
                await self._refuse(stream, connection, exc.status, str(exc))
                return
            if body is None:
                return  # the client left mid-body
            request = HttpRequest(
                method=event.method.decode("latin-1"),
                target=event.target.decode("latin-1"),
                headers=tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers),
                body=body,
            )
            responder = Responder(stream, connection, limits, head_only=event.method == b"HEAD")
            if not await self._answer(request, responder):
                return
            if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                return
            connection.start_next_cycle()

    async def _answer(self, request: HttpRequest, responder: Responder) -> bool:
        """Run the handler; whether the connection may serve another request."""
        try:
            response = await self.handler(request, responder)
            if response is not None:
                await responder.respond(response)
        except ClientGone:
            raise
        except Exception:
            logger.exception(
                "%s: the handler of %s %s failed", self.name, request.method, request.path
            )
            if not responder.started:
                await responder.respond(self._closing(500, "internal server error"))
            return False
        if not responder.finished:
            logger.error(
                "%s: %s %s was not answered in full", self.name, request.method, request.path
            )
            if not responder.started:
                await responder.respond(self._closing(500, "the request was not answered"))
            return False
        return True

    async def _read_body(
        self, stream: trio.abc.Stream, connection: h11.Connection, request: h11.Request
    ) -> bytes | None:
        limit = self.limits.max_body_bytes
        for name, value in request.headers:
            if name == b"content-length" and int(value) > limit:  # h11 checked the digits
                raise _Refusal(413, f"the request body exceeds {limit} bytes")
        if connection.they_are_waiting_for_100_continue:
            go_on = h11.InformationalResponse(status_code=100, headers=[])
            await Responder(stream, connection, self.limits, head_only=False)._write(
                connection.send(go_on) or b""
            )
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.body_timeout_s):
            while True:
                event = await _next_event(stream, connection)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > limit:
                        raise _Refusal(413, f"the request body exceeds {limit} bytes")
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks)
                else:
                    return None
        raise _Refusal(408, "the request body timed out")

    async def _refuse(
        self, stream: trio.abc.Stream, connection: h11.Connection, status: int, message: str
    ) -> None:
        responder = Responder(stream, connection, self.limits, head_only=False)
        if responder.started:
            return
        await responder.respond(self._closing(status, message))

    def _closing(self, status: int, message: str) -> HttpResponse:
        response = self.error_response(status, message)
        return HttpResponse(
            response.status,
            response.body,
            response.content_type,
            (*response.headers, ("connection", "close")),
        )


async def _next_event(stream: trio.abc.Stream, connection: h11.Connection) -> object:
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await _receive(stream))


async def _receive(stream: trio.abc.Stream) -> bytes:
    """More bytes from the client; ``b""`` at EOF or when the stream broke."""
    try:
        return bytes(await stream.receive_some(RECEIVE_CHUNK_BYTES))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""
