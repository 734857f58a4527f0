"""The simulator behind vLLM's OpenAI HTTP API: ``worker --engine sim --serve-openai``.

Theory of operation
-------------------
:class:`SimOpenAIServer` puts one engine of one role behind the HTTP API a
stock ``vllm serve`` instance of that role offers a disaggregating router:
``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed or not),
``GET /health`` (200 while the engine is ready, else 503), ``GET
/v1/models`` (the model and its LoRA adapters), ``POST
/v1/load_lora_adapter`` (:mod:`.lora`) and ``GET /metrics`` (the two gauges of vLLM's Prometheus
endpoint a router reads: ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, labelled ``engine="0"`` and ``model_name``).
Bodies go through the router's own OpenAI parser
(:mod:`epd_actors.openai.schema`), so a stage sees the prompt and
media exactly as the router would see them from a client, and then through
the *same* engine the native worker runs, so every data dependency is
checked:

* **encode**: each media item (``data:`` URL or ``input_audio``) is encoded
  and its encoder-cache entry written under the SHA-256 of its decoded bytes;
  the answer carries ``ec_transfer_params`` keyed by that hash.  Only
  ``stream: false`` is served.
* **prefill**: needs ``kv_transfer_params.do_remote_decode = true`` and
  ``stream: false``; the engine checks the encoder cache (strict mode refuses
  a missing entry) and publishes a KV handle, returned in ``kv_transfer_params``
  in vLLM's shape (``do_remote_prefill``, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``, ...) plus
  ``sim_kv_handle``.
* **decode**: needs ``kv_transfer_params`` from a prefill naming a live
  handle of the same prompt; streams (or returns) the output.
* **pd**: prefills and decodes itself (encoder cache checked).

``x-request-id`` is the engine's request id (and is echoed back).  Engine
errors become vLLM-style error bodies: refusals 400, ``overloaded`` and
``draining`` 503, injected failures and crashes 500.  A failure after a stream
started is one ``data: {"error": ...}`` event followed by ``data: [DONE]``, as
vLLM does.

The server records what each request carried -- the body's key fields and
the ``x-request-id`` and ``traceparent`` headers, the status and whether the client left -- in a
bounded :class:`RequestLog`, served at ``GET /debug/requests`` when
``debug_routes`` is on (the simulator's CLI turns it on), so tests can check
the contract from the worker's side.

Why not the router's HTTP front end: that server is built around the
router's app and answers in the router's own shapes; a vLLM worker answers
in different ones (``kv_transfer_params`` in bodies, ``token_ids`` in chunks).
This module is a handler on the package's server shell
(:mod:`epd_actors.http.server`) instead, which serves one request at a time
per keep-alive connection and answers its own refusals (400, 408, 413, 431)
with vLLM-style error bodies.

Cancellation: while the engine works on a request, a sibling task reads the
socket; EOF (the client left -- what vLLM treats as an abort) cancels the
work, and the engine's ``abort`` frees what the request held, shielded and
bounded, as the native runtime does after an ``Abort``.
Backpressure: streamed deltas are written one at a time, each write awaited
(bounded by ``write_timeout_s``), so a slow client slows only its request.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NoReturn

import trio

from ..addresses import parse_address
from ..errors import ConfigError, EngineCrashed, EngineError, InvalidRequest
from ..http.server import ClientGone, HttpResponse, HttpServer, ServerLimits
from ..http.sse import DONE_EVENT, encode_event
from ..limits import CLEANUP_TIMEOUT_S
from ..lora import LOAD_LORA_PATH
from ..openai.fields import TRANSFER_FIELDS, FieldPolicy
from ..openai.format import (
    AnswerBuilder,
    error_body,
    logprobs_body,
    response_body,
    response_id,
    tool_forcing,
    unix_time,
    usage_body,
)
from ..openai.media import MediaLimits
from ..openai.schema import parse_chat_completion, parse_completion
from ..protocol import (
    ROLE_TRAITS,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    PrefillRequest,
    Usage,
)
from ..worker.engine import check_option_names
from .engine import SimEngine
from .lora import LoraRefused, SimLoraAdapters

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..http.server import HttpRequest, Responder
    from ..openai.schema import ParsedRequest
    from ..protocol import Delta
    from ..worker.engine import Engine

logger = logging.getLogger(__name__)

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
DEBUG_PATH: Final = "/debug/requests"
METRICS_PATH: Final = "/metrics"

_REQUEST_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,256}$")
_STATUS_OF_CODE: Final[dict[str, int]] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.MISSING_ENCODER_CACHE: 400,
    ErrorCode.UNKNOWN_KV_HANDLE: 400,
    ErrorCode.UNSUPPORTED_STAGE: 400,
    ErrorCode.DUPLICATE_REQUEST: 400,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.DRAINING: 503,
}
_ERROR_TYPES: Final = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailable"}


@dataclass(frozen=True, slots=True)
class OpenAIServerSettings:
    """Limits and timeouts of the simulator's HTTP server.

    Attributes:
        max_header_bytes: largest request head (bytes).
        max_body_bytes: largest request body (bytes; 413 above).
        keep_alive_timeout_s: idle time between requests on a connection (seconds).
        body_timeout_s: time to receive one body (seconds).
        write_timeout_s: time one write may take before the client counts as gone (seconds).
        max_connections: connections served at once; more are closed at once.
            Above the most streams a benchmark puts on one worker (1,024), with
            room for the router's probes and the request-log reads beside them
            (vLLM's own server sets no limit).
        request_log_entries: entries the request log keeps (the oldest drop).
        kv_block_tokens: tokens per simulated KV block (for ``remote_block_ids``).
        media: media limits of the request parser.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    keep_alive_timeout_s: float = 75.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_connections: int = 4096
    request_log_entries: int = 1024
    kv_block_tokens: int = 16
    media: MediaLimits = field(default_factory=MediaLimits)


class RequestLog:
    """What the server received, oldest first; bounded to ``capacity`` entries.

    Each entry is a JSON-ready dict (see :func:`summarize`) plus ``seq``,
    ``stage``, ``status``, ``outcome`` and ``disconnected``, updated in place
    as the request proceeds.
    """

    def __init__(self, capacity: int) -> None:
        self._entries: deque[dict[str, object]] = deque(maxlen=capacity)
        self._seq = 0
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: dict[str, object]) -> dict[str, object]:
        self._seq += 1
        entry["seq"] = self._seq
        self._entries.append(entry)
        self._notify()
        return entry

    def update(self, entry: dict[str, object], **fields: object) -> None:
        entry.update(fields)
        self._notify()

    def snapshot(self) -> list[dict[str, object]]:
        """Copies of the entries, oldest first."""
        return [dict(entry) for entry in self._entries]

    async def wait_for(self, predicate: Callable[[list[dict[str, object]]], bool]) -> None:
        """Return once ``predicate(snapshot())`` holds (checked after every change).

        Cancellation: safe.
        """
        while not predicate(self.snapshot()):
            await self._changed.wait()
        await trio.lowlevel.checkpoint()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def summarize(path: str, request_id: str | None, body: dict[str, object]) -> dict[str, object]:
    """The fields of a request body the contract is about (for the request log)."""
    text_parts = 0
    media_parts: list[str] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            text_parts += 1
            continue
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text_parts += 1
            elif isinstance(kind, str):
                media_parts.append(kind)
    if "prompt" in body:
        text_parts += 1
    return {
        "path": path,
        "x_request_id": request_id,
        "keys": sorted(body),
        "model": body.get("model"),
        "stream": body.get("stream"),
        "stream_options": body.get("stream_options"),
        "max_tokens": body.get("max_tokens"),
        "max_completion_tokens": body.get("max_completion_tokens"),
        "min_tokens": body.get("min_tokens"),
        "kv_transfer_params": body.get("kv_transfer_params"),
        "ec_transfer_params": body.get("ec_transfer_params"),
        "text_parts": text_parts,
        "media_parts": media_parts,
    }


