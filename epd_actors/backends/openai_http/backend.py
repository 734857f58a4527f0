"""The router's client for stock ``vllm serve`` instances: vLLM's OpenAI HTTP API.

Theory of operation
-------------------
An :class:`OpenAIHttpBackend` stands for one vLLM server (``http://HOST:PORT``).
Its :meth:`~OpenAIHttpBackend.run` task owns one
:class:`~epd_actors.http.client.WorkerHttpClient` -- a lean HTTP/1.1 keep-alive
connection pool over Trio, bounded by :class:`OpenAIHttpSettings` (each request
one write; see that module for why not a general-purpose client) -- reports "started" at
once (a router must come up while a server is still loading its model), and
then probes ``GET /health`` every ``health_interval_s`` over a connection of
its own (never queued behind requests in a saturated pool).  Two
:class:`~epd_actors.backends.openai_http.settings.Hysteresis` trackers turn the probes into
``status()``: *connected* (the server answers HTTP at all) and *ready* (it
answers 200).  ``failures_to_down`` bad probes in a row take a worker down,
``successes_to_up`` good ones bring it back; a request that cannot even
connect takes it down at once.  When the worker goes down, every request
still waiting on it ends at once with ``WorkerDisconnected`` (retryable, so
the stage moves to another worker): an encode or prefill call, a stream
waiting for its response head (:class:`_UntilDown`), and a stream already
open (:meth:`OpenAIHttpDeltaStream.abandon`) -- rather than after its read
timeout or the stage's deadline, since a stalled server (``SIGSTOP``) answers
nothing, not even an error.

The same probe then reads ``GET /v1/models``: a server that does not serve the
pool's model is *refused* (logged at error level, ``status().refused``, never
routed to) until a later probe finds the model.  The cards whose ``parent`` is
that model are the LoRA adapters it has loaded (``status().adapters``).

LoRA adapters.  A request naming an adapter sends the adapter's name as the
body's ``model`` (vLLM routes adapters by that name).  When the worker has
not loaded it and the pool allows loading it (``requirement.loadable``), it is
loaded first with ``POST /v1/load_lora_adapter`` -- once per worker: requests
arriving meanwhile wait for that load (:class:`~epd_actors.lora.AdapterLoads`)
-- within ``lora_load_timeout_s``; a refused, failed or late load is
``AdapterLoadFailed`` (retryable: the request moves to another worker).  What
was loaded is forgotten when the worker goes down (it may come back restarted).

A server that answers a stage request with ``unsupported_stage`` (it runs
another role) is refused too, until the probes see it go down and come back
(a restart).

Stage requests become vLLM's disaggregated contract
(:mod:`epd_actors.backends.openai_http.contract` builds every body):

* encode: one ``POST /v1/chat/completions`` per media item, concurrently; the
  replies' ``ec_transfer_params`` are merged into the result;
* prefill: one non-streamed POST; the whole (bounded) body is read and its
  ``kv_transfer_params`` and ``usage.prompt_tokens`` returned;
* generate (D and PD): one streamed POST; the stream's bytes are decoded into
  protocol deltas as the caller reads them -- one delta per network read, not
  per token.  With ``shared_stream_reader`` (the default, on Linux) the
  backend's :class:`~epd_actors.transport.read_hub.ReadHub` reads every open
  stream's socket in one task while their readers wait, and hands each
  non-final delta to the reader's sink there: a stream in step with its
  engine costs one ``read`` per token and no wake-up of its own.

Errors are mapped once, in :meth:`OpenAIHttpBackend._mapped`: no connection
-> ``WorkerDisconnected``; a lost connection or a reply that is not HTTP ->
``WorkerDisconnected``; a timeout -> ``RemoteWorkerError(code="timeout",
retryable=True)``; HTTP 429 and
5xx -> ``RemoteWorkerError`` (retryable); other 4xx ->
``RemoteWorkerError(code="invalid_request", retryable=False)`` carrying
vLLM's message (and the ``param`` it blames), or ``code="unknown_kv_handle"``
when the body says so (a decoder refusing the KV handle a prefill worker
handed on: the decode actor blames that worker), or
``code="missing_encoder_cache"`` (a consumer that found no encoder output for
an item: the router encodes it again); a reply that breaks the contract
or exceeds a size limit -> ``RemoteWorkerError(code="protocol_error",
retryable=True)``.

Cancellation.  A cancelled encode or prefill call, and a stream left before
its last delta, close their HTTP connection; vLLM aborts a request whose
client disconnected, and frees what it held (a prefill cancelled during its
last step included, since vLLM 0.12's eager aborts).  Closing is shielded and
bounded by ``CLEANUP_TIMEOUT_S``.

Release.  Stock vLLM has no call that frees a finished prefill's KV blocks.
:meth:`OpenAIHttpBackend.release` follows ``settings.release_policy``:
``expire`` does nothing and returns False (P's connector frees the blocks when
its lease, ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, runs out); ``consume`` sends
a ready decoder a one-token copy of the decode request, which pulls the blocks
and so frees them at once -- but only for hand-offs no decoder has accepted
yet, tracked in a :class:`~epd_actors.backends.openai_http.settings.HandoffLedger` shared by the
backends of one router (:class:`OpenAIHttpBackendFactory`).  docs/reliability.md
weighs the two.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import ssl
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Final

import trio

from ..._groups import single_exception
from ...addresses import check_http_url
from ...errors import AdapterLoadFailed, RemoteWorkerError, WorkerDisconnected
from ...http.client import (
    BadResponse,
    ClientLimits,
    ConnectFailed,
    ConnectionLost,
    HttpClientError,
    RequestTimeout,
    Response,
    WorkerHttpClient,
)
from ...http.sse import SseDecoder, SseEvent
from ...limits import CLEANUP_TIMEOUT_S
from ...lora import LOAD_LORA_PATH, AdapterLoads, listed_adapters
from ...protocol import EncodeRequest, ErrorCode, StageResult
from ...trace_context import trace_headers
from ...transport.read_hub import ReadHub
from ..base import BackendStatus, WorkerRequirement
from .contract import (
    DeltaParser,
    HttpCall,
    ReplyError,
    StreamFailed,
    consume_body,
    encode_call,
    encode_result,
    error_code,
    error_message,
    error_param,
    generate_call,
    json_object,
    prefill_call,
    prefill_result,
    served_models,
)
from .settings import (
    DEFAULT_SETTINGS,
    HandoffLedger,
    Hysteresis,
    OpenAIHttpSettings,
    OpenAIHttpStatistics,
    Replay,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from types import TracebackType

    from ...lora import LoraAdapter
    from ...protocol import Delta, GenerateRequest, PrefillRequest

__all__ = [
    "DEFAULT_SETTINGS",
    "OpenAIHttpBackend",
    "OpenAIHttpBackendFactory",
    "OpenAIHttpDeltaStream",
    "OpenAIHttpSettings",
    "OpenAIHttpStatistics",
]

logger = logging.getLogger(__name__)

_RETRYABLE_STATUSES = frozenset({408, 425, 429})
_HANDOFF_CODES = frozenset({ErrorCode.UNKNOWN_KV_HANDLE, ErrorCode.MISSING_ENCODER_CACHE})
"""Refusal codes that blame what an earlier stage handed on; kept as they are."""


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context (system trust store) for every client of the process.

    Building one loads the CA bundle (about 0.2 s here); a router has two
    clients per worker, so they share this one.
    """
    return ssl.create_default_context()


