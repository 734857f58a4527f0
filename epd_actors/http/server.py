"""The package's one HTTP/1.1 server shell over h11 and Trio.

Theory of operation
-------------------
:class:`HttpServer` serves connections (``serve`` on listeners, or
``handle_connection`` per stream).  Each connection is a
:class:`~.server_connection.ServerConnection` (h11, one reader task, bounded
reads and writes, linger on close) whose requests run one after another in
the shell's one request loop:

1. the request *head*, read under ``keep_alive_timeout_s`` (the idle time
   between requests; an idle connection closes silently, one that sent part
   of a head gets 408), bounded by ``max_header_bytes`` (h11's
   ``max_incomplete_event_size``: 431).  A head h11 cannot parse is answered
   400 and closes;
2. the *exchange*: the connection's :class:`Exchanges` answers the head.
   Servers given a :data:`Handler` get the shell's own exchanges: the *body*
   read in full under ``body_timeout_s`` (408) and bounded by
   ``max_body_bytes`` (413 for a larger declared ``Content-Length`` before any
   of it is read, or as soon as the bytes pass it, so a large body is never
   buffered; ``100 Continue`` first when the client waits for it), then the
   handler, called with the :class:`HttpRequest` and the request's
   :class:`Responder`: it returns an :class:`HttpResponse` (the shell writes
   it in one write) or streams one itself (:meth:`Responder.start`,
   :meth:`~Responder.send`, :meth:`~Responder.end`) and returns None.  A
   server given ``exchanges`` (the router's OpenAI front end) reads the body
   itself, after its own checks of the head, through the connection;
3. *keep-alive*: when both sides finished the exchange (and neither asked for
   ``connection: close``) the connection waits for the next request; bytes of
   a pipelined request wait inside h11.  An exchange may instead end HTTP by
   an *upgrade* (``ServerConnection.upgrade``): the stream, head replayed, goes
   to ``on_upgrade``.

Every connection is its own error boundary: an exception that escapes an
exchange is logged ("unexpected error") and answered with 500 when nothing
was sent yet (``Exchanges.failed``), and closes that connection, never the
server or another connection.  The shell's own error answers (400, 408,
413, 431, 500, and ``busy_response`` past ``max_connections``) are built by
``error_response`` (plain text unless the server is given another shape, e.g.
OpenAI's error body).

Cancellation: cancelling ``serve`` stops accepting and cancels every
connection; a connection's stream is always closed (forcefully, after the
linger) on the way out.  Backpressure: one request at a time per connection;
every write waits for the socket, at most ``write_timeout_s`` (then the
client counts as gone: :class:`ClientGone`); at most ``max_connections``
connections are served, more are refused at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Final, NoReturn, Protocol, TypeAlias

import h11
import trio

from .body import body_framer
from .server_connection import ClientGone, Refusal, ServerConnection, ServerLimits, whole_response

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ClientGone",
    "Exchanges",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "Refusal",
    "Responder",
    "ServerConnection",
    "ServerLimits",
    "plain_error",
]

logger = logging.getLogger(__name__)

TEXT: Final = "text/plain; charset=utf-8"
JSON: Final = "application/json"


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


def plain_error(status: int, message: str) -> HttpResponse:
    """The shell's default error answer: ``message`` as plain text."""
    return HttpResponse.text(status, message + "\n")


def _closing(response: HttpResponse) -> HttpResponse:
    """``response`` with ``connection: close`` added."""
    return HttpResponse(
        response.status,
        response.body,
        response.content_type,
        (*response.headers, ("connection", "close")),
    )


