"""The OpenAI front end's answers on one connection: routes, auth, CORS, completions.

Theory of operation
-------------------
The connection itself -- h11, its reader task, the request loop, bounded
reads and writes, keep-alive, linger on close -- is the package's HTTP server
shell (:mod:`epd_actors.http.server`, :mod:`epd_actors.http.server_connection`);
:class:`HttpConnection` is that connection's :class:`~epd_actors.http.server.Exchanges`.
Requests come strictly one after another; bytes of pipelined requests that
arrive early wait inside h11.  Each request goes through:

1. *head*, read by the shell under ``keep_alive_timeout_s`` (idle time between
   requests and slow heads alike; 408 if part of a head had arrived, else a
   silent close), bounded by ``max_header_bytes`` (431); the shell's refusals
   are answered here (:meth:`HttpConnection.refuse`) in the OpenAI error shape.
2. *checks before the body*: route (404), method (405 + ``Allow``; ``HEAD``
   is answered as ``GET`` without the body, ``OPTIONS`` with 204 and
   ``Allow``), API key
   (401), content type (415), declared ``Content-Length`` (413), so a refused
   body is never read; then ``100 Continue`` if the client waits for it.
3. *body*, read under ``body_timeout_s`` (408) while counting (413 as soon as a
   chunked body passes the limit); then JSON (400), no lone surrogate in any
   string (400 naming the field, :mod:`epd_actors.openai.body_checks`), the OpenAI schema (400
   naming the field), the model name (404), pending media.
4. *generation*: ``app.generate(request)`` runs in the connection's
   ``response`` scope while its reader task (one per connection, the shell's)
   reads the socket.  EOF means the client left: the reader cancels the
   response, and leaving the ``generate`` block is what cancels the request and makes the
   router abort its workers.  A failed write, or one slower than
   ``write_timeout_s``, does the same.

An answer that is an error is built by :func:`~epd_actors.openai.errors.error_response`.
A stream that fails once its headers are out ends with an SSE ``error``
event, no ``[DONE]``, and the end of its chunked body; the connection then
serves the client's next request as after any other answer.  When the request body was not
read (413, or a refusal before the body), the connection closes after the
answer, the shell lingering up to ``linger_s`` so the client reads it instead
of a reset.  A ``GET`` of the upgrade path asking for ``Upgrade: websocket``
ends HTTP (``ServerConnection.upgrade``): the shell gives the stream on.

Streaming does no per-token work it can batch: after one event arrives, every
event already queued is taken with ``receive_nowait()``, rendered by templating
(:class:`~epd_actors.openai.format.SseFormatter`) and written with one ``send_all``;
the batch's deltas become one SSE event, or one each with ``stream_coalescing =
"off"`` (:mod:`~epd_actors.openai.coalescing`).
Backpressure: the router's event channel is bounded and each write waits for
the socket, so a slow client slows only its own request.
"""

from __future__ import annotations

import http
import json
import logging
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Protocol

import h11
import trio

from ..core.models import model_list_body
from ..errors import ActorCrashed, EpdError, InvalidRequest, Unauthorized
from ..http.body import body_framer
from ..http.server_connection import ClientGone, Refusal, whole_response
from ..logs import ACCESS_LOGGER
from ..openai.body_checks import reject_lone_surrogates, unknown_model
from ..openai.errors import HttpError, error_response
from ..openai.format import (
    AnswerBuilder,
    SseFormatter,
    compact_json,
    error_body,
    tool_forcing,
    unix_time,
)
from ..openai.schema import ParsedRequest, parse_chat_completion, parse_completion
from ..openai.sse import render_batch
from ..request import PRIORITIES, DeltaEvent, DoneEvent, ErrorEvent, new_request_id
from .event_batches import next_batch
from .media_fetch import resolve_media
from .sse_direct import DirectSseWriter
from .ws_upgrade import wants_websocket

if TYPE_CHECKING:
    from ..http.server_connection import ServerConnection
    from ..request import GenerationEvent
    from .http_app import HttpApp, HttpSettings
    from .media_fetch import MediaFetcher

logger = logging.getLogger("epd_actors.frontends.http")
access_logger = logging.getLogger(ACCESS_LOGGER)

