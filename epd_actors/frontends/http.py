"""The OpenAI-compatible HTTP/1.1 front end: h11 over Trio, SSE streaming.

Theory of operation
-------------------
:func:`serve_http` accepts connections with ``trio.serve_listeners``; each one
is served by :meth:`HttpServer.handle_connection`, which owns one
``h11.Connection`` and handles that connection's requests strictly one after
another (pipelined requests wait, buffered by h11, until the previous response
is complete).  One request goes through:

1. *head*: read under the keep-alive timeout (idle between requests and slow
   heads alike); a head larger than ``max_header_bytes`` is answered 431.
2. *checks before the body*: route (404), method (405 + ``Allow``), API key
   (401), content type (415), declared ``Content-Length`` (413) -- so a refused
   body is never read; then ``100 Continue`` if the client waits for it.
3. *body*: read under ``body_timeout_s`` (408), counting bytes (413 as soon as
   a chunked body passes the limit), then JSON (400) and
   :mod:`.openai_schema` (400 naming the field), pending media loaded.
4. *generation*: ``app.generate(request)`` while a sibling task watches the
   socket: EOF from the client cancels the generation, and leaving the
   ``generate`` block is what cancels the request and makes the router abort
   its workers.  A failed write (or a write slower than ``write_timeout_s``)
   does the same.

Errors are mapped to HTTP in one place, :func:`error_response`.  A stream
that fails after its headers went out ends with an SSE ``error`` event and no
``[DONE]``, and the connection is closed.

Streaming cost is per token, so the loop never does per-token work it can
batch: after one event arrives, every event already queued is taken with
``receive_nowait()``, rendered by templating (:class:`~.openai_format.SseFormatter`)
and written with one ``send_all``.

Backpressure: the event channel between the router and a response is bounded,
and each write waits for the socket; a slow client therefore slows only its
own request.  Connections beyond ``max_connections`` get a canned 503.

Why h11 and not an ASGI server: on this class of machine a Hypercorn +
Starlette stack on Trio served ~1.8k small requests/s, this kind of thin h11
loop ~9k (docs/http.md).
"""

from __future__ import annotations

import hmac
import http
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NoReturn, Protocol

import h11
import trio

from ..errors import (
    ActorCrashed,
    ConfigError,
    EpdError,
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    RequestCancelled,
    StageTimeout,
    Unauthorized,
    WorkerError,
)
from ..protocol import ErrorCode
from ..request import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    RequestTimings,
    UsageEvent,
    new_request_id,
)
from .media import MediaLimits, open_media_fetcher, resolve_media
from .openai_format import SseFormatter, error_body, logprobs_body, response_body, unix_time
from .openai_schema import ParsedRequest, parse_chat_completion, parse_completion

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    from ..request import GenerationEvent, GenerationRequest
    from ..router import Router
    from .media import MediaFetcher

    AdminHook = Callable[[str, str, object], Awaitable[tuple[int, object]]]

logger = logging.getLogger(__name__)

KIB: Final = 1024
MIB: Final = 1024 * KIB