class Responder:
    """The answering side of one request: one whole response, or a streamed one.

    Writes go through the connection (:meth:`ServerConnection.write`): each
    waits for the socket, at most ``write_timeout_s``.
    """

    __slots__ = ("_conn", "_frame", "_head_only")

    def __init__(self, connection: ServerConnection, *, head_only: bool) -> None:
        self._conn = connection
        self._head_only = head_only
        self._frame = body_framer(connection.h11)

    @property
    def gone(self) -> bool:
        """The client was seen leaving (its EOF arrived)."""
        return self._conn.saw_eof

    @property
    def started(self) -> bool:
        """Whether the response head is out (an error can no longer be a status)."""
        return self._conn.started

    @property
    def finished(self) -> bool:
        """Whether the whole response has been written."""
        return self._conn.h11.our_state in (h11.DONE, h11.MUST_CLOSE)

    async def respond(self, response: HttpResponse) -> None:
        """Write ``response`` whole, in one write.

        Raises:
            ClientGone: the write failed or took longer than ``write_timeout_s``.
            RuntimeError: a response was already started.
        """
        if self.started:
            raise RuntimeError("a response was already started")
        headers = [("content-type", response.content_type), *response.headers]
        data = whole_response(
            self._conn.h11, response.status, headers, response.body, head_only=self._head_only
        )
        await self._conn.write(data)

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        """Write the head of a streamed response (chunked for HTTP/1.1 clients).

        Raises:
            ClientGone: as for :meth:`respond`.
            RuntimeError: a response was already started.
        """
        if self.started:
            raise RuntimeError("a response was already started")
        head = h11.Response(status_code=status, headers=list(headers))
        await self._conn.write(self._conn.h11.send(head) or b"")

    async def send(self, data: bytes) -> None:
        """Write one piece of a started response's body (nothing for ``HEAD``).

        Raises:
            ClientGone: as for :meth:`respond`.
        """
        if not self._head_only and data:
            await self._conn.write(self._frame(data))

    async def end(self) -> None:
        """End a started response's body.

        Raises:
            ClientGone: as for :meth:`respond`.
        """
        await self._conn.write(self._conn.h11.send(h11.EndOfMessage()) or b"")

    async def wait_disconnected(self) -> None:
        """Return once the client closed its side (then :attr:`gone` is true).

        Meant for a sibling task while the handler works, so that a client
        that leaves cancels the work.  The connection's reader sees the EOF;
        bytes that arrive meanwhile (a pipelined request) stay in h11 for the
        next exchange, at most ``max_pipelined_bytes`` of them (beyond, the
        client waits).

        Cancellation: safe; nothing received is lost.
        """
        await self._conn.wait_disconnected()


Handler: TypeAlias = Callable[[HttpRequest, "Responder"], Awaitable[HttpResponse | None]]
"""Answers one request: returns the response, or streams it through the responder and
returns None.  It may raise :class:`ClientGone` (from the responder) or anything else
(a bug: logged, 500 when nothing was sent, the connection closed)."""


class Exchanges(Protocol):
    """What answers the requests of one connection (made per connection, see ``HttpServer``).

    Each method is called in the connection's task; it may raise
    :class:`ClientGone` (the connection ends quietly) or anything else (the
    shell's error boundary: logged, then :meth:`failed`).  Cancellation:
    cancelling the connection cancels the call.  Backpressure: one call at a
    time per connection; the next head is read only once :meth:`answer` returned.
    """

    async def answer(self, head: h11.Request) -> None:
        """Answer the request ``head`` (reading its body through the connection)."""

    async def refuse(self, refusal: Refusal) -> None:
        """Answer a head the shell refused (400, 408, 431); the connection then closes."""

    async def failed(self) -> None:
        """Answer 500 after an unexpected error, nothing having been sent."""


class _WholeRequests:
    """The exchanges of a :data:`Handler`: each body read in full, then the handler."""

    __slots__ = ("_conn", "_handler", "_server")

    def __init__(self, server: HttpServer, handler: Handler, connection: ServerConnection) -> None:
        self._server = server
        self._handler = handler
        self._conn = connection

    async def answer(self, head: h11.Request) -> None:
        conn = self._conn
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers)
        declared = next((int(v) for k, v in headers if k == "content-length"), None)
        try:  # h11 checked the digits of a Content-Length
            body = await conn.read_body(conn.limits.max_body_bytes, declared=declared)
        except Refusal as exc:
            await self.refuse(exc)
            return
        request = HttpRequest(
            method=head.method.decode("latin-1"),
            target=head.target.decode("latin-1"),
            headers=headers,
            body=body,
        )
        responder = Responder(conn, head_only=head.method == b"HEAD")
        if not await self._answer(request, responder):
            conn.close_after = True

    async def _answer(self, request: HttpRequest, responder: Responder) -> bool:
        """Run the handler; whether the connection may serve another request."""
        server = self._server
        try:
            response = await self._handler(request, responder)
            if response is not None:
                await responder.respond(response)
        except ClientGone:
            raise
        except Exception:
            server.log.exception(
                "%s: the handler of %s %s failed", server.name, request.method, request.path
            )
            if not responder.started:
                await responder.respond(
                    _closing(server.error_response(500, "internal server error"))
                )
            return False
        if not responder.finished:
            server.log.error(
                "%s: %s %s was not answered in full", server.name, request.method, request.path
            )
            if not responder.started:
                answer = server.error_response(500, "the request was not answered")
                await responder.respond(_closing(answer))
            return False
        return True

    async def refuse(self, refusal: Refusal) -> None:
        self._conn.close_after = True
        if not self._conn.started:
            answer = self._server.error_response(refusal.status, refusal.message)
            await Responder(self._conn, head_only=False).respond(_closing(answer))

    async def failed(self) -> None:
        await self.refuse(Refusal(500, "internal server error"))