class _Refused(Exception):
    """A request answered with an error status before the engine ran."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(slots=True)
class _Exchange:
    """One request being served: where to answer, and its log entry."""

    responder: Responder
    request_id: str
    entry: dict[str, object]
    parsed: ParsedRequest
    body: dict[str, object]
    gone: bool = False
    adapter: str | None = None  # the LoRA adapter the body's model names

    @property
    def options(self) -> dict[str, object] | None:
        """The client's engine fields: the body's options less what the router adds."""
        options = self.parsed.options or {}
        kept = {name: value for name, value in options.items() if name not in TRANSFER_FIELDS}
        return kept or None


_VLLM_DEFAULTS: Final[dict[str, object]] = {
    "continue_final_message": False,
    "add_generation_prompt": True,
    "include_reasoning": True,
    "echo": False,
}
"""Engine fields the simulator does not model, and vLLM's default for each.

A request that sends one of them at exactly this value asks for nothing the
simulator would do differently (vllm-router sends several on every request);
it is taken as if the field were absent.  Any other value is refused as
before, naming the field."""


def _without_defaults(body: dict[str, object]) -> dict[str, object]:
    """``body`` without the :data:`_VLLM_DEFAULTS` fields that hold their default."""
    inert = [
        name
        for name, default in _VLLM_DEFAULTS.items()
        if name in body and type(body[name]) is type(default) and body[name] == default
    ]
    if not inert:
        return body
    return {key: value for key, value in body.items() if key not in inert}


_FIELDS: Final = FieldPolicy(unknown="ignore", accept_transfer_fields=True)
"""A vLLM server takes the fields a disaggregating router adds (``kv_transfer_params``...).