_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_JSON_TYPES: Final = ("application/json",)
_SSE_HEADERS: Final = (("content-type", "text/event-stream"), ("cache-control", "no-cache"))
_METRICS_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Limits, timeouts and keys of the HTTP front end (docs/http.md has the table).

    Attributes:
        api_keys: accepted ``Authorization: Bearer`` keys for ``/v1/*``; empty = open.
        admin_keys: keys for ``/admin/*``; empty = admin routes disabled (404).
        max_body_bytes: largest request body (413 above, before reading it).
        max_header_bytes: largest request head (431 above).
        keep_alive_timeout_s: idle time allowed between requests, and for a
            request head to arrive (seconds).
        body_timeout_s: time to receive one request body (408 after; seconds).
        write_timeout_s: time one write to the client may take (seconds);
            a slower client is dropped and its request cancelled.
        linger_s: after the last response on a connection, how long to wait
            for the client's EOF before closing (so a client still sending,
            e.g. after a 413, reads the answer instead of a reset; seconds).
        max_connections: concurrent connections; more get a canned 503.
        receive_bytes: bytes asked of the socket per read.
        max_pipelined_bytes: bytes of the client's next requests buffered while
            a response streams; beyond it, the server stops reading until the
            response is done.
        access_log: log one INFO line per request.
        media: media limits and the URL/path allow-list.
    """

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    max_body_bytes: int = 48 * MIB
    max_header_bytes: int = 16 * KIB
    keep_alive_timeout_s: float = 5.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    linger_s: float = 1.0
    max_connections: int = 1024
    receive_bytes: int = 64 * KIB
    max_pipelined_bytes: int = 64 * KIB
    access_log: bool = False
    media: MediaLimits = field(default_factory=MediaLimits)


class HttpApp(Protocol):
    """What the HTTP front end needs from a router (tests pass fakes).

    Attributes:
        admin: ``await admin(method, path, json_body)`` -> ``(status, json)`` for
            ``/admin/*``; None disables the admin routes (404).
    """

    admin: AdminHook | None

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[GenerationEvent]]:
        """Run a request; the block yields its events (last: Done or Error)."""
        ...

    def models(self) -> list[str]:
        """The model names served (``/v1/models``; requests must name one)."""
        ...

    def health(self) -> tuple[int, dict[str, object]]:
        """``(status, body)`` of ``/health``."""
        ...

    def metrics(self) -> str | bytes:
        """The Prometheus text exposition (``/metrics``)."""
        ...

    def observe_http(self, route: str, status: int) -> None:
        """Count one answered request (``route`` is a known path or ``other``)."""
        ...


class RouterHttpApp:
    """:class:`HttpApp` over a running :class:`~epd_actors.router.Router`.

    ``health`` is 200 only when every pool has a usable worker; its body lists
    each pool's workers and their state.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        self.admin: AdminHook | None = None

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[GenerationEvent]]:
        return self.router.generate(request)

    def models(self) -> list[str]:
        return [self.router.config.model]

    def health(self) -> tuple[int, dict[str, object]]:
        stats = self.router.statistics()
        pools: dict[str, object] = {}
        healthy = True
        for stage, members in stats.pools.items():
            usable = sum(member.usable for member in members)
            healthy = healthy and usable > 0
            pools[stage] = {
                "usable": usable,
                "workers": [
                    {
                        "id": m.worker_id,
                        "usable": m.usable,
                        "connected": m.connected,
                        "draining": m.draining,
                        "in_flight": m.in_flight,
                        "served": m.served,
                    }
                    for m in members
                ],
            }
        body: dict[str, object] = {
            "status": "ok" if healthy else "unavailable",
            "requests_in_flight": stats.supervisor.requests_in_flight,
            "pools": pools,
        }
        return (200 if healthy else 503), body

    def metrics(self) -> str | bytes:
        return self.router.metrics.render()

    def observe_http(self, route: str, status: int) -> None:
        self.router.metrics.observe_http(route, status)


# ---------------------------------------------------------------- errors


class HttpError(Exception):
    """A refusal decided by the front end itself (404, 405, 413, 415, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """An error as HTTP: status, OpenAI error body, extra headers."""

    status: int
    body: dict[str, dict[str, str | None]]
    headers: tuple[tuple[str, str], ...] = ()


def error_response(exc: BaseException) -> ErrorResponse | None:
    """The one mapping from errors to HTTP answers; None means "just close".

    ``RequestCancelled`` maps to None: the client left (nginx's 499), nobody
    reads an answer.  Anything unrecognised is a 500.
    """
    if isinstance(exc, HttpError):
        body = error_body(str(exc), type=exc.type, param=exc.param, code=exc.code)
        return ErrorResponse(exc.status, body, exc.headers)
    if isinstance(exc, RequestCancelled):
        return None
    status, kind, code, param, headers = _classify(exc)
    return ErrorResponse(status, error_body(str(exc), type=kind, param=param, code=code), headers)


def _classify(
    exc: BaseException,
) -> tuple[int, str, str | None, str | None, tuple[tuple[str, str], ...]]:
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error", None, exc.param, ()
    if isinstance(exc, ConfigError):
        return 400, "invalid_request_error", None, None, ()
    if isinstance(exc, Unauthorized):
        return 401, "authentication_error", "invalid_api_key", None, ()
    if isinstance(exc, Overloaded):
        retry = (("retry-after", str(max(1, math.ceil(exc.retry_after)))),)
        if isinstance(exc, NoHealthyWorker):
            return 503, "service_unavailable_error", "no_healthy_worker", None, retry
        return 429, "rate_limit_error", "overloaded", None, retry
    if isinstance(exc, StageTimeout):
        return 504, "timeout_error", exc.phase, None, ()
    if isinstance(exc, RemoteWorkerError) and exc.code == ErrorCode.INVALID_REQUEST:
        return 400, "invalid_request_error", exc.code, None, ()
    if isinstance(exc, RemoteWorkerError):
        return 502, "upstream_error", exc.code, None, ()
    if isinstance(exc, WorkerError | ActorCrashed):
        return 502, "upstream_error", type(exc).__name__, None, ()
    return 500, "internal_error", type(exc).__name__, None, ()


class _ClientGone(Exception):
    """The client closed, reset, or stopped reading: stop serving this connection."""


# ---------------------------------------------------------------- server


async def serve_http(
    app: HttpApp,
    listeners: list[trio.SocketListener],
    *,
    settings: HttpSettings | None = None,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the OpenAI HTTP API on ``listeners`` until cancelled.

    Args:
        app: the router (see :class:`RouterHttpApp`) or a fake.
        listeners: e.g. from ``trio.open_tcp_listeners(8000)``.
        settings: limits, timeouts and keys (defaults: :class:`HttpSettings`).
        handler_nursery: where connection tasks run (default: an internal one).
        task_status: reports the listeners once accepting.

    Cancellation: cancelling stops accepting and cancels every connection;
    their in-flight requests are cancelled and their workers told to abort.
    Backpressure: at most ``max_connections`` connections are served; more
    are answered 503 and closed.
    """
    settings = settings or HttpSettings()
    if not settings.media.policy.url_prefixes:
        server = HttpServer(app, settings)
        await trio.serve_listeners(
            server.handle_connection,
            listeners,
            handler_nursery=handler_nursery,
            task_status=task_status,
        )
    async with open_media_fetcher(settings.media) as fetcher:
        server = HttpServer(app, settings, fetcher=fetcher)
        await trio.serve_listeners(
            server.handle_connection,
            listeners,
            handler_nursery=handler_nursery,
            task_status=task_status,
        )


class HttpServer:
    """Serves HTTP connections for one app; :meth:`handle_connection` per stream.

    Args:
        app: what requests run against.
        settings: limits, timeouts and keys.
        fetcher: loads allowed media URLs (None: URL media are refused).
    """

    def __init__(
        self, app: HttpApp, settings: HttpSettings, *, fetcher: MediaFetcher | None = None
    ) -> None:
        self.app = app
        self.settings = settings
        self.fetcher = fetcher
        self.connections = 0
        self._api_keys = tuple(key.encode() for key in settings.api_keys)
        self._admin_keys = tuple(key.encode() for key in settings.admin_keys)

    def __repr__(self) -> str:
        return f"<HttpServer connections={self.connections}>"

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection until it closes, idles out, or fails.

        This is the per-connection error boundary: an unexpected exception
        (a bug) is logged with its traceback and closes this connection only,
        after a best-effort 500; it never reaches the accept loop.

        Cancellation: cancels the connection's request (workers are told to
        abort) and closes the stream forcefully.
        Backpressure: requests are served one at a time per connection.
        """
        if self.connections >= self.settings.max_connections:
            await _refuse_connection(stream, self.settings.write_timeout_s)
            return
        self.connections += 1
        connection = _Connection(self, stream)
        try:
            await connection.serve()
        except Exception:
            logger.exception("[%s] unexpected error; closing the connection", connection.rid)
            await connection.internal_error()
        finally:
            self.connections -= 1
            await connection.close()

    def authorized(self, header: str, *, admin: bool = False) -> bool:
        """Whether an ``Authorization`` header carries an accepted key (constant time)."""
        keys = self._admin_keys if admin else self._api_keys
        if not keys and not admin:
            return True
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = token.strip().encode()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        return matched


async def _refuse_connection(stream: trio.abc.Stream, timeout: float) -> None:
    payload = json.dumps(
        error_body("too many connections", type="service_unavailable_error", code="busy")
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"retry-after: 1\r\nconnection: close\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    with trio.move_on_after(timeout):
        try:
            await stream.send_all(head.encode() + payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


# ---------------------------------------------------------------- one connection

_ROUTES: Final = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/health": "GET",
    "/metrics": "GET",
}


@dataclass(slots=True)
class _Exchange:
    """One request/response cycle, for the access log and metrics."""

    method: str
    path: str
    rid: str
    started: float
    route: str = "other"
    status: int = 0
    sent: int = 0


class _Connection:
    """One client connection: an h11 state machine and its stream."""

    def __init__(self, server: HttpServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.app = server.app
        self.settings = server.settings
        self.stream = stream
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.settings.max_header_bytes
        )
        self.saw_eof = False
        self.close_after = False
        self.exchange: _Exchange | None = None

    @property
    def rid(self) -> str:
        return self.exchange.rid if self.exchange else "-"

    # -- the request loop

    async def serve(self) -> None:
        while True:
            request = await self._next_request()
            if request is None:
                return
            await self._exchange(request)
            if (
                self.close_after
                or self.h11.our_state is not h11.DONE
                or self.h11.their_state is not h11.DONE
            ):
                return
            self.h11.start_next_cycle()

    async def _next_request(self) -> h11.Request | None:
        """The next request head, or None when the connection should close."""
        with trio.move_on_after(self.settings.keep_alive_timeout_s):
            try:
                event = await self._next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse_head(exc)
                return None
            except _ClientGone:
                return None
            return event if isinstance(event, h11.Request) else None
        if self.h11.trailing_data[0] and self.h11.their_state is h11.IDLE:
            await self._refuse_head(HttpError(408, "request head timed out", code="timeout"))
        return None

    async def _refuse_head(self, exc: h11.RemoteProtocolError | HttpError) -> None:
        if isinstance(exc, h11.RemoteProtocolError):
            status = exc.error_status_hint
            message = "request head too large" if status == 431 else f"bad request: {exc}"
            exc = HttpError(status, message)
        self.exchange = _Exchange("-", "-", "-", trio.current_time())
        self.close_after = True
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                await self._send_error(exc)
            except _ClientGone:
                pass

    async def _exchange(self, request: h11.Request) -> None:
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in request.headers
        }
        rid = headers.get("x-request-id", "")
        if not _REQUEST_ID.match(rid):
            rid = new_request_id()
        path = request.target.split(b"?", 1)[0].decode("latin-1")
        method = request.method.decode("latin-1")
        self.exchange = exchange = _Exchange(method, path, rid, trio.current_time())
        try:
            await self._route(method, path, headers, exchange)
        except (HttpError, EpdError, _Failed) as exc:
            try:
                await self._send_error(exc)
            except _ClientGone:
                self.close_after = True
        except _ClientGone:
            self.close_after = True
        finally:
            self._log_exchange(exchange)

    async def _route(
        self, method: str, path: str, headers: dict[str, str], exchange: _Exchange
    ) -> None:
        allowed = _ROUTES.get(path)
        if allowed is None:
            if path.startswith("/admin/") and self.app.admin and self.server.settings.admin_keys:
                exchange.route = "/admin"
                await self._admin(method, path, headers)
                return
            raise HttpError(404, f"no route for {path}", type="not_found_error", code="not_found")
        exchange.route = path
        if method != allowed:
            raise HttpError(
                405,
                f"{path} accepts {allowed} only",
                code="method_not_allowed",
                headers=(("allow", allowed),),
            )
        if path.startswith("/v1/") and not self.server.authorized(headers.get("authorization", "")):
            raise Unauthorized("missing or invalid API key")
        if path == "/v1/models":
            await self._read_body(0)
            models = [
                {"id": name, "object": "model", "created": 0, "owned_by": "epd_actors"}
                for name in self.app.models()
            ]
            await self._send_json(200, {"object": "list", "data": models})
        elif path == "/health":
            await self._read_body(0)
            status, body = self.app.health()
            await self._send_json(status, body)
        elif path == "/metrics":
            await self._read_body(0)
            text = self.app.metrics()
            payload = text.encode() if isinstance(text, str) else text
            await self._send_bytes(200, payload, (("content-type", _METRICS_TYPE),))
        else:
            body = await self._read_json(headers)
            await self._completion(path, body, headers)

    async def _admin(self, method: str, path: str, headers: dict[str, str]) -> None:
        if not self.server.authorized(headers.get("authorization", ""), admin=True):
            raise Unauthorized("missing or invalid admin key")
        assert self.app.admin is not None
        body = (
            await self._read_json(headers)
            if method in ("POST", "PUT")
            else await self._read_body(0)
        )
        status, answer = await self.app.admin(method, path, body)
        await self._send_json(status, answer)

    # -- reading

    async def _read_json(self, headers: dict[str, str]) -> object:
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type not in _JSON_TYPES:
            raise HttpError(
                415, "content-type must be application/json", code="unsupported_media_type"
            )
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[]))
        raw = await self._read_body(limit)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise HttpError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from None

    async def _read_body(self, limit: int) -> bytes:
        """The request body (at most ``limit`` bytes), within ``body_timeout_s``."""
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.settings.body_timeout_s):
            while True:
                try:
                    event = await self._next_event()
                except h11.RemoteProtocolError as exc:
                    self.close_after = True
                    raise HttpError(400, f"malformed request body: {exc}") from None
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > limit:
                        raise HttpError(
                            413, f"request body exceeds {limit} bytes", code="body_too_large"
                        )
                    chunks.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks)
                else:
                    raise _ClientGone("connection closed while sending the body")
        raise HttpError(408, "request body timed out", code="timeout")

    async def _next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self._receive())

    async def _receive(self) -> bytes:
        try:
            data = await self.stream.receive_some(self.settings.receive_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.saw_eof = True
        return data

    # -- generation

    async def _completion(self, path: str, body: object, headers: dict[str, str]) -> None:
        parse = parse_chat_completion if path == "/v1/chat/completions" else parse_completion
        session = headers.get("x-session-id") or None
        if session is not None and len(session) > 256:
            raise InvalidRequest(
                "x-session-id must have at most 256 characters", param="x-session-id"
            )
        assert self.exchange is not None
        parsed = parse(
            body, request_id=self.exchange.rid, limits=self.settings.media, session_key=session
        )
        if parsed.model not in self.app.models():
            raise HttpError(
                404,
                f"model {parsed.model!r} does not exist",
                code="model_not_found",
                param="model",
            )
        if parsed.pending:
            parsed = await resolve_media(
                parsed, limits=self.settings.media, fetcher=self.server.fetcher
            )
        await self._watched(parsed)

    async def _watched(self, parsed: ParsedRequest) -> None:
        """Run ``parsed`` while a sibling task watches for the client leaving.

        Failures are carried out of the nursery by hand, so that a single
        exception (not a group) reaches the error mapping.
        """
        failure: HttpError | EpdError | _ClientGone | _Failed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, nursery.cancel_scope, name=f"watch:{parsed.request_id}")
            try:
                if parsed.stream:
                    await self._stream(parsed)
                else:
                    await self._unary(parsed)
            except (HttpError, EpdError, _ClientGone, _Failed) as exc:
                failure = exc
            finally:
                nursery.cancel_scope.cancel(reason="response finished")
        if self.saw_eof:
            logger.debug("[%s] client disconnected; request cancelled", parsed.request_id)
            raise _ClientGone("client disconnected")
        if failure is not None:
            raise failure

    async def _watch(self, scope: trio.CancelScope) -> None:
        """Feed pipelined bytes to h11; on EOF, cancel the response (the client left)."""
        while len(self.h11.trailing_data[0]) <= self.settings.max_pipelined_bytes:
            data = await self._receive()
            self.h11.receive_data(data)
            if not data:
                scope.cancel(reason="client disconnected")
                return

    async def _unary(self, parsed: ParsedRequest) -> None:
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[float] = []
        async with self.app.generate(parsed.request) as events:
            async for event in events:
                if isinstance(event, DeltaEvent):
                    texts.append(event.text)
                    if parsed.logprobs and event.logprobs is not None:
                        token_ids.extend(event.token_ids)
                        logprobs.extend(event.logprobs)
                elif isinstance(event, ErrorEvent):
                    raise _Failed(event.error, event.timings)
                elif isinstance(event, DoneEvent):
                    body = response_body(
                        parsed.kind,
                        request_id=parsed.request_id,
                        model=parsed.model,
                        created=unix_time(),
                        text="".join(texts),
                        finish_reason=event.finish_reason,
                        usage=event.usage,
                        logprobs=logprobs_body(parsed.kind, token_ids, logprobs)
                        if parsed.logprobs
                        else None,
                    )
                    timings = event.timings
                    break
            else:
                raise ActorCrashed("the request ended without a final event")
        await self._send_json(200, body, (("x-epd-timings", timings.header_value()),))

    async def _stream(self, parsed: ParsedRequest) -> None:
        formatter = SseFormatter(
            parsed.kind,
            request_id=parsed.request_id,
            model=parsed.model,
            created=unix_time(),
            logprobs=parsed.logprobs,
        )
        async with self.app.generate(parsed.request) as events:
            batch = await _next_batch(events)
            if batch and isinstance(batch[0], ErrorEvent):
                raise _Failed(batch[0].error, batch[0].timings)
            head = self.h11.send(h11.Response(status_code=200, headers=self._headers(_SSE_HEADERS)))
            self._note_status(200)
            prefix = formatter.start()
            while True:
                text, final = _render(formatter, batch, parsed)
                data = head + self.h11.send(
                    h11.Data(data=(prefix + text).encode("utf-8", "replace"))
                )
                if final is not None:
                    data += self.h11.send(h11.EndOfMessage())
                if data:
                    await self._write(data)
                head, prefix = b"", ""
                if final is not None:
                    break
                batch = await _next_batch(events)
        if isinstance(final, ErrorEvent):
            logger.info("[%s] stream failed: %s", parsed.request_id, final.error)
            self.close_after = True

    # -- writing

    def _headers(self, extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
        headers = [("x-request-id", self.rid), *extra]
        if self.close_after:
            headers.append(("connection", "close"))
        return headers

    def _note_status(self, status: int) -> None:
        if self.exchange is not None:
            self.exchange.status = status

    async def _send_json(
        self, status: int, body: object, extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        await self._send_bytes(status, payload, (("content-type", "application/json"), *extra))

    async def _send_bytes(
        self, status: int, payload: bytes, extra: tuple[tuple[str, str], ...]
    ) -> None:
        headers = self._headers((*extra, ("content-length", str(len(payload)))))
        reason = http.HTTPStatus(status).phrase.encode() if status in _PHRASES else b""
        self._note_status(status)
        await self._send(
            h11.Response(status_code=status, headers=headers, reason=reason),
            h11.Data(data=payload),
            h11.EndOfMessage(),
        )

    async def _send_error(self, exc: HttpError | EpdError | _Failed) -> None:
        timings = None
        if isinstance(exc, _Failed):
            exc, timings = exc.error, exc.timings
        answer = error_response(exc)
        if answer is None or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.close_after = True
            return
        if not self._body_complete():
            self.close_after = True  # the body was not read: the connection cannot be reused
        extra = answer.headers
        if timings is not None:
            extra = (*extra, ("x-epd-timings", timings.header_value()))
        logger.debug("[%s] answering %d: %s", self.rid, answer.status, exc)
        await self._send_json(answer.status, answer.body, extra)

    def _body_complete(self) -> bool:
        """Consume what is left of the request body if it is already buffered."""
        while self.h11.their_state is h11.SEND_BODY:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                return False
            if not isinstance(event, h11.Data | h11.EndOfMessage):
                return False
        return self.h11.their_state is h11.DONE

    async def _send(self, *events: h11.Event) -> None:
        data = b"".join(self.h11.send(event) or b"" for event in events)
        if self.exchange is not None:
            self.exchange.sent += len(data)
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        with trio.move_on_after(self.settings.write_timeout_s):
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close_after = True
                raise _ClientGone("the client stopped reading") from None
            return
        self.close_after = True
        raise _ClientGone(f"a write took longer than {self.settings.write_timeout_s:g}s")

    async def internal_error(self) -> None:
        """Best-effort 500 after an unexpected error, if no response has started."""
        self.close_after = True
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = error_body("internal server error", type="internal_error")
            with trio.move_on_after(self.settings.write_timeout_s):
                try:
                    await self._send_json(500, body)
                except (_ClientGone, h11.LocalProtocolError):
                    pass

    async def close(self) -> None:
        """Close the stream: say EOF, let the client read the last answer, then close.

        Cancellation: the linger is bounded by ``linger_s`` and skipped when
        cancelled; the final close is forceful and never waits.
        """
        if not self.saw_eof:
            with trio.move_on_after(self.settings.linger_s):
                try:
                    if isinstance(self.stream, trio.abc.HalfCloseableStream):
                        await self.stream.send_eof()
                    drained = 0
                    while drained <= self.settings.max_body_bytes:
                        data = await self.stream.receive_some(self.settings.receive_bytes)
                        if not data:
                            break
                        drained += len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        await trio.aclose_forcefully(self.stream)

    def _log_exchange(self, exchange: _Exchange) -> None:
        self.app.observe_http(exchange.route, exchange.status)
        if self.settings.access_log:
            logger.info(
                '[%s] "%s %s" %d %dB %.1fms',
                exchange.rid,
                exchange.method,
                exchange.path,
                exchange.status,
                exchange.sent,
                (trio.current_time() - exchange.started) * 1000,
            )


class _Failed(Exception):
    """A generation ended with an ``ErrorEvent`` before any response was sent."""

    def __init__(self, error: EpdError, timings: RequestTimings) -> None:
        super().__init__(str(error))
        self.error = error
        self.timings = timings


_PHRASES: Final = frozenset(status.value for status in http.HTTPStatus)


async def _next_batch(
    events: trio.MemoryReceiveChannel[GenerationEvent],
) -> list[GenerationEvent]:
    """One event (waiting for it), plus every event already queued behind it."""
    try:
        batch = [await events.receive()]
    except trio.EndOfChannel:
        return []
    while not isinstance(batch[-1], DoneEvent | ErrorEvent):
        try:
            batch.append(events.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch


def _render(
    formatter: SseFormatter, batch: list[GenerationEvent], parsed: ParsedRequest
) -> tuple[str, DoneEvent | ErrorEvent | None]:
    """SSE text for a batch of events, and the final event if the batch has it."""
    parts: list[str] = []
    if not batch:
        error = ActorCrashed("the request ended without a final event")
        parts.append(formatter.error(_stream_error_body(error)))
        return "".join(parts), ErrorEvent(error, _NO_TIMINGS)
    for event in batch:
        if isinstance(event, DeltaEvent):
            if event.text or (parsed.logprobs and event.token_ids):
                parts.append(formatter.delta(event.text, event.token_ids, event.logprobs))
        elif isinstance(event, DoneEvent):
            parts.append(formatter.finish(event.finish_reason))
            if parsed.include_usage:
                parts.append(formatter.usage(event.usage))
            parts.append(formatter.comment("timings " + event.timings.header_value()))
            parts.append(formatter.done())
            return "".join(parts), event
        elif isinstance(event, ErrorEvent):
            parts.append(formatter.comment("timings " + event.timings.header_value()))
            parts.append(formatter.error(_stream_error_body(event.error)))
            return "".join(parts), event
        else:
            assert isinstance(event, UsageEvent)
    return "".join(parts), None


def _stream_error_body(error: EpdError) -> dict[str, dict[str, str | None]]:
    answer = error_response(error)
    if answer is None:
        return error_body(str(error), type="cancelled", code="cancelled")
    return answer.body


_NO_TIMINGS: Final = RequestTimings(
    queue_wait_s=0.0, stages={}, ttft_s=None, total_s=0.0, workers={}
)