_DRAIN_S: Final = 1.0
"""How long a finished stream may take to deliver the end of its body (seconds)."""
_MAX_PROBE_BYTES: Final = 64 * 1024

"""The largest ``/health`` answer read (bytes)."""
_encode_json: Final = json.JSONEncoder(separators=(",", ":")).encode
"""Request bodies as compact JSON (one encoder for the process, not one per call)."""


class OpenAIHttpDeltaStream:
    """The deltas of one streamed generate request (a ``DeltaStream``).

    Backpressure: reads the response only when the caller asks for the next
    delta, or, with a sink (:meth:`set_sink`), while the caller waits with
    nothing queued and the sink takes what is read; everything already
    received is merged into that one delta, or, without ``merge_reads``,
    each chunk received becomes a delta of its own (the events not parsed yet
    wait in ``_unparsed``).
    """

    def __init__(self, backend: OpenAIHttpBackend, call: HttpCall, reply: Response) -> None:
        self._backend = backend
        self._call = call
        self._reply = reply
        self._decoder = SseDecoder(backend.settings.max_event_bytes)
        self._parser = DeltaParser(
            call.request_id, chat=call.chat, relay=backend.settings.relay_engine_text
        )
        self._merge = backend.settings.merge_reads
        self._unparsed: deque[SseEvent] = deque()  # without merge_reads: read, not parsed
        self._down: str | None = None  # why the worker was declared down mid-stream
        self._sink: Callable[[Delta], bool] | None = None
        # A delta parsed but not taken yet: the sink refused it, or a one-event read made it.
        self._held: Delta | None = None

    @property
    def finished(self) -> bool:
        """Whether the terminal delta has been returned."""
        return self._parser.terminal_sent and self._held is None

    def abandon(self, why: str) -> None:
        """The worker is down: close the connection, so the stream's next read fails.

        A server can keep a stream's connection open after its engine died
        (vLLM does on shutdown); the health probes notice, and this ends the
        stream then rather than after the read or inter-token timeout.
        Called from the backend's health task; never waits.
        """
        if self._down is None:
            self._down = why
            self._reply.close_now()

    async def receive(self) -> Delta:
        """The next delta; ``trio.EndOfChannel`` after the terminal one.

        With a sink set and the backend's read hub running, the hub's task
        reads the response while this waits, and hands each non-final delta
        to the sink; this resumes for the one the sink refused, the terminal
        delta, a failure or the end of the body.

        Raises:
            WorkerDisconnected: the connection broke, the worker was declared
                down (:meth:`abandon`), or the stream ended without a finish reason.
            RemoteWorkerError: vLLM reported an error in the stream
                (``engine_error``), a timeout, or a malformed chunk.

        Cancellation: safe; the stream's owner closes the connection.
        """
        while True:
            delta = self._take()
            if delta is not None:
                return delta
            if self._parser.terminal_sent:
                raise trio.EndOfChannel
            try:
                chunk = await self._read()
            except HttpClientError as exc:
                raise self._failure(exc) from exc
            if chunk is None:
                return self._end()
            if chunk:
                self._parse(chunk)

    async def _read(self) -> bytes | None:
        """More body bytes (None at its end); ``b""``: the read hub left a delta in ``_held``."""
        reply = self._reply
        sink, down = self._sink, self._down
        if sink is not None and down is None and (hub := self._backend.read_hub).running:
            chunk = reply.body_nowait()  # received with the head, or after the hub's last turn
            if chunk != b"":
                return chunk
            if await reply.serve_body(hub, self._read_by_hub):
                self._held = self._take()
                if self._held is not None:
                    return b""
            # The hub gave the body back with nothing parsed (its end, the
            # connection's, a failure) or cannot serve it: read it here.
        return await reply.next_chunk()

    def _read_by_hub(self) -> bool:
        """The read hub's handler: read, parse, hand deltas to the sink; False: resume the reader.

        Runs in the hub's task while the reader waits in :meth:`receive`;
        raises what parsing raises (the reader resumes with it).
        """
        reply = self._reply
        try:
            if not reply.receive_nowait():
                return False  # the end of the connection, or a read error: the reader reports it
        except trio.WouldBlock:
            return True
        chunk = reply.body_nowait()
        if chunk is None:
            return False  # the end of the body
        if chunk:
            self._parse(chunk)
        sink = self._sink
        assert sink is not None
        while (delta := self._take()) is not None:
            if delta.finish_reason is None and sink(delta):
                if self._merge:
                    return True  # the one delta held everything this read parsed
                continue
            self._held = delta
            return False
        return True

    def _take(self) -> Delta | None:
        """The parsed delta; without ``merge_reads``, parsing one more event at a time."""
        held = self._held
        if held is not None:
            self._held = None
            return held
        delta = self._parser.take()
        while delta is None and self._unparsed:
            self._parse(None)
            delta = self._parser.take()
        return delta

    def _parse(self, chunk: bytes | None) -> None:
        """Decode and parse ``chunk`` (None: the next event read but not parsed yet).

        Without ``merge_reads`` a chunk's events are only decoded here; they
        are parsed one at a time, as deltas are taken.  Errors are the router's.
        """
        try:
            if chunk is None:
                self._parser.feed([self._unparsed.popleft()])
                return
            # A read of one text-only event, with nothing before it (nearly every
            # read of a paced stream), becomes its delta at once (``_take`` returns it).
            data = None if self._unparsed or self._held else self._decoder.single_data(chunk)
            if data is None:
                events = self._decoder.feed(chunk)
            else:
                delta = self._parser.text_delta(data)
                if delta is not None:
                    self._held = delta
                    return
                events = [SseEvent("", data)]
            if self._merge:
                self._parser.feed(events)
            else:
                self._unparsed.extend(events)
        except ReplyError as exc:  # off-contract bytes: the worker's protocol error
            raise self._backend._translate(exc, "generate", self._call.request_id) from exc
        except StreamFailed as exc:
            backend = self._backend
            backend._request_failures += 1
            raise RemoteWorkerError(
                ErrorCode.ENGINE_ERROR,
                str(exc),
                retryable=True,
                worker_id=backend.worker_id,
                stage="generate",
                request_id=self._call.request_id,
            ) from None

    def receive_nowait(self) -> Delta:
        """A delta already parsed from what was read (else ``trio.WouldBlock``); no read."""
        delta = self._take()
        if delta is not None:
            return delta
        if self._parser.terminal_sent:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def set_sink(self, sink: Callable[[Delta], bool]) -> None:
        """Let the backend's read hub hand non-final deltas to ``sink`` (see :meth:`receive`).

        ``sink`` is called in the hub's task while this stream's reader waits
        in :meth:`receive` with nothing queued; it must not raise or block.
        Returning False resumes the reader with that delta, so the order of
        the deltas always holds.  Without a running hub (``[openai_http]
        shared_stream_reader`` off, a TLS connection, no ``epoll``) the stream
        reads only when its reader asks, and keeps the deltas for ``receive``.
        """
        self._sink = sink

    def _failure(self, exc: HttpClientError) -> WorkerDisconnected | RemoteWorkerError:
        backend, request_id = self._backend, self._call.request_id
        if self._down is not None:
            return WorkerDisconnected(
                f"worker {backend.worker_id} went down (health probes) while streaming "
                f"{request_id!r}: {self._down}"
            )
        return backend._translate(exc, "generate", request_id)

    def _end(self) -> Delta:
        final = self._parser.end_of_stream()
        if final is None:
            raise WorkerDisconnected(
                f"worker {self._backend.worker_id} ended the stream of "
                f"{self._call.request_id!r} without a finish reason"
            )
        return final