Fields it does not know are accepted and ignored, as vLLM's request models
do (``extra="allow"``, with a warning naming them): vllm-router adds SGLang's
``no_stop_trim``, ``return_hidden_states`` and others to every request it
forwards.  The request log's ``keys`` still shows every field received.
"""


class SimOpenAIServer:
    """Serves one engine over vLLM's OpenAI HTTP API (see the module docstring).

    Args:
        engine: the engine (its ``role`` decides what requests mean).
        worker_id: names the engine in ``remote_engine_id``.
        settings: limits and timeouts.
        debug_routes: serve ``GET /debug/requests``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        worker_id: str,
        settings: OpenAIServerSettings | None = None,
        debug_routes: bool = True,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.settings = settings or OpenAIServerSettings()
        self.debug_routes = debug_routes
        self.log = RequestLog(self.settings.request_log_entries)
        self.host = "127.0.0.1"
        self.port = 0
        limits = ServerLimits.of(self.settings)
        self.http = HttpServer(self._route, limits, error_response=_error_answer, name=worker_id)
        self.running = 0  # completion requests being served now
        self.lora = SimLoraAdapters(engine.capabilities)

    def __repr__(self) -> str:
        return (
            f"<SimOpenAIServer {self.worker_id} ({self.engine.role.value}) "
            f"{self.host}:{self.port} connections={self.connections}>"
        )

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return self.http.connections

    @property
    def url(self) -> str:
        """The server's base URL (once it listens)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------ connections

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it closes, idles out or breaks.

        Cancellation: cancels the request being served (the engine aborts it)
        and closes the stream.
        Backpressure: one request at a time per connection.
        Resource handling: the stream is closed on return.
        """
        await self.http.handle_connection(stream)

    # ------------------------------------------------------------ routing

    async def _route(self, request: HttpRequest, responder: Responder) -> HttpResponse | None:
        path, method, body = request.path, request.method, request.body
        try:
            if path in (CHAT_PATH, COMPLETIONS_PATH) and method == "POST":
                headers = dict(request.headers)
                await self._completion(responder, path, headers, body)
                return None
            if path == "/health" and method == "GET":
                ready = self.engine.is_ready()
                return HttpResponse.json(200 if ready else 503, {} if ready else _not_ready())
            if path == "/v1/models" and method == "GET":
                return HttpResponse.json(200, self._models())
            if path == LOAD_LORA_PATH and method == "POST":
                return self._load_lora(body)
            if path == METRICS_PATH and method == "GET":
                return _text(self._metrics())
            if path == DEBUG_PATH and method == "GET" and self.debug_routes:
                return HttpResponse.json(200, {"requests": self.log.snapshot()})
            raise _Refused(404, f"no route for {method} {path}")
        except _Refused as exc:
            return _error_answer(exc.status, str(exc), exc.code)

    def _models(self) -> dict[str, object]:
        return {"object": "list", "data": self.lora.cards(self.engine.model, unix_time())}

    def _load_lora(self, raw: bytes) -> HttpResponse:
        """``POST /v1/load_lora_adapter``: 200 and vLLM's text, or 400 (see :mod:`.lora`)."""
        entry = self.log.add({"path": LOAD_LORA_PATH, "status": None})
        try:
            answer = self.lora.load(json.loads(raw), self.engine.model)
        except (ValueError, RecursionError):
            raise _Refused(400, "request body is not valid JSON") from None
        except LoraRefused as exc:
            self.log.update(entry, status=exc.status, outcome="refused")
            raise _Refused(exc.status, str(exc)) from None
        self.log.update(entry, status=200, outcome="loaded", lora_name=self.lora.loads[-1])
        return _text(answer)

    def _metrics(self) -> str:
        """vLLM's request gauges and prefix-cache counters, one engine (``engine="0"``).

        The counters (``vllm:prefix_cache_queries_total`` and
        ``vllm:prefix_cache_hits_total``, in prompt tokens, as vLLM's V1 engine
        counts them) are there when the engine has a prefix cache, so a
        benchmark reads a fleet's hit rate the same way from the simulator and
        from real vLLM.  Prometheus text format.
        """
        labels = f'engine="0",model_name="{_label_value(self.engine.model)}"'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
        )
        cache = self.engine.prefix_cache if isinstance(self.engine, SimEngine) else None
        if cache is None:
            return text
        counters = cache.counters()
        for name, doc, value in (
            ("queries", "Prefix cache queries, in queried tokens.", counters.query_tokens),
            ("hits", "Prefix cache hits, in cached tokens.", counters.hit_tokens),
        ):
            text += (
                f"# HELP vllm:prefix_cache_{name} {doc}\n"
                f"# TYPE vllm:prefix_cache_{name} counter\n"
                f"vllm:prefix_cache_{name}_total{{{labels}}} {float(value)}\n"
            )
        return text

    async def _completion(
        self, responder: Responder, path: str, headers: dict[str, str], raw: bytes
    ) -> None:
        header_id = headers.get("x-request-id")
        request_id = header_id if header_id and _REQUEST_ID.match(header_id) else None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise _Refused(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the request body must be a JSON object")
        entry = summarize(path, header_id, body)
        entry["traceparent"] = headers.get("traceparent")
        entry.update(stage=self.engine.role.value, status=None, outcome="running")
        entry["disconnected"] = False
        self.log.add(entry)
        request_id = request_id or f"sim-{secrets.token_hex(8)}"
        try:
            parse = parse_chat_completion if path == CHAT_PATH else parse_completion
            parsed = parse(
                _without_defaults(body),
                request_id=request_id,
                limits=self.settings.media,
                policy=_FIELDS,
            )
            if parsed.pending:
                raise InvalidRequest("the simulator accepts inline (data:) media only")
            try:
                adapter = self.lora.adapter_for(body.get("model"), self.engine.model)
            except LoraRefused as exc:
                raise _Refused(exc.status, str(exc), "model_not_found") from None
            exchange = _Exchange(responder, request_id, entry, parsed, body, adapter=adapter)
            self.running += 1
            try:
                await self._run(exchange)
            finally:
                self.running -= 1
        except InvalidRequest as exc:
            self.log.update(entry, status=400, outcome="invalid_request")
            await self._send_error(
                responder, 400, str(exc), ErrorCode.INVALID_REQUEST, request_id, param=exc.param
            )
        except _Refused as exc:
            self.log.update(entry, status=exc.status, outcome=exc.code or "refused")
            await self._send_error(responder, exc.status, str(exc), exc.code, request_id)

    # ------------------------------------------------------------ the engine

    async def _run(self, exchange: _Exchange) -> None:
        """Check the role's contract, run the engine, answer; see the module docstring."""
        role = self.engine.role
        parsed, body = exchange.parsed, exchange.body
        try:
            check_option_names(exchange.options or (), self.engine)
        except EngineError as exc:
            raise InvalidRequest(exc.detail, param=exc.param) from None
        unsupported = ErrorCode.UNSUPPORTED_STAGE  # the request is for another role
        traits = ROLE_TRAITS[role]
        if not traits.streams and parsed.stream:
            raise _Refused(
                400, f"a {role.value} worker answers stream: false requests only", unsupported
            )
        kv = body.get("kv_transfer_params")
        if traits.hands_off_kv and not (isinstance(kv, dict) and kv.get("do_remote_decode")):
            raise _Refused(
                400,
                "a prefill worker needs kv_transfer_params.do_remote_decode = true",
                unsupported,
            )
        if traits.takes_kv and not (isinstance(kv, dict) and kv.get("do_remote_prefill")):
            raise _Refused(
                400,
                "a decode worker needs the kv_transfer_params of a prefill (do_remote_prefill)",
                unsupported,
            )
        if traits.serves("encode"):
            await self._watched(exchange, self._encode)
        elif traits.serves("prefill"):
            await self._watched(exchange, self._prefill)
        elif parsed.stream:
            await self._watched(exchange, self._stream)
        else:
            await self._watched(exchange, self._unary)

    async def _watched(
        self, exchange: _Exchange, work: Callable[[_Exchange], Awaitable[None]]
    ) -> None:
        """Run ``work`` while a sibling task watches for the client leaving.

        A failure is carried out of the nursery by hand, so that one
        exception, not a group, reaches the error mapping.
        """
        failure: EngineError | EngineCrashed | ClientGone | None = None
        finished = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, exchange, nursery.cancel_scope, name="sim-http-watch")
            try:
                await work(exchange)
                finished = True
            except (EngineError, EngineCrashed, ClientGone) as exc:
                failure = exc
            finally:
                nursery.cancel_scope.cancel(reason="response finished")
        if finished:
            return  # answered in full, even if the client hung up right after
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            await self.engine.abort(exchange.request_id)
        if exchange.gone or isinstance(failure, ClientGone):
            self.log.update(exchange.entry, outcome="disconnected", disconnected=True)
            raise ClientGone
        if failure is not None:
            await self._engine_failed(exchange, failure)

    async def _watch(self, exchange: _Exchange, scope: trio.CancelScope) -> None:
        """On the client's EOF, mark the client gone and cancel the work."""
        await exchange.responder.wait_disconnected()
        exchange.gone = True
        scope.cancel(reason="client disconnected")

    async def _engine_failed(self, exchange: _Exchange, exc: EngineError | EngineCrashed) -> None:
        code: str
        if isinstance(exc, EngineCrashed):
            status, code, message = 500, ErrorCode.INTERNAL, f"engine crashed: {exc}"
        else:
            status, code, message = _STATUS_OF_CODE.get(exc.code, 500), exc.code, exc.detail
        param = exc.param if isinstance(exc, EngineError) else None
        self.log.update(exchange.entry, status=status, outcome=code)
        responder = exchange.responder
        if responder.started:
            # Headers are out: vLLM's way is an error event, then [DONE].
            payload = error_body(message, type=_error_type(status), code=code, param=param)
            await responder.send(_sse(payload) + DONE_EVENT.encode())
            await responder.end()
            return
        await self._send_error(responder, status, message, code, exchange.request_id, param=param)

    async def _encode(self, exchange: _Exchange) -> None:
        media = exchange.parsed.request.media
        if not media:
            raise EngineError(ErrorCode.INVALID_REQUEST, "an encode request needs media")
        result = await self.engine.encode(
            EncodeRequest(exchange.request_id, media, options=exchange.options)
        )
        answer = self._body(exchange, "", "length", Usage(0, 0))
        answer["ec_transfer_params"] = result.ec_transfer_params
        await self._answer(exchange, answer)

    async def _prefill(self, exchange: _Exchange) -> None:
        request = exchange.parsed.request
        ec = exchange.body.get("ec_transfer_params")
        result = await self.engine.prefill(
            PrefillRequest(
                exchange.request_id,
                request.prompt,
                request.media,
                request.sampling,
                ec_transfer_params=ec if isinstance(ec, dict) else None,
                options=exchange.options,
                lora_adapter=exchange.adapter,
            )
        )
        answer = self._body(exchange, "", "length", Usage(result.prompt_tokens, 1))
        answer["kv_transfer_params"] = self._vllm_kv_params(
            result.kv_transfer_params or {}, exchange.request_id, result.prompt_tokens
        )
        await self._answer(exchange, answer)

    def _vllm_kv_params(
        self, sim: dict[str, object], request_id: str, prompt_tokens: int
    ) -> dict[str, object]:
        """The sim's handle in the shape vLLM's NIXL connector answers P with."""
        blocks = max(1, -(-prompt_tokens // self.settings.kv_block_tokens))
        return {
            **sim,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.worker_id,
            "remote_block_ids": [list(range(blocks))],
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    def _generate_request(self, exchange: _Exchange) -> GenerateRequest:
        request, body = exchange.parsed.request, exchange.body
        kv = body.get("kv_transfer_params")
        ec = body.get("ec_transfer_params")
        return GenerateRequest(
            exchange.request_id,
            request.prompt,
            request.media,
            request.sampling,
            kv_transfer_params=kv
            if isinstance(kv, dict) and ROLE_TRAITS[self.engine.role].takes_kv
            else None,
            ec_transfer_params=ec if isinstance(ec, dict) else None,
            options=exchange.options,
            lora_adapter=exchange.adapter,
        )

    async def _unary(self, exchange: _Exchange) -> None:
        deltas: list[Delta] = []

        async def collect(delta: Delta) -> None:
            deltas.append(delta)
            await trio.lowlevel.checkpoint()

        await self.engine.generate(self._generate_request(exchange), collect)
        if not deltas:
            raise EngineError(ErrorCode.INTERNAL, "the engine ended without a final delta")
        final, parsed = deltas[-1], exchange.parsed
        answer = AnswerBuilder(
            parsed.kind, logprobs=parsed.logprobs, forced_tools=tool_forcing(parsed.options)
        )
        for delta in deltas:
            answer.add(delta)
        body = answer.body(
            request_id=exchange.request_id,
            model=parsed.model,
            created=unix_time(),
            finish_reason=final.finish_reason or "stop",
            usage=final.usage or Usage(0, sum(len(d.token_ids) for d in deltas)),
        )
        choices = body["choices"]
        if exchange.body.get("return_token_ids") and isinstance(choices, list):
            choice = choices[0]
            assert isinstance(choice, dict)
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        await self._answer(exchange, body)

    async def _stream(self, exchange: _Exchange) -> None:
        parsed, responder = exchange.parsed, exchange.responder
        chunks = _ChunkWriter(parsed, token_ids=bool(exchange.body.get("return_token_ids")))
        head = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("x-request-id", exchange.request_id),
        ]

        async def emit(delta: Delta) -> None:
            # Headers wait for the first delta, so that a refusal before any
            # output (an unknown KV handle, an injected failure) is an HTTP
            # error status the router can act on, not an event in a 200 stream.
            if not responder.started:
                await responder.start(200, head)
                self.log.update(exchange.entry, status=200)
            await responder.send(chunks.delta(delta))

        await self.engine.generate(self._generate_request(exchange), emit)
        await responder.send(DONE_EVENT.encode())
        await responder.end()
        self.log.update(exchange.entry, outcome="ok")

    def _body(
        self,
        exchange: _Exchange,
        text: str,
        finish: str,
        usage: Usage,
        *,
        logprobs: dict[str, object] | None = None,
    ) -> dict[str, object]:
        parsed = exchange.parsed
        return response_body(
            parsed.kind,
            request_id=exchange.request_id,
            model=parsed.model,
            created=unix_time(),
            text=text,
            finish_reason=finish,
            usage=usage,
            logprobs=logprobs,
        )

    async def _answer(self, exchange: _Exchange, answer: dict[str, object]) -> None:
        self.log.update(exchange.entry, status=200, outcome="ok")
        headers = [("x-request-id", exchange.request_id)]
        await exchange.responder.respond(HttpResponse.json(200, answer, headers))

    # ------------------------------------------------------------ writing

    async def _send_error(
        self,
        responder: Responder,
        status: int,
        message: str,
        code: str | None = None,
        request_id: str | None = None,
        *,
        param: str | None = None,
    ) -> None:
        if responder.started:
            raise ClientGone("an error after the response started")
        await responder.respond(_error_answer(status, message, code, request_id, param=param))


class _ChunkWriter:
    """vLLM-shaped stream chunks of one request (role chunk first, usage last)."""

    __slots__ = ("_head", "_kind", "_logprobs", "_started", "_token_ids", "_usage")

    def __init__(self, parsed: ParsedRequest, *, token_ids: bool) -> None:
        chat = parsed.kind == "chat"
        self._kind = parsed.kind
        self._head: dict[str, object] = {
            "id": response_id(parsed.kind, parsed.request_id),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": unix_time(),
            "model": parsed.model,
        }
        self._token_ids = token_ids
        self._logprobs = parsed.logprobs
        self._usage = parsed.include_usage
        self._started = False

    def delta(self, delta: Delta) -> bytes:
        parts: list[bytes] = []
        if not self._started and self._kind == "chat":
            parts.append(self._choice({"delta": {"role": "assistant", "content": ""}}, None))
        self._started = True
        content = self._content(delta)
        if self._token_ids:
            content["token_ids"] = list(delta.token_ids)
        if self._logprobs:
            content["logprobs"] = logprobs_body(
                self._kind, delta.token_ids, delta.logprobs, delta.tokens, delta.top_logprobs
            )
        parts.append(self._choice(content, delta.finish_reason))
        if delta.finish_reason is not None and self._usage and delta.usage is not None:
            parts.append(_sse({**self._head, "choices": [], "usage": usage_body(delta.usage)}))
        return b"".join(parts)

    def _content(self, delta: Delta) -> dict[str, object]:
        """The choice's text part: vLLM leaves ``content`` out of a tool-call or reasoning delta."""
        if self._kind != "chat":
            return {"text": delta.text}
        if not delta.fields:
            return {"delta": {"content": delta.text}}
        message: dict[str, object] = {"content": delta.text} if delta.text else {}
        return {"delta": {**message, **delta.fields}}

    def _choice(self, content: dict[str, object], finish: str | None) -> bytes:
        choice = {"index": 0, "logprobs": None, **content, "finish_reason": finish}
        return _sse({**self._head, "choices": [choice]})


def _sse(obj: object) -> bytes:
    return encode_event(json.dumps(obj, separators=(",", ":"))).encode()


def _error_answer(
    status: int,
    message: str,
    code: str | None = None,
    request_id: str | None = None,
    *,
    param: str | None = None,
) -> HttpResponse:
    """A vLLM-style error answer (also the server shell's own refusals)."""
    body = error_body(message, type=_error_type(status), code=code, param=param)
    headers = [] if request_id is None else [("x-request-id", request_id)]
    return HttpResponse.json(status, body, headers)


def _text(text: str) -> HttpResponse:
    return HttpResponse.text(200, text, "text/plain; version=0.0.4; charset=utf-8")


def _label_value(value: str) -> str:
    """``value`` escaped for a Prometheus label (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def _not_ready() -> object:
    return error_body("the engine is not ready", type="ServiceUnavailable", code="not_ready")


async def serve_openai(
    server: SimOpenAIServer,
    listeners: list[trio.SocketListener],
    *,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``server`` on ``listeners`` until cancelled; reports the listeners once accepting.

    The first listener's address becomes the server's ``host``/``port`` (what
    a prefill names as ``remote_host``/``remote_port``).

    Cancellation: stops accepting and cancels every connection (their engine
    requests are aborted).
    Backpressure: at most ``settings.max_connections`` connections; more are closed.
    """
    sockname = listeners[0].socket.getsockname()
    server.host, server.port = str(sockname[0]), int(sockname[1])
    await server.http.serve(listeners, handler_nursery=handler_nursery, task_status=task_status)


async def serve_openai_process(server: SimOpenAIServer, listen: str) -> None:
    """Bind ``listen`` (``tcp://HOST:PORT``), announce the URL, serve until SIGTERM/SIGINT.

    Prints one line, ``epd_actors worker <id> (<role>) serving the OpenAI HTTP
    API on http://HOST:PORT``, once accepting.

    Raises:
        ConfigError: ``listen`` is not a TCP address.
        OSError: the address cannot be bound.

    Cancellation: a signal (or cancelling this coroutine) stops accepting and
    cancels every request; the engine aborts them.  There is no drain: a
    vLLM server does not drain either.
    """
    address = parse_address(listen, key="--listen")
    if address.scheme != "tcp":
        raise ConfigError(f"--listen: the OpenAI HTTP API needs tcp://HOST:PORT, not {listen!r}")
    listeners = await trio.open_tcp_listeners(address.port, host=address.host)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_openai, server, listeners)
            print(
                f"epd_actors worker {server.worker_id} ({server.engine.role.value}) "
                f"serving the OpenAI HTTP API on {server.url}",
                flush=True,
            )
            async for signum in signals:
                logger.info(
                    "%s: %s received; stopping", server.worker_id, signal.Signals(signum).name
                )
                nursery.cancel_scope.cancel(reason=f"{signal.Signals(signum).name} received")