ROUTES: Final = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/health": "GET",
    "/livez": "GET",
    "/readyz": "GET",
    "/metrics": "GET",
}
"""Path -> the one method it accepts (``/admin/*`` is routed separately)."""


def allowed_methods(method: str) -> str:
    """The ``Allow`` header of a route whose method is ``method``: HEAD goes with GET."""
    return f"{method}, HEAD, OPTIONS" if method == "GET" else f"{method}, OPTIONS"


MAX_SESSION_KEY_CHARS: Final = 256

_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_SSE_HEADERS: Final = (("content-type", "text/event-stream"), ("cache-control", "no-cache"))
_METRICS_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
_PHRASES: Final = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_REFUSAL_CODES: Final = {408: "timeout", 413: "body_too_large"}
CLIENT_CLOSED_STATUS: Final = 499
"""The status counted and logged when the client left before the router chose an
answer (nginx's "client closed request"); it is never sent."""


class Authorizer(Protocol):
    """Checks an ``Authorization`` header (see ``HttpServer.authorized``)."""

    def __call__(self, header: str, *, admin: bool = False) -> bool: ...


class _Failed(Exception):
    """A generation ended with an ``ErrorEvent`` before its response started."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(str(event.error))
        self.error = event.error
        self.timings = event.timings


@dataclass(slots=True)
class _Exchange:
    """One request/response cycle, for the access log and metrics."""

    method: str
    path: str
    rid: str
    started: float
    route: str = "other"
    status: int = 0  # the answer's status, once chosen (see ``client_left``)
    sent: int = 0
    served_by: str = "-"  # the workers of each stage, once the generation ended

    def client_left(self) -> None:
        """The client went away: ``CLIENT_CLOSED_STATUS`` unless an answer was chosen."""
        if not self.status:
            self.status = CLIENT_CLOSED_STATUS


class HttpConnection:
    """One client connection's exchanges (see the module docstring).

    Args:
        conn: the connection (the shell's: h11, reads, writes).
        app: what requests run against.
        settings: limits, timeouts, keys.
        authorized: checks an ``Authorization`` header (``admin=True`` for admin keys).
        fetcher: loads allowed media URLs (None: URL media are refused).
        upgrade_path: a ``GET`` of this path asking for ``Upgrade: websocket``
            ends the HTTP part of the connection (``conn.upgrade``; see
            :mod:`.ws_upgrade`); None: no upgrades (404).
    """

    def __init__(
        self,
        conn: ServerConnection,
        *,
        app: HttpApp,
        settings: HttpSettings,
        authorized: Authorizer,
        fetcher: MediaFetcher | None = None,
        upgrade_path: str | None = None,
    ) -> None:
        self.conn = conn
        self.h11 = conn.h11
        self.app = app
        self.settings = settings
        self._authorized = authorized
        self._fetcher = fetcher
        self._upgrade_path = upgrade_path
        self.exchange: _Exchange | None = None
        self._cors: tuple[tuple[str, str], ...] = ()  # CORS headers of the current answer

    def __repr__(self) -> str:
        return f"<HttpConnection request={self.rid} state={self.h11.states}>"

    @property
    def rid(self) -> str:
        """The id of the current request (``-`` before the first)."""
        return self.exchange.rid if self.exchange else "-"

    # -- the shell's calls (``Exchanges``)

    async def refuse(self, refusal: Refusal) -> None:
        """Answer a head the shell refused (400, 408, 431), in the OpenAI error shape."""
        code = _REFUSAL_CODES.get(refusal.status)
        await self._refuse_head(HttpError(refusal.status, refusal.message, code=code))

    async def _refuse_head(self, exc: HttpError) -> None:
        self.exchange = exchange = _Exchange("-", "-", new_request_id(), trio.current_time())
        self._cors = ()
        self.conn.close_after = True
        try:
            await self._send_error(exc)
        except ClientGone:
            exchange.client_left()
        finally:
            self._log_exchange(exchange)

    async def answer(self, request: h11.Request) -> None:
        """Answer one request (route, checks, body, generation); log the exchange.

        Cancellation: cancels the generation (its workers are told to abort).
        """
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
        rid = headers.get("x-request-id", "")
        if not _REQUEST_ID.match(rid):
            rid = new_request_id()
        path = request.target.split(b"?", 1)[0].decode("latin-1")
        method = request.method.decode("latin-1")
        self.exchange = exchange = _Exchange(method, path, rid, trio.current_time())
        self._cors = self.settings.cors.response_headers(headers.get("origin", ""))
        if path == self._upgrade_path and wants_websocket(method, headers):
            exchange.route, exchange.status = path, 101
            self.conn.upgrade = request  # answered by the WebSocket server (on_upgrade)
            self._log_exchange(exchange)
            return
        try:
            await self._route(method, path, headers, exchange)
        except (HttpError, EpdError, _Failed) as exc:
            try:
                await self._send_error(exc)
            except ClientGone:
                exchange.client_left()
                self.conn.close_after = True
        except ClientGone:
            exchange.client_left()
            self.conn.close_after = True
        finally:
            self._log_exchange(exchange)

    async def _route(
        self, method: str, path: str, headers: dict[str, str], exchange: _Exchange
    ) -> None:
        allowed = ROUTES.get(path)
        if allowed is None:
            if path.startswith("/admin/") and self.app.admin and self.settings.admin_keys:
                exchange.route = "/admin"
                await self._admin(method, path, headers)
                return
            raise HttpError(404, f"no route for {path}", type="not_found_error", code="not_found")
        exchange.route = path
        if method == "OPTIONS":
            await self._read_body(0)
            extra: tuple[tuple[str, str], ...] = (("allow", allowed_methods(allowed)),)
            if "access-control-request-method" in headers:  # a CORS preflight
                self._cors = ()
                extra += self.settings.cors.preflight_headers(
                    headers.get("origin", ""),
                    allowed_methods(allowed),
                    headers.get("access-control-request-headers", ""),
                )
            await self._send_bytes(204, b"", extra)
            return
        if method != allowed and not (method == "HEAD" and allowed == "GET"):
            raise HttpError(
                405,
                f"{path} accepts {allowed_methods(allowed)} only",
                code="method_not_allowed",
                headers=(("allow", allowed_methods(allowed)),),
            )
        if path.startswith("/v1/") and not self._authorized(headers.get("authorization", "")):
            raise Unauthorized("missing or invalid API key")
        if method == "POST":
            body = await self._read_json(headers)
            await self._completion(path, body, headers)
            return
        await self._read_body(0)
        if path == "/v1/models":
            await self._send_json(200, model_list_body(self.app.models()))
        elif path == "/health":
            status, health = self.app.health()
            await self._send_json(status, health)
        elif path == "/readyz":
            status, health = self.app.health()
            await self._send_json(status, {"status": health.get("status")})
        elif path == "/livez":
            await self._send_json(200, {"status": "alive"})
        else:
            text = self.app.metrics()
            payload = text.encode() if isinstance(text, str) else text
            await self._send_bytes(200, payload, (("content-type", _METRICS_TYPE),))

    async def _admin(self, method: str, path: str, headers: dict[str, str]) -> None:
        if not self._authorized(headers.get("authorization", ""), admin=True):
            raise Unauthorized("missing or invalid admin key")
        hook = self.app.admin
        assert hook is not None
        body: object = None
        bodiless = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
        if method in ("POST", "PUT") and not bodiless:
            body = await self._read_json(headers)  # a JSON null is a body too
        else:
            await self._read_body(0)  # an action such as POST .../drain needs no body
        status, answer = await hook(method, path, body)
        await self._send_json(status, answer)

    # -- reading

    async def _read_json(self, headers: dict[str, str]) -> object:
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise HttpError(
                415, "content-type must be application/json", code="unsupported_media_type"
            )
        declared = headers.get("content-length", "")
        raw = await self._read_body(
            self.settings.max_body_bytes, int(declared) if declared.isdigit() else None
        )
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise HttpError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        reject_lone_surrogates(raw, body)
        return body

    async def _read_body(self, limit: int, declared: int | None = None) -> bytes:
        """The request body (at most ``limit`` bytes; the shell's refusals as ``HttpError``).

        Refused before any of it is read when its ``declared`` length is over
        ``limit``; ``100 Continue`` first when the client waits for it.
        """
        try:
            return await self.conn.read_body(limit, declared=declared)
        except Refusal as exc:
            code = _REFUSAL_CODES.get(exc.status)
            raise HttpError(exc.status, exc.message, code=code) from None

    # -- generation

    async def _completion(self, path: str, body: object, headers: dict[str, str]) -> None:
        parse = parse_chat_completion if path == "/v1/chat/completions" else parse_completion
        session = headers.get("x-session-id") or None
        if session is not None and len(session) > MAX_SESSION_KEY_CHARS:
            raise InvalidRequest(
                f"x-session-id must have at most {MAX_SESSION_KEY_CHARS} characters",
                param="x-session-id",
            )
        parsed = parse(
            body,
            request_id=self.rid,
            limits=self.settings.media,
            session_key=session,
            policy=self.settings.fields,
        )
        priority = headers.get("x-epd-priority", "normal").strip().lower()
        if priority not in PRIORITIES:
            raise InvalidRequest(
                f"x-epd-priority must be one of {', '.join(PRIORITIES)}", param="x-epd-priority"
            )
        parsed = replace(parsed, priority=priority, traceparent=headers.get("traceparent"))
        if not self.app.serves(parsed.model):
            raise unknown_model(parsed.model)
        if parsed.pending:
            parsed = await resolve_media(parsed, limits=self.settings.media, fetcher=self._fetcher)
        await self._watched(parsed)

    async def _watched(self, parsed: ParsedRequest) -> None:
        """Run ``parsed`` in a scope the reader cancels if the client leaves (EOF).

        A failure is carried out of the scope by hand so that the EOF check
        comes first.
        """
        failure: HttpError | EpdError | ClientGone | _Failed | None = None
        conn = self.conn
        with trio.CancelScope() as response:
            if conn.saw_eof:
                response.cancel(reason="client disconnected")
            conn.response = response
            try:
                if parsed.stream:
                    await self._stream(parsed)
                else:
                    await self._unary(parsed)
            except (HttpError, EpdError, ClientGone, _Failed) as exc:
                failure = exc
            finally:
                conn.response = None
        if conn.saw_eof:
            logger.debug("[%s] client disconnected; request cancelled", parsed.request_id)
            raise ClientGone("client disconnected")
        if failure is not None:
            raise failure

    async def _unary(self, parsed: ParsedRequest) -> None:
        answer = AnswerBuilder(
            parsed.kind, logprobs=parsed.logprobs, forced_tools=tool_forcing(parsed.options)
        )
        final: GenerationEvent | None = None
        async with self.app.generate(parsed.request) as events:
            async for final in events:
                if isinstance(final, DeltaEvent):
                    answer.add(final)
                elif isinstance(final, DoneEvent | ErrorEvent):
                    break
        if isinstance(final, DoneEvent | ErrorEvent):
            self._note_served(final)
        if isinstance(final, ErrorEvent):
            raise _Failed(final)
        if not isinstance(final, DoneEvent):
            raise ActorCrashed("the request ended without a final event")
        body = answer.body(
            request_id=parsed.request_id,
            model=parsed.model,
            created=unix_time(),
            finish_reason=final.finish_reason,
            usage=final.usage,
        )
        await self._send_json(200, body, (("x-epd-timings", final.timings.header_value()),))

    async def _stream(self, parsed: ParsedRequest) -> None:
        formatter = SseFormatter(
            parsed.kind,
            request_id=parsed.request_id,
            model=parsed.model,
            created=unix_time(),
            logprobs=parsed.logprobs,
        )
        # Once the head is out, deltas that find this task waiting are written
        # by the task that produced them (see sse_direct).
        frame = body_framer(self.h11)
        direct = DirectSseWriter(
            frame, self.conn.writer, formatter, logprobs=parsed.logprobs, exchange=self.exchange
        )
        coalesce = self.settings.stream_coalescing == "ready"
        async with self.app.generate(parsed.request) as events:
            batch = await next_batch(events)
            if batch and isinstance(batch[0], ErrorEvent):
                self._note_served(batch[0])
                raise _Failed(batch[0])
            self._note_status(200)
            head = self.h11.send(
                h11.Response(status_code=200, headers=self._headers(_SSE_HEADERS), reason=b"OK")
            )
            text = formatter.start()
            while True:
                more, final = render_batch(formatter, batch, parsed, coalesce=coalesce)
                data = head + frame((text + more).encode("utf-8", "replace"))
                if final is not None:
                    self._note_served(final)
                    data += self.h11.send(h11.EndOfMessage())
                if data:
                    await self._write(data)
                if final is not None:
                    break
                events.attach(direct)  # the head is out: deltas may be written directly
                text = ""
                while True:
                    batch = await direct.next_batch(events)
                    if direct.failed:
                        self.conn.close_after = True
                        raise ClientGone("the client stopped reading")
                    head = direct.take_backlog()
                    if batch or not head:
                        break  # events to render, or the channel ended
                    await self._write(head)  # only the rest of a direct write
        if isinstance(final, ErrorEvent):
            # The error event ended the chunked body cleanly, so the connection
            # stays open: its headers are out, no ``connection: close`` can tell
            # the client, and a client that sends its next request on it at once
            # would lose that request to the close.
            logger.info("[%s] stream failed: %s", parsed.request_id, final.error)

    # -- writing

    def _headers(self, extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
        headers = [("x-request-id", self.rid), *self._cors, *extra]
        if self.conn.close_after:
            headers.append(("connection", "close"))
        return headers

    def _note_served(self, final: DoneEvent | ErrorEvent) -> None:
        if self.exchange is not None:
            self.exchange.served_by = final.timings.served_by()

    def _note_status(self, status: int) -> None:
        if self.exchange is not None:
            self.exchange.status = status

    async def _send_json(
        self, status: int, body: object, extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        payload = compact_json(body).encode()
        await self._send_bytes(status, payload, (("content-type", "application/json"), *extra))

    async def _send_bytes(
        self, status: int, payload: bytes, extra: tuple[tuple[str, str], ...]
    ) -> None:
        self._note_status(status)
        head_only = self.exchange is not None and self.exchange.method == "HEAD"
        data = whole_response(
            self.h11,
            status,
            self._headers(extra),
            payload,
            head_only=head_only,
            reason=_PHRASES.get(status, b""),
        )
        await self._write(data)

    async def _send_error(self, exc: HttpError | EpdError | _Failed) -> None:
        timings = exc.timings if isinstance(exc, _Failed) else None
        error = exc.error if isinstance(exc, _Failed) else exc
        answer = error_response(error)
        if answer is None or self.conn.started:
            self.conn.close_after = True
            return
        if not self.conn.body_complete():
            self.conn.close_after = True  # the body was not read: the connection cannot be reused
        extra = answer.headers
        if timings is not None:
            extra = (*extra, ("x-epd-timings", timings.header_value()))
        logger.debug("[%s] answering %d: %s", self.rid, answer.status, error)
        await self._send_json(answer.status, answer.body, extra)

    async def _write(self, data: bytes) -> None:
        """Write ``data`` through the connection, counting it for the access log.

        Not a checkpoint when the socket took it all; the awaited rest is
        bounded by ``write_timeout_s`` (then :class:`ClientGone`).
        """
        if self.exchange is not None:
            self.exchange.sent += len(data)
        await self.conn.write(data)

    async def failed(self) -> None:
        """Best-effort 500 after an unexpected error, if no response has started.

        Cancellation: bounded by ``write_timeout_s``.
        """
        self.conn.close_after = True
        if not self.conn.started:
            await self._send_json(500, error_body("internal server error", type="internal_error"))

    def _log_exchange(self, exchange: _Exchange) -> None:
        self.app.observe_http(exchange.route, exchange.status)
        if self.settings.access_log:
            access_logger.info(
                '[%s] "%s %s" %d %dB %.1fms %s',
                exchange.rid,
                exchange.method,
                exchange.path,
                exchange.status,
                exchange.sent,
                (trio.current_time() - exchange.started) * 1000,
                exchange.served_by,
            )