class _ErrorScope:
    """A context that re-raises HTTP client and contract errors as the router's errors.

    A plain class rather than a generator-based context manager: several are
    entered per request.
    """

    __slots__ = ("_backend", "_request_id", "_stage")

    def __init__(self, backend: OpenAIHttpBackend, stage: str, request_id: str) -> None:
        self._backend = backend
        self._stage = stage
        self._request_id = request_id

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Returns None: an exception is never swallowed, only replaced.
        if isinstance(exc, HttpClientError | ReplyError):
            raise self._backend._translate(exc, self._stage, self._request_id) from exc


class _UntilDown:
    """A scope around a wait for the worker's answer that its going down ends.

    The backend cancels every such scope when the health probes (or a refused
    connection) take the worker down; the wait then raises
    ``WorkerDisconnected``.  The HTTP client closes the cancelled request's
    connection, so the server aborts whatever it may still do for it.  A plain
    class rather than a generator-based context manager, like :class:`_ErrorScope`.
    """

    __slots__ = ("_backend", "_request_id", "_scope")

    def __init__(self, backend: OpenAIHttpBackend, request_id: str) -> None:
        self._backend = backend
        self._request_id = request_id
        self._scope = trio.CancelScope()

    def __enter__(self) -> None:
        self._scope.__enter__()
        self._backend._waiting.add(self._scope)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Returns None: only the scope's own cancellation is caught, and replaced.
        backend = self._backend
        backend._waiting.discard(self._scope)
        self._scope.__exit__(exc_type, exc, traceback)
        if self._scope.cancelled_caught:
            raise WorkerDisconnected(
                f"worker {backend.worker_id} went down (health probes) while "
                f"{self._request_id!r} waited for its answer: {backend._down_reason}"
            ) from None


