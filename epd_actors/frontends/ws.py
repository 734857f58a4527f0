"""The WebSocket front end: many concurrent generations per connection (trio-websocket).

Theory of operation
-------------------
:func:`serve_ws` accepts TCP connections with ``trio.serve_listeners`` and
gives each to :meth:`WsServer.handle_stream`, the per-connection error
boundary (the HTTP front end also hands it the connections that ask for an
upgrade on its port, :mod:`.ws_upgrade`): it runs trio-websocket's handshake
(``wrap_server_stream``: its reader task parses the request) and
:meth:`WsServer.handle_request`, which refuses a wrong path (404) or a missing
or wrong API key (401) and otherwise accepts and serves the connection with a
:class:`WsConnection`. Whatever fails there, in our code or in
trio-websocket's tasks (a reset in the middle of the handshake, bytes that are not
a handshake, a header wsproto cannot decode), ends that connection only.
docs/websocket.md defines the messages.

The messages themselves (parsing and building them) live in
:mod:`.ws_messages`; this module does the I/O.

A connection owns one nursery holding three kinds of task:

* the *reader* (the handler task itself) takes client messages one at a time,
  parses each into a :data:`ClientMessage` (:func:`parse_client_message`;
  anything invalid is answered with an ``error`` and the connection stays
  open) and acts on it: ``generate`` registers the id and starts a generation
  task, ``cancel`` cancels that task's scope, ``ping`` is answered ``pong``;
* one *generation task* per live id, under its own cancel scope: it parses
  the OpenAI body with :mod:`epd_actors.openai.schema` (exactly as the HTTP front end
  does), loads pending media, runs ``app.generate`` and turns its events into
  ``delta`` messages and one terminal ``done`` / ``error`` / ``cancelled``;
* one *writer* that sends the messages of all the others, in order, from a
  bounded channel (each producer holds its own clone of the send side).

Backpressure: a generation task takes every delta that is already waiting
(``receive_nowait``) and merges them into one message before it puts that
message on the writer's channel.  When the client reads slowly, the writer
waits on the socket, the channel fills, the generation tasks wait on it, and
the router's bounded event channels make the engines wait in turn; only this
connection's streams slow down.  The reader also waits when the channel is
full (its ``pong`` and ``error`` answers go through it), so a client that does
not read also stops being read.

Cancellation: a ``cancel`` message, or the socket closing, cancels
generation scopes; leaving ``app.generate`` is what cancels the request and
makes the router abort its workers (shielded and bounded there).

Errors are mapped once, by :func:`~epd_actors.openai.errors.error_response`; the front end's own
refusals are :class:`WsMessageError` (an ``HttpError`` whose status is unused).
"""

from __future__ import annotations

import hmac
import logging
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Final, NoReturn, Protocol
from urllib.parse import parse_qs

import trio
from trio_websocket import ConnectionClosed, Endpoint, wrap_server_stream

from ..errors import ActorCrashed, ConfigError, EpdError, Overloaded, Unauthorized
from ..openai.body_checks import unknown_model
from ..openai.coalescing import check_stream_coalescing
from ..openai.errors import HttpError
from ..openai.fields import STRICT_FIELDS, FieldPolicy
from ..openai.format import compact_json
from ..openai.media import MediaLimits
from ..openai.schema import parse_chat_completion, parse_completion
from ..request import DeltaEvent, DoneEvent, ErrorEvent
from .media_fetch import open_allowed_fetcher, resolve_media
from .ws_messages import (
    PONG,
    CancelMessage,
    GenerateMessage,
    PingMessage,
    WsMessageError,
    batch_messages,
    cancelled_message,
    delta_messages,
    done_message,
    error_message,
    error_payload,
    parse_client_message,
)
from .ws_upgrade import stream_peer

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from trio_websocket import WebSocketConnection, WebSocketRequest

    from ..handoff import HandoffReceiver
    from ..openai.schema import ParsedRequest
    from ..request import GenerationEvent, GenerationRequest
    from .media_fetch import MediaFetcher

logger = logging.getLogger(__name__)

MIB: Final = 1024 * 1024

_PEER_GONE: Final = (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError)
"""How a connection ends when its client resets or closes it at any point."""

WS_STREAM_OUTCOMES: Final = ("done", "error", "cancelled", "closed", "refused")
"""How a generation ends, as :attr:`WsServer.streams` counts it: its ``done`` or
``error`` message sent, ``cancelled`` by the client's ``cancel``, its
connection ``closed`` before its terminal message went out, or ``refused``
before it started (a duplicate id, or the connection's ``max_generations``)."""