class HttpServer:
    """Serves connections (see the module docstring).

    Args:
        handler: answers each request, its body read in full (:data:`Handler`).
        limits: sizes and timeouts.
        exchanges: instead of ``handler``, makes each connection's
            :class:`Exchanges` (called with the connection, once per connection).
        error_response: builds the shell's own error answers from a status and a message.
        busy_response: the answer to a connection past ``max_connections``
            (None: it is closed without one).
        on_upgrade: takes the stream of a connection an exchange upgraded
            (``ServerConnection.upgrade``), head replayed; it owns the stream.
        name: names the server in logs.
        log: the logger of the connections' errors.
    """

    def __init__(
        self,
        handler: Handler | None = None,
        limits: ServerLimits | None = None,
        *,
        exchanges: Callable[[ServerConnection], Exchanges] | None = None,
        error_response: Callable[[int, str], HttpResponse] = plain_error,
        busy_response: HttpResponse | None = None,
        on_upgrade: Callable[[trio.abc.Stream], Awaitable[None]] | None = None,
        name: str = "http",
        log: logging.Logger = logger,
    ) -> None:
        if (handler is None) == (exchanges is None):
            raise ValueError("give a handler or exchanges, not both")
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.error_response = error_response
        self.busy_response = busy_response
        self.on_upgrade = on_upgrade
        self.name = name
        self.log = log
        self.connections = 0
        if exchanges is None:
            assert handler is not None
            exchanges = partial(_WholeRequests, self, handler)
        self._exchanges = exchanges

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
        Backpressure: at most ``max_connections`` connections; more are refused.
        """
        await trio.serve_listeners(
            self.handle_connection,
            list(listeners),
            handler_nursery=handler_nursery,
            task_status=task_status,
        )

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it closes, idles out, upgrades or breaks; never
        raises but cancellation.

        Cancellation: cancels the exchange under way; the stream is closed.
        Resource handling: the stream is closed on return (or given to ``on_upgrade``).
        """
        if self.connections >= self.limits.max_connections:
            self.log.warning(
                "%s: refusing a connection: %d already open", self.name, self.connections
            )
            await self._turn_away(stream)
            return
        self.connections += 1
        conn = ServerConnection(stream, self.limits)
        exchanges = self._exchanges(conn)
        try:
            await conn.run(partial(self._serve, conn, exchanges))
            if conn.upgrade is not None and self.on_upgrade is not None:
                await self.on_upgrade(conn.upgraded_stream())
        except ClientGone as exc:
            self.log.debug("%s: a client left: %s", self.name, exc)
        except Exception:
            self.log.exception("%s: unexpected error; closing the connection", self.name)
            conn.close_after = True
            if not conn.started:
                try:
                    await exchanges.failed()
                except (ClientGone, h11.LocalProtocolError):
                    self.log.debug("%s: could not send the 500", self.name)
        finally:
            self.connections -= 1
            await conn.close()

    async def _serve(self, conn: ServerConnection, exchanges: Exchanges) -> None:
        """The request loop: head, exchange, keep-alive."""
        while True:
            try:
                head = await conn.next_head()
            except Refusal as exc:
                conn.close_after = True
                await exchanges.refuse(exc)
                return
            if head is None:
                return
            await exchanges.answer(head)
            if not conn.reusable:
                return
            conn.h11.start_next_cycle()

    async def _turn_away(self, stream: trio.abc.Stream) -> None:
        try:
            if self.busy_response is not None:
                conn = ServerConnection(stream, self.limits)
                await Responder(conn, head_only=False).respond(_closing(self.busy_response))
        except ClientGone:
            self.log.debug("%s: a refused connection closed before its answer", self.name)
        finally:
            await trio.aclose_forcefully(stream)