class OpenAIHttpBackend:
    """One ``vllm serve`` instance, as the stage actors see it (a ``ManagedBackend``).

    See the module docstring for health, the contract, errors and release.

    Args:
        worker_id: the router's name for the worker (logs, errors).
        base_url: ``http://HOST:PORT`` (a path prefix is allowed).
        model: the served model name put in every body.
        settings: timeouts, limits, probing, release policy.
        ledger: hand-offs shared with the router's other ``openai_http``
            backends (default: a private one, which makes ``consume`` a no-op).
        stage: the pool the worker serves, for error reports.
    """

    def __init__(
        self,
        worker_id: str,
        base_url: str,
        *,
        model: str,
        settings: OpenAIHttpSettings = DEFAULT_SETTINGS,
        ledger: HandoffLedger | None = None,
        stage: str = "",
    ) -> None:
        self.worker_id = worker_id
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.settings = settings
        self.stage = stage
        if ledger is None:
            ledger = HandoffLedger(capacity=settings.ledger_capacity, lease_s=settings.kv_lease_s)
        self.ledger = ledger
        self._client: WorkerHttpClient | None = None
        self._running = False
        self.read_hub = ReadHub()  # reads the open streams while run() runs
        self._reachable = Hysteresis(
            failures_to_down=settings.failures_to_down, successes_to_up=settings.successes_to_up
        )
        self._healthy = Hysteresis(
            failures_to_down=settings.failures_to_down, successes_to_up=settings.successes_to_up
        )
        self._changed = trio.Event()
        self.requirement = WorkerRequirement(stage, model=model)
        self._model_problem: str | None = None  # from the latest readable /v1/models
        self._stage_problem: str | None = None  # from an unsupported_stage answer
        self._served: tuple[str, ...] | None = None
        self._lora = AdapterLoads()
        self._refused: str | None = None
        self._refusals = 0
        self._streams: set[OpenAIHttpDeltaStream] = set()  # open generate streams
        self._waiting: set[trio.CancelScope] = set()  # requests waiting for an answer
        self._down_reason = ""
        self._in_flight = 0
        self._aborts_sent = 0  # requests closed before their answer (vLLM aborts them)
        self._probes = 0
        self._probe_failures = 0
        self._requests = 0
        self._request_failures = 0
        self._releases_expired = 0
        self._releases_consumed = 0

    def __repr__(self) -> str:
        state = "ready" if self.status().ready else "down"
        return f"<OpenAIHttpBackend {self.worker_id} {self.base_url} {state}>"

    # ------------------------------------------------------------ introspection

    def status(self) -> BackendStatus:
        """What the latest probes say (no I/O); load is this router's open requests."""
        reachable = self._reachable.up
        return BackendStatus(
            connected=reachable,
            draining=False,
            ready=reachable and self._healthy.up and self._refused is None,
            worker_load=self._in_flight,
            aborts_sent=self._aborts_sent,
            refused=self._refused,
            refusals=self._refusals,
            adapters=self._lora.loaded,
        )

    @property
    def adapter_loads(self) -> int:
        """``POST /v1/load_lora_adapter`` calls this backend started."""
        return self._lora.loads

    def expect(self, requirement: WorkerRequirement) -> None:
        """Check the served models against ``requirement`` (the latest list at once).

        Without a model of its own, the requirement takes the model this
        backend puts in every body.
        """
        if requirement.model is None:
            requirement = replace(requirement, model=self.model)
        self.requirement = requirement
        if requirement.consumes_kv_handoff:
            self.ledger.add_consumer(self)
        if self._served is not None:
            self._model_problem = requirement.problem(models=self._served)
            self._judge()

    def statistics(self) -> OpenAIHttpStatistics:
        """A snapshot of the counters (cheap; safe at any time)."""
        status = self.status()
        return OpenAIHttpStatistics(
            worker_id=self.worker_id,
            connected=status.connected,
            ready=status.ready,
            in_flight=self._in_flight,
            probes=self._probes,
            probe_failures=self._probe_failures,
            requests=self._requests,
            request_failures=self._request_failures,
            releases_expired=self._releases_expired,
            releases_consumed=self._releases_consumed,
        )

    async def wait_connected(self) -> None:
        """Return once the server answers HTTP (at once if it does).

        Cancellation: safe.
        """
        while not self.status().connected:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()

    async def wait_ready(self) -> None:
        """Return once ``GET /health`` answers 200 (hysteresis applied).

        Cancellation: safe.
        """
        while not self.status().ready:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------------ health

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the connection pool and probe ``/health`` until cancelled.

        Reports started at once, before the first probe.

        Raises:
            trio.BusyResourceError: ``run`` is already running for this backend.

        Cancellation: closes every connection (requests in flight then fail
        with ``WorkerDisconnected``); the backend reads as down afterwards.
        Resource handling: the client is closed on every exit, shielded and
        bounded by ``CLEANUP_TIMEOUT_S``.
        """
        if self._running:
            raise trio.BusyResourceError(f"{self!r} is already running")
        self._running = True
        client = self._new_client(self.settings.max_connections)
        # Probes get a connection of their own: a pool saturated by requests
        # must not make a busy worker look dead.
        prober = self._new_client(1)
        self._client = client
        try:
            async with trio.open_nursery() as nursery:
                if self.settings.shared_stream_reader:
                    await nursery.start(self.read_hub.run)
                task_status.started()
                while True:
                    await self._probe(prober)
                    await trio.sleep(self.settings.health_interval_s)
        finally:
            self._client = None
            self._running = False
            self._set_down("its backend stopped", expected=True)
            self.ledger.remove_consumer(self)
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await prober.aclose()
                await client.aclose()

    def _new_client(self, max_connections: int) -> WorkerHttpClient:
        s = self.settings
        headers = [("authorization", f"Bearer {s.api_key}")] if s.api_key else []
        limits = ClientLimits(
            connect_timeout_s=s.connect_timeout_s,
            read_timeout_s=s.read_timeout_s,
            write_timeout_s=s.write_timeout_s,
            pool_timeout_s=s.pool_timeout_s,
            max_connections=max_connections,
            max_keepalive_connections=min(max_connections, s.max_keepalive_connections),
            keepalive_expiry_s=s.keepalive_expiry_s,
        )
        # Workers are reached directly: no proxy settings from the environment,
        # no redirects followed.
        return WorkerHttpClient(self.base_url, limits, headers=headers, tls_context=_tls_context)

    async def _probe(self, client: WorkerHttpClient) -> None:
        """One ``GET /health`` (then ``GET /v1/models``); feeds the trackers and the refusal.

        Both requests share ``health_timeout_s``.
        """
        self._probes += 1
        status: int | None = None
        served: tuple[str, ...] | None = None
        with trio.move_on_after(self.settings.health_timeout_s):
            try:
                response = await client.request("GET", "/health")
                try:
                    await response.read_all(_MAX_PROBE_BYTES)
                finally:
                    await response.aclose()
                status = response.status
                if status == 200:
                    served = await self._read_models(client)
            except HttpClientError as exc:
                logger.debug("worker %s: health probe failed: %r", self.worker_id, exc)
        if status != 200:
            self._probe_failures += 1
            self._stage_problem = None  # a server seen down may come back as another role
        if served is not None:
            self._served = served
            self._model_problem = self.requirement.problem(models=served)
        self._judge()
        changed = self._reachable.observe(status is not None)
        changed |= self._healthy.observe(status == 200)
        if changed:
            self._announce(f"/health answered {status}" if status else "no answer to /health")

    async def _read_models(self, client: WorkerHttpClient) -> tuple[str, ...] | None:
        """The models ``GET /v1/models`` lists, or None when it gives no readable list.

        Raises:
            HttpClientError: the request failed (the probe counts it).
        """
        response = await client.request("GET", "/v1/models")
        try:
            data = await response.read_all(_MAX_PROBE_BYTES)
        finally:
            await response.aclose()
        if response.status != 200:
            logger.debug("worker %s: /v1/models answered %s", self.worker_id, response.status)
            return None
        try:
            listing = json_object(data)
            served = served_models(listing)
            self._lora.announced = listed_adapters(listing, self.model)
            return served
        except ReplyError as exc:
            logger.debug("worker %s: unreadable /v1/models: %s", self.worker_id, exc)
            return None

    def _judge(self) -> None:
        """Refuse the worker, or accept it again, from the latest evidence; log changes."""
        problem = self._model_problem or self._stage_problem
        if problem == self._refused:
            return
        self._refused = problem
        if problem is None:
            logger.info("worker %s at %s is accepted again", self.worker_id, self.base_url)
        else:
            self._refusals += 1
            logger.error(
                "refusing worker %s at %s: %s; it gets no requests until it serves what "
                "the pool needs",
                self.worker_id,
                self.base_url,
                problem,
            )
        self._changed.set()
        self._changed = trio.Event()

    def _announce(self, why: str, *, expected: bool = False) -> None:
        status = self.status()
        if status.ready:
            logger.info("worker %s at %s is ready", self.worker_id, self.base_url)
        else:
            logger.log(
                logging.DEBUG if expected else logging.WARNING,
                "worker %s at %s is down (connected=%s): %s",
                self.worker_id,
                self.base_url,
                status.connected,
                why,
            )
        self._changed.set()
        self._changed = trio.Event()
        if not status.ready:
            # A server can keep a stream's connection open after its engine
            # died (vLLM does on shutdown), and a stalled one answers nothing:
            # fail what waits on it now, rather than after a timeout.
            self._down_reason = why
            for stream in list(self._streams):
                stream.abandon(why)
            for scope in list(self._waiting):
                scope.cancel(reason=f"worker {self.worker_id} went down: {why}")

    def _set_down(self, why: str, *, expected: bool = False) -> None:
        self._lora.forget()
        if self._reachable.force_down() | self._healthy.force_down():
            self._announce(why, expected=expected)

    # ------------------------------------------------------------ error mapping

    def _mapped(self, stage: str, request_id: str) -> _ErrorScope:
        """``with self._mapped(stage, request_id):`` maps errors through :meth:`_translate`."""
        return _ErrorScope(self, stage, request_id)

    def _translate(
        self, exc: HttpClientError | ReplyError, stage: str, request_id: str
    ) -> WorkerDisconnected | RemoteWorkerError:
        """The router's error for an HTTP client or contract error (the one mapping)."""
        self._request_failures += 1
        where = f"worker {self.worker_id} at {self.base_url}"
        if isinstance(exc, ConnectFailed):
            self._set_down(f"cannot connect: {exc}")
            return WorkerDisconnected(f"{where}: cannot connect ({exc})")
        if isinstance(exc, RequestTimeout):
            return self._remote("timeout", str(exc), stage, request_id, True)
        if isinstance(exc, ConnectionLost | BadResponse):
            return WorkerDisconnected(f"{where}: connection lost ({exc})")
        # ResponseTooLarge, ReplyError: the reply breaks the contract or a limit.
        return self._remote(ErrorCode.PROTOCOL_ERROR, f"bad reply: {exc}", stage, request_id, True)

    def _remote(
        self, code: str, message: str, stage: str, request_id: str, retryable: bool
    ) -> RemoteWorkerError:
        return RemoteWorkerError(
            code,
            message,
            retryable=retryable,
            worker_id=self.worker_id,
            stage=stage,
            request_id=request_id,
        )

    def _status_error(
        self, status: int, data: bytes, stage: str, request_id: str
    ) -> RemoteWorkerError:
        """A non-200 answer: 429 and 5xx may succeed elsewhere, other 4xx never.

        An ``unsupported_stage`` refusal says the server runs another role:
        the worker is refused, and the request may succeed on another worker.
        """
        self._request_failures += 1
        message = f"HTTP {status}: {error_message(data)}"
        if error_code(data) == ErrorCode.UNSUPPORTED_STAGE:
            self._stage_problem = (
                f"it answered a {stage} request with unsupported_stage ({message})"
            )
            self._judge()
            return self._remote(ErrorCode.UNSUPPORTED_STAGE, message, stage, request_id, True)
        if status >= 500 or status in _RETRYABLE_STATUSES:
            code = ErrorCode.OVERLOADED if status in (429, 503) else ErrorCode.ENGINE_ERROR
            return self._remote(code, message, stage, request_id, True)
        # A refused KV handle keeps its own code: it blames P's worker, not the
        # client; so does a missing encoder output (the router encodes it again).
        answered = error_code(data)
        kept = answered if answered in _HANDOFF_CODES else ErrorCode.INVALID_REQUEST
        refusal = self._remote(str(kept), message, stage, request_id, False)
        refusal.param = error_param(data)
        return refusal

    def _require_client(self) -> WorkerHttpClient:
        client = self._client
        if client is None:
            raise WorkerDisconnected(
                f"worker {self.worker_id} at {self.base_url}: its backend is not running"
            )
        return client

    # ------------------------------------------------------------ requests

    async def _send(self, client: WorkerHttpClient, call: HttpCall) -> Response:
        """Send ``call``; return once the status line and headers arrived.

        The caller must ``aclose()`` the reply.
        """
        body = _encode_json(call.body).encode()
        headers = (("x-request-id", call.request_id), *trace_headers())
        return await client.request("POST", call.path, body, headers=headers)

    async def _post(self, call: HttpCall, stage: str) -> dict[str, object]:
        """POST ``call`` and return its JSON reply (see the module docstring for errors).

        Cancellation: the connection is closed, so vLLM aborts the request.
        """
        client = self._require_client()
        self._requests += 1
        self._in_flight += 1
        answered = False
        try:
            with self._mapped(stage, call.request_id), _UntilDown(self, call.request_id):
                reply = await self._send(client, call)
                try:
                    data = await reply.read_all(self.settings.max_response_bytes)
                    answered = True
                finally:
                    await reply.aclose()
                if reply.status != 200:
                    raise self._status_error(reply.status, data, stage, call.request_id)
                return json_object(data)
        finally:
            self._in_flight -= 1
            self._aborts_sent += not answered

    async def run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        """Run an encode or prefill request on the vLLM server.

        Raises:
            RemoteWorkerError: vLLM answered with an error, too late, or off-contract.
            WorkerDisconnected: no connection, or it broke.
            InvalidRequest: the request cannot be expressed as an OpenAI body.

        Cancellation: every open HTTP request is closed (vLLM aborts them).
        Backpressure: waits for a pooled connection (``pool_timeout_s``).
        """
        if isinstance(request, EncodeRequest):
            return await self._encode(request)
        return await self._prefill(request)

    async def _encode(self, request: EncodeRequest) -> StageResult:
        """One call per media item, concurrently; their encoder params merged."""
        found: list[dict[str, object] | None] = [None] * len(request.media)

        async def one(index: int) -> None:
            call = encode_call(request, index, model=self.model, suffix=secrets.token_hex(3))
            reply = await self._post(call, "encode")
            with self._mapped("encode", call.request_id):
                found[index] = encode_result(call.request_id, reply).ec_transfer_params

        if len(request.media) == 1:
            await one(0)
        else:
            with single_exception():
                async with trio.open_nursery() as nursery:
                    for index in range(len(request.media)):
                        nursery.start_soon(one, index, name=f"encode:{request.request_id}:{index}")
        merged: dict[str, object] = {}
        for params in found:
            merged.update(params or {})
        return StageResult(request.request_id, ec_transfer_params=merged or None)

    async def _prefill(self, request: PrefillRequest) -> StageResult:
        await self._ensure_adapter(request.lora_adapter)
        call = prefill_call(
            request,
            model=request.lora_adapter or self.model,
            return_token_ids=self.settings.return_token_ids,
        )
        reply = await self._post(call, "prefill")
        with self._mapped("prefill", call.request_id):
            result = prefill_result(call.request_id, reply)
        kv = result.kv_transfer_params
        if kv is not None and self.settings.release_policy == "consume":
            replay = Replay(
                call.path, consume_body(call.body, kv), call.request_id, trio.current_time()
            )
            self.ledger.record(kv, replay)
        return result

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[OpenAIHttpDeltaStream]:
        """Send a streamed generate request; the context yields its delta stream.

        Raises:
            RemoteWorkerError: vLLM refused the request (on entry) or failed mid-stream.
            WorkerDisconnected: no connection, or it broke.

        Cancellation: leaving the context before the terminal delta closes the
        connection; vLLM aborts the request (and, for D, tells P to free the
        KV blocks it was pulling).  Closing is shielded and bounded.
        Backpressure: see :meth:`OpenAIHttpDeltaStream.receive`.
        """
        await self._ensure_adapter(request.lora_adapter)
        call = generate_call(
            request,
            model=request.lora_adapter or self.model,
            return_token_ids=self.settings.return_token_ids,
        )
        client = self._require_client()
        kv = request.kv_transfer_params
        if kv is not None:
            self.ledger.add_consumer(self)
        self._requests += 1
        self._in_flight += 1
        try:
            with self._mapped("generate", call.request_id), _UntilDown(self, call.request_id):
                reply = await self._send(client, call)
            finished = False
            try:
                if reply.status != 200:
                    with self._mapped("generate", call.request_id):
                        data = await reply.read_all(self.settings.max_response_bytes)
                    raise self._status_error(reply.status, data, "generate", call.request_id)
                if kv is not None:
                    # vLLM has the request now: from here on it frees P's blocks
                    # itself, also when D is aborted (NIXL notifies P).
                    self.ledger.delivered(kv)
                stream = OpenAIHttpDeltaStream(self, call, reply)
                self._streams.add(stream)
                try:
                    yield stream
                finally:
                    self._streams.discard(stream)
                    finished = stream.finished
                    if not finished:
                        self._aborts_sent += 1
                        logger.debug(
                            "worker %s: closing the stream of %r early",
                            self.worker_id,
                            call.request_id,
                        )
            finally:
                # A stream whose terminal delta went out keeps its connection if
                # the last bytes ([DONE], the end of the body) follow in time.
                # A stream left early is closed at once: vLLM aborts the request.
                await reply.aclose(drain_s=_DRAIN_S if finished else 0.0)
        finally:
            self._in_flight -= 1

    # ------------------------------------------------------------ LoRA adapters

    async def _ensure_adapter(self, name: str | None) -> None:
        """Load adapter ``name`` first, if the worker lacks it and the pool allows loading it.

        Raises:
            AdapterLoadFailed: the load was refused, failed, or took longer
                than ``lora_load_timeout_s``.

        Cancellation: safe; a load cancelled here is started again by the next request.
        Backpressure: requests for an adapter being loaded wait for that one load.
        """
        adapter = None if name is None else self.requirement.loadable(name)
        if adapter is None or adapter.name in self._lora.loaded:
            return
        await self._lora.ensure(adapter.name, functools.partial(self._load_adapter, adapter))

    async def _load_adapter(self, adapter: LoraAdapter) -> None:
        """``POST /v1/load_lora_adapter`` once, within ``lora_load_timeout_s``.

        Raises:
            AdapterLoadFailed: any answer but 200, no answer in time, or no connection.
        """
        client = self._require_client()
        body: dict[str, object] = {"lora_name": adapter.name, "lora_path": adapter.path}
        call = HttpCall(LOAD_LORA_PATH, body, f"load-lora-{secrets.token_hex(4)}")
        timeout = self.settings.lora_load_timeout_s
        logger.info("worker %s: loading LoRA adapter %r", self.worker_id, adapter.name)
        with trio.move_on_after(timeout):
            try:
                reply = await self._send(client, call)
                try:
                    data = await reply.read_all(_MAX_PROBE_BYTES)
                finally:
                    await reply.aclose()
            except HttpClientError as exc:
                raise self._load_failed(adapter, f"the request failed: {exc}") from None
            if reply.status != 200:
                why = error_message(data) or f"HTTP {reply.status}"
                raise self._load_failed(adapter, f"it answered {reply.status}: {why}")
            return
        raise self._load_failed(adapter, f"no answer within {timeout:g}s")

    def _load_failed(self, adapter: LoraAdapter, why: str) -> AdapterLoadFailed:
        logger.warning("worker %s: loading LoRA adapter %r: %s", self.worker_id, adapter.name, why)
        return AdapterLoadFailed(why, adapter=adapter.name, worker_id=self.worker_id)

    # ------------------------------------------------------------ release

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Free a prefill's KV blocks that no decoder will claim, as far as vLLM allows.

        ``expire``: nothing to do; returns False (P's lease frees the blocks).
        ``consume``: if no decoder accepted this hand-off yet and one is ready,
        it is sent the one-token decode request; True once it answered.

        Raises:
            RemoteWorkerError, WorkerDisconnected: the consuming decoder failed.

        Cancellation: the consume request is closed (the decoder aborts it and
        tells P, which frees the blocks just the same).
        Backpressure: waits for a pooled connection to the decoder.
        """
        if self.settings.release_policy == "consume":
            replay = self.ledger.take(kv_transfer_params, trio.current_time())
            if replay is None:
                logger.debug(
                    "worker %s: KV hand-off already with a decoder (or past its lease)",
                    self.worker_id,
                )
                await trio.lowlevel.checkpoint()
                return False
            consumer = self.ledger.pick_consumer()
            if consumer is not None:
                consumed = await consumer.consume(replay)
                self._releases_consumed += consumed
                return consumed
            logger.warning(
                "worker %s: no decoder is ready to consume the KV blocks of %r",
                self.worker_id,
                replay.request_id,
            )
        self._releases_expired += 1
        logger.info(
            "worker %s: the KV blocks of a request that never reached a decoder stay on "
            "the prefill worker until its connector's lease expires",
            self.worker_id,
        )
        await trio.lowlevel.checkpoint()
        return False

    async def consume(self, replay: Replay) -> bool:
        """Decode ``replay`` (one token, not streamed) so the decoder pulls P's blocks.

        Raises:
            RemoteWorkerError, WorkerDisconnected: as for a stage call.

        Cancellation: the request is closed; vLLM aborts it.
        Backpressure: waits for a pooled connection.
        """
        call = HttpCall(replay.path, replay.body, replay.request_id)
        await self._post(call, "release")
        logger.info(
            "worker %s consumed the unclaimed KV blocks of %r", self.worker_id, replay.request_id
        )
        return True

    async def models(self) -> dict[str, object]:
        """The server's ``GET /v1/models`` answer, as it sent it.

        Raises:
            RemoteWorkerError, WorkerDisconnected: as for a stage call.

        Cancellation: safe; the connection is closed.
        Backpressure: waits for a pooled connection.
        """
        client = self._require_client()
        with self._mapped("models", "models"):
            reply = await client.request("GET", "/v1/models")
            try:
                data = await reply.read_all(self.settings.max_response_bytes)
            finally:
                await reply.aclose()
            if reply.status != 200:
                raise self._status_error(reply.status, data, "models", "models")
            return json_object(data)


class OpenAIHttpBackendFactory:
    """Builds the ``openai_http`` backends of one router; they share one hand-off ledger.

    A backend becomes a consumer of the ledger when its pool's requirement
    says its stage consumes KV hand-offs (the decode actor's
    ``consumes_kv_handoff``), or when it first serves a decode.

    Args:
        settings: applied to every backend built.
    """

    def __init__(self, settings: OpenAIHttpSettings = DEFAULT_SETTINGS) -> None:
        self.settings = settings
        self.ledger = HandoffLedger(capacity=settings.ledger_capacity, lease_s=settings.kv_lease_s)

    def build(self, worker_id: str, address: str, *, model: str, stage: str) -> OpenAIHttpBackend:
        """Build the backend of the worker ``worker_id`` at ``address``.

        Args:
            model: the model its pool serves.
            stage: its pool's stage, or "" for a worker in no pool yet.

        Raises:
            ConfigError: the address is not an ``http(s)://`` URL (a worker
                added at run time has not been validated with the config).
        """
        check_http_url(address, key=f"worker {worker_id!r} address")
        return OpenAIHttpBackend(
            worker_id,
            address,
            model=model,
            settings=self.settings,
            ledger=self.ledger,
            stage=stage,
        )