class WsApp(Protocol):
    """What the WebSocket front end needs: a router, or anything that generates."""

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[HandoffReceiver[GenerationEvent]]: ...


@dataclass(frozen=True, slots=True)
class WsSettings:
    """Limits, timeouts and keys of the WebSocket front end (docs/websocket.md).

    Attributes:
        path: the only accepted handshake path (other paths: 404).
        api_keys: accepted keys (``Authorization: Bearer`` or ``?api_key=``);
            empty = open.
        models: model names a request may name; empty = any.
        max_message_bytes: largest client message, as ``len()`` of its text
            (characters); a larger one closes the connection with code 1009.
        max_generations: generations one connection may run at once; one more
            is refused with ``overloaded``.
        handshake_timeout_s: time for the client to complete the opening
            handshake (seconds).
        idle_timeout_s: a connection with no generation running and no client
            message for this long is closed (code 1000, reason ``idle timeout``;
            seconds).
        close_timeout_s: time the closing handshake may take (seconds).
        outgoing_buffer: server messages waiting for the writer (messages).
            Each holds several merged deltas; a full buffer blocks this
            connection's generations, which is the backpressure.
        incoming_buffer: client messages trio-websocket buffers before it stops
            reading the socket (messages).
        media: media limits and the URL/path allow-list (as for HTTP).
        fields: what to do with request fields the router does not know (as for HTTP).
        stream_coalescing: ``ready`` (merge the deltas already queued into one
            message) or ``off`` (one message per delta); as for HTTP.
    """

    path: str = "/v1/ws"
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    models: tuple[str, ...] = ()
    max_message_bytes: int = 48 * MIB
    max_generations: int = 64
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    close_timeout_s: float = 5.0
    outgoing_buffer: int = 16
    incoming_buffer: int = 4
    media: MediaLimits = field(default_factory=MediaLimits)
    fields: FieldPolicy = STRICT_FIELDS
    stream_coalescing: str = "ready"

    def __post_init__(self) -> None:
        check_stream_coalescing(self.stream_coalescing, key="server.stream_coalescing")
        if not self.path.startswith("/"):
            raise ConfigError(f"ws.path must start with '/', got {self.path!r}")
        for name in ("max_message_bytes", "max_generations", "outgoing_buffer", "incoming_buffer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ws.{name} must be >= 1")
        for name in ("handshake_timeout_s", "idle_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or math.isnan(value):
                raise ConfigError(f"ws.{name} must be a positive number, got {value!r}")


# ---------------------------------------------------------------- server


@dataclass(frozen=True, slots=True)
class WsConnectionStatistics:
    """One connection's counters.

    Attributes:
        generations: generations running now.
        messages_received / messages_sent: frames each way.
        deltas_merged: router deltas that went out merged into another's message.
        outgoing_buffered / outgoing_peak: the writer channel now, and its peak.
        deltas_direct: router deltas queued for the socket by the task that
            produced them, while their generation's task waited.
    """

    generations: int
    messages_received: int
    messages_sent: int
    deltas_merged: int
    outgoing_buffered: int
    outgoing_peak: int
    deltas_direct: int = 0


@dataclass(frozen=True, slots=True)
class WsServerStatistics:
    """The server's counters; ``connections`` has one entry per open connection."""

    accepted_total: int
    rejected_total: int
    connections: tuple[WsConnectionStatistics, ...]


async def serve_ws(
    app: WsApp,
    host: str | None,
    port: int,
    *,
    settings: WsSettings | None = None,
    handler_nursery: trio.Nursery | None = None,
    listeners: list[trio.SocketListener] | None = None,
    task_status: trio.TaskStatus[WsServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the WebSocket API on ``host:port`` until cancelled.

    Args:
        app: the router, or anything with ``generate(request)``.
        host: the interface to bind (None: all).
        port: the port (0: any free one; see :attr:`WsServer.port`).
        settings: limits, timeouts and keys (defaults: :class:`WsSettings`).
        handler_nursery: where connection tasks run (default: an internal one).
        listeners: accept on these (already listening) instead of binding
            ``host:port``.
        task_status: reports the :class:`WsServer` once accepting.

    Cancellation: cancelling stops accepting and cancels every connection;
    their generations are cancelled and their workers told to abort.
    Backpressure: per connection, see the module docstring; at most
    ``settings.max_generations`` generations per connection.
    Resource handling: an httpx client for media URLs exists only when the
    media policy allows URLs, for the life of the server.
    """
    settings = settings or WsSettings()
    async with open_allowed_fetcher(settings.media) as fetcher:
        await _serve(
            WsServer(app, settings, fetcher=fetcher),
            host,
            port,
            handler_nursery,
            task_status,
            listeners,
        )


async def _serve(
    server: WsServer,
    host: str | None,
    port: int,
    handler_nursery: trio.Nursery | None,
    task_status: trio.TaskStatus[WsServer],
    listeners: list[trio.SocketListener] | None = None,
) -> NoReturn:
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        server.listeners = await nursery.start(
            partial(
                trio.serve_listeners,
                server.handle_stream,
                listeners,
                handler_nursery=handler_nursery,
            )
        )
        task_status.started(server)
        await trio.sleep_forever()
    raise AssertionError("serve_listeners returned")


class WsServer:
    """Serves WebSocket connections for one app; :meth:`handle_stream` per TCP connection.

    Args:
        app: what generations run against.
        settings: limits, timeouts and keys.
        fetcher: loads allowed media URLs (None: URL media are refused).
    """

    def __init__(
        self, app: WsApp, settings: WsSettings, *, fetcher: MediaFetcher | None = None
    ) -> None:
        self.app = app
        self.settings = settings
        self.fetcher = fetcher
        self.listeners: list[trio.SocketListener] = []
        self.connections: set[WsConnection] = set()
        self.accepted_total = 0
        self.rejected_total = 0
        self.streams = dict.fromkeys(WS_STREAM_OUTCOMES, 0)
        """Generations ended, by outcome (``WS_STREAM_OUTCOMES``)."""
        self._api_keys = tuple(key.encode() for key in settings.api_keys)

    def __repr__(self) -> str:
        port = self.port if self.listeners else None
        return f"<WsServer port={port} connections={len(self.connections)}>"

    @property
    def port(self) -> int:
        """The listening port (the kernel's choice when started with port 0)."""
        ports = {_listening_socket(listener).getsockname()[1] for listener in self.listeners}
        if not ports:
            raise RuntimeError("the server is not listening yet")
        if len(ports) > 1:
            raise RuntimeError(f"the server listens on several ports: {sorted(ports)}")
        return int(ports.pop())

    def statistics(self) -> WsServerStatistics:
        return WsServerStatistics(
            accepted_total=self.accepted_total,
            rejected_total=self.rejected_total,
            connections=tuple(connection.statistics() for connection in self.connections),
        )

    def authorized(self, request: WebSocketRequest) -> bool:
        """Whether the handshake carries an accepted key (constant-time comparison)."""
        if not self._api_keys:
            return True
        presented = _presented_key(request)
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and bool(presented)

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one TCP connection: the opening handshake, then the WebSocket.

        This is the per-connection error boundary, as in the HTTP front end:
        whatever fails here, in this module or in trio-websocket's reader task,
        ends this connection only and never reaches the accept loop.  A client
        that resets or closes, at any point, is logged at debug level; so is a
        handshake that fails otherwise (bytes that are not a handshake, a
        header wsproto cannot decode): both are the client's doing.  Anything
        else, once the connection was accepted, is a bug, logged with its
        traceback.

        Cancellation: cancels the connection's generations (their workers are
        told to abort) and closes the stream.
        Backpressure: see :class:`WsConnection`; trio-websocket's reader stops
        reading once ``incoming_buffer`` client messages wait.
        Resource handling: the stream is always closed on return (forcefully,
        without waiting).
        """
        attempt = _Attempt(stream_peer(stream))
        try:
            await self._serve_stream(stream, attempt)
        except* Exception as group:
            _log_failure(attempt, group)
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve_stream(self, stream: trio.abc.Stream, attempt: _Attempt) -> None:
        """Run trio-websocket's reader task beside the handshake and the connection."""
        async with trio.open_nursery() as nursery:
            request = await self._receive_handshake(nursery, stream)
            if request is not None:
                await self._handle_request(request, attempt)
            nursery.cancel_scope.cancel(reason="connection ended")

    async def _receive_handshake(
        self, nursery: trio.Nursery, stream: trio.abc.Stream
    ) -> WebSocketRequest | None:
        """The client's opening request; None when it took over ``handshake_timeout_s``."""
        with trio.move_on_after(self.settings.handshake_timeout_s):
            return await wrap_server_stream(
                nursery,
                stream,
                message_queue_size=self.settings.incoming_buffer,
                max_message_size=self.settings.max_message_bytes,
            )
        logger.debug("a handshake timed out")
        return None

    async def _handle_request(self, request: WebSocketRequest, attempt: _Attempt) -> None:
        """Refuse or accept one handshake, then serve the connection until it closes."""
        refusal = self._refusal(request)
        if refusal is not None:
            self.rejected_total += 1
            await self._reject(request, *refusal)
            return
        with trio.move_on_after(self.settings.handshake_timeout_s) as accepting:
            ws = await request.accept()
        if accepting.cancelled_caught:
            return
        attempt.accepted = True
        self.accepted_total += 1
        await self._serve_accepted(ws)

    async def _reject(self, request: WebSocketRequest, status: int, exc: Exception) -> None:
        with trio.move_on_after(self.settings.handshake_timeout_s):
            await request.reject(
                status,
                extra_headers=[(b"content-type", b"application/json")],
                body=compact_json({"error": error_payload(exc)}).encode(),
            )

    async def _serve_accepted(self, ws: WebSocketConnection) -> None:
        """Serve an accepted connection; a bug in it closes it with code 1011."""
        connection = WsConnection(self, ws)
        self.connections.add(connection)
        try:
            reason = await connection.serve()
        except Exception:
            logger.exception("%r: unexpected error; closing the connection", connection)
            reason = "internal error"
        finally:
            self.connections.discard(connection)
        logger.debug("%r: ended (%s)", connection, reason)
        with trio.move_on_after(self.settings.close_timeout_s):
            await ws.aclose(1011 if reason == "internal error" else 1000, reason)

    def _refusal(self, request: WebSocketRequest) -> tuple[int, Exception] | None:
        path, _ = _split_target(request.path)  # never echo the query: it may hold a key
        if path != self.settings.path:
            return 404, HttpError(
                404,
                f"no WebSocket endpoint at {path}",
                type="not_found_error",
                code="not_found",
            )
        if not self.authorized(request):
            return 401, Unauthorized("missing or invalid API key")
        return None


def _listening_socket(listener: object) -> trio.socket.SocketType:
    """The socket under a listener, through TLS (``trio.SSLListener``) if any."""
    while not isinstance(listener, trio.SocketListener):
        listener = getattr(listener, "transport_listener", None)
        if listener is None:
            raise RuntimeError("a listener without a socket")
    return listener.socket


@dataclass(slots=True)
class _Attempt:
    """One TCP connection, for the log line if it fails."""

    peer: str
    accepted: bool = False

    def __repr__(self) -> str:
        state = "accepted" if self.accepted else "handshake"
        return f"<WebSocket client {self.peer} ({state})>"


def _log_failure(attempt: _Attempt, group: ExceptionGroup[Exception]) -> None:
    _, unexpected = group.split(_PEER_GONE)
    if unexpected is None:
        logger.debug("%r: the client went away", attempt)
    elif not attempt.accepted:
        logger.debug("%r: the handshake failed", attempt, exc_info=unexpected)
    else:
        logger.error("%r: unexpected error; connection closed", attempt, exc_info=unexpected)


def _split_target(target: str) -> tuple[str, str]:
    """The path and the query of a request target.

    A WebSocket client sends the origin form (``/v1/ws?api_key=k``); it is
    split at the first ``?`` rather than parsed as a URL, so nothing a client
    puts there (``//[x``, which ``urlsplit`` refuses) can make the split fail.
    """
    path, _, query = target.partition("?")
    return path, query


def _presented_key(request: WebSocketRequest) -> bytes:
    for name, value in request.headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    _, query = _split_target(request.path)
    keys = parse_qs(query).get("api_key")
    return keys[0].encode() if keys else b""


def _peer_name(ws: WebSocketConnection) -> str:
    try:
        remote = ws.remote
    except OSError:  # already closed
        return "?"
    return f"{remote.address}:{remote.port}" if isinstance(remote, Endpoint) else remote


@dataclass(slots=True)
class _Live:
    """A running generation: its scope, for ``cancel``."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class WsConnection:
    """One accepted WebSocket: its reader, writer and generations.

    Args:
        server: the server (app, settings, fetcher).
        ws: the accepted connection.
    """

    _ids = 0

    def __init__(self, server: WsServer, ws: WebSocketConnection) -> None:
        WsConnection._ids += 1
        self.number = WsConnection._ids
        self._server = server
        self._settings = server.settings
        self._ws = ws
        self._peer = _peer_name(ws)
        self._live: dict[str, _Live] = {}
        self._idle = trio.CancelScope()
        self._outgoing: trio.MemorySendChannel[str] | None = None
        self._receive_side: trio.MemoryReceiveChannel[str] | None = None
        self._nursery: trio.Nursery | None = None
        self.messages_received = 0
        self.messages_sent = 0
        self.deltas_merged = 0
        self.deltas_direct = 0

    def __repr__(self) -> str:
        return f"<WsConnection #{self.number} peer={self._peer} live={len(self._live)}>"

    def statistics(self) -> WsConnectionStatistics:
        channel = self._receive_side.statistics() if self._receive_side else None
        return WsConnectionStatistics(
            generations=len(self._live),
            messages_received=self.messages_received,
            messages_sent=self.messages_sent,
            deltas_merged=self.deltas_merged,
            deltas_direct=self.deltas_direct,
            outgoing_buffered=channel.current_buffer_used if channel else 0,
            outgoing_peak=channel.peak_buffer_used if channel else 0,
        )

    async def serve(self) -> str:
        """Serve until the client closes or idles out; return why it ended.

        Cancellation: leaving (for any reason) cancels every generation of the
        connection and the writer.
        Backpressure: the writer channel holds ``outgoing_buffer`` messages.
        """
        send, receive = trio.open_memory_channel[str](self._settings.outgoing_buffer)
        self._receive_side = receive
        reason = "client closed"  # unless the reader returns: the writer saw the socket close
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._write, receive, name=f"ws-writer:{self.number}")
            with send:
                self._outgoing = send
                reason = await self._read()
            nursery.cancel_scope.cancel(reason=f"connection ended: {reason}")
        return reason

    # -- reading

    async def _read(self) -> str:
        while True:
            try:
                data = await self._next_message()
            except ConnectionClosed:
                return "client closed"
            if data is None:
                return "idle timeout"
            self.messages_received += 1
            await self._dispatch(data)

    async def _next_message(self) -> str | bytes | None:
        """The next client message; None once the connection was idle too long."""
        with trio.CancelScope() as self._idle:
            self._refresh_idle()
            return await self._ws.get_message()
        return None

    def _refresh_idle(self) -> None:
        """No deadline while generations run; else ``idle_timeout_s`` from now."""
        idle = self._settings.idle_timeout_s
        self._idle.deadline = math.inf if self._live else trio.current_time() + idle

    async def _dispatch(self, data: str | bytes) -> None:
        assert self._outgoing is not None
        try:
            message = parse_client_message(data)
        except WsMessageError as exc:
            await self._outgoing.send(error_message(exc.client_id, exc))
            return
        if isinstance(message, PingMessage):
            await self._outgoing.send(PONG)
        elif isinstance(message, CancelMessage):
            live = self._live.get(message.id)
            if live is not None:  # not live: it just ended, its terminal message is on its way
                live.scope.cancel(reason="cancelled by the client")
        else:
            refusal = self._start(message)
            if refusal is not None:
                self._server.streams["refused"] += 1
                await self._outgoing.send(error_message(message.id, refusal))

    def _start(self, message: GenerateMessage) -> Exception | None:
        """Register ``message.id`` and start its task, or say why not.

        Synchronous, so two ``generate`` messages can never race for one id or
        for the last slot.
        """
        assert self._nursery is not None
        assert self._outgoing is not None
        if message.id in self._live:
            return WsMessageError(
                f"id {message.id!r} is already in use by a running generation",
                code="duplicate_id",
                param="id",
            )
        limit = self._settings.max_generations
        if len(self._live) >= limit:
            return Overloaded(f"at most {limit} concurrent generations per connection")
        live = self._live[message.id] = _Live()
        self._refresh_idle()
        self._nursery.start_soon(
            self._generation,
            message,
            live,
            self._outgoing.clone(),
            name=f"ws-generation:{self.number}:{message.id}",
        )
        return None

    # -- generations

    async def _generation(
        self, message: GenerateMessage, live: _Live, outgoing: trio.MemorySendChannel[str]
    ) -> None:
        """Run one generation; send exactly one terminal message for it."""
        ended = "closed"  # unless its terminal message goes out
        with outgoing:
            try:
                with live.scope:
                    text, outcome = await self._outcome(message, outgoing)
                    await outgoing.send(text)
                    ended = outcome
                if live.scope.cancelled_caught:
                    await outgoing.send(cancelled_message(message.id))
                    ended = "cancelled"
            finally:
                del self._live[message.id]
                self._server.streams[ended] += 1
                self._refresh_idle()

    async def _outcome(
        self, message: GenerateMessage, outgoing: trio.MemorySendChannel[str]
    ) -> tuple[str, str]:
        """Stream ``message``'s deltas; return its terminal message and its outcome."""
        try:
            parsed = self._parse(message)
            if parsed.pending:
                parsed = await resolve_media(
                    parsed, limits=self._settings.media, fetcher=self._server.fetcher
                )
        except (EpdError, HttpError) as exc:
            return error_message(message.id, exc), "error"
        # Nothing may raise inside this block on purpose: the router's nursery
        # would wrap it in an exception group.
        async with self._server.app.generate(self._router_request(parsed)) as events:
            final = await self._stream(message.id, events, outgoing, logprobs=parsed.logprobs)
        if isinstance(final, DoneEvent):
            return done_message(message.id, final, request_id=parsed.request_id), "done"
        if final is None:
            crashed = ActorCrashed("the request ended without a final event")
            return error_message(message.id, crashed), "error"
        return error_message(message.id, final.error), "error"

    def _parse(self, message: GenerateMessage) -> ParsedRequest:
        from ..request import new_request_id

        parse = parse_chat_completion if message.kind == "chat" else parse_completion
        settings = self._settings
        parsed = parse(
            message.request,
            request_id=new_request_id(),
            limits=settings.media,
            policy=settings.fields,
        )
        if message.traceparent is not None:
            parsed = replace(parsed, traceparent=message.traceparent)
        models = self._settings.models
        if models and parsed.model not in models:
            raise unknown_model(parsed.model)
        return parsed

    def _router_request(self, parsed: ParsedRequest) -> GenerationRequest:
        """What the router runs: configured ``models`` are names of the router's default model."""
        request = parsed.request
        return replace(request, model=None) if self._settings.models else request

    async def _stream(
        self,
        client_id: str,
        events: HandoffReceiver[GenerationEvent],
        outgoing: trio.MemorySendChannel[str],
        *,
        logprobs: bool,
    ) -> DoneEvent | ErrorEvent | None:
        """Forward deltas (merging those already queued, unless ``stream_coalescing`` is
        ``off``); return the final event.

        While this task waits on an empty event channel, the task that produced
        a delta queues its message itself (the channel's taker, see
        :mod:`~epd_actors.handoff`), when the outgoing queue has room for it.
        """

        def take(event: GenerationEvent) -> bool:
            if type(event) is not DeltaEvent:
                return False  # usage, done and error events come to this task
            stats = outgoing.statistics()
            messages = delta_messages(client_id, [event], logprobs=logprobs)
            if stats.current_buffer_used + len(messages) > stats.max_buffer_size:
                return False
            for text in messages:
                outgoing.send_nowait(text)
            self.deltas_direct += 1
            return True

        coalesce = self._settings.stream_coalescing == "ready"
        events.attach(take)
        async for event in events:
            if isinstance(event, DoneEvent | ErrorEvent):
                return event
            if not isinstance(event, DeltaEvent):
                continue  # UsageEvent: the done message carries the usage
            deltas, final = _drain(event, events)
            messages = batch_messages(client_id, deltas, logprobs=logprobs, coalesce=coalesce)
            self.deltas_merged += len(deltas) - max(len(messages), 1)
            for text in messages:
                await outgoing.send(text)
            if final is not None:
                return final
        return None

    # -- writing

    async def _write(self, receive: trio.MemoryReceiveChannel[str]) -> None:
        """Send every queued message, in order; a closed socket ends the connection."""
        assert self._nursery is not None
        with receive:
            try:
                async for text in receive:
                    await self._ws.send_message(text)
                    self.messages_sent += 1
            except ConnectionClosed:
                logger.debug("%r: closed while writing", self)
                self._nursery.cancel_scope.cancel(reason="connection closed while writing")


def _drain(
    first: DeltaEvent, events: HandoffReceiver[GenerationEvent]
) -> tuple[list[DeltaEvent], DoneEvent | ErrorEvent | None]:
    """``first`` plus every delta already queued behind it, and a final event if one came."""
    deltas = [first]
    while True:
        try:
            event = events.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return deltas, None
        if isinstance(event, DeltaEvent):
            deltas.append(event)
        elif isinstance(event, DoneEvent | ErrorEvent):
            return deltas, event
