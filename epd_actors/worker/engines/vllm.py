"""The vLLM engine: vLLM's ``AsyncLLM`` (v1) behind the worker's :class:`Engine` contract.

Theory of operation
-------------------
``AsyncLLM`` is asyncio code; the worker runtime is Trio.  :func:`open_vllm_engine`
starts an :mod:`.asyncio_bridge` (one thread running a private asyncio loop),
builds the ``AsyncLLM`` *on that loop* (it binds its output handler and ZMQ
sockets to the running loop), and yields a :class:`VllmEngine` whose stage
coroutines are plain Trio code:

* **encode** (E): one vLLM request per distinct media item -- a one-message chat
  holding just that item, ``max_tokens=1`` -- on an engine started with an
  ``ec_producer`` connector and ``--mm-encoder-only``, so the encoder output is
  written to the encoder cache.  The result merges the ``ec_transfer_params``
  vLLM returns (keyed by vLLM's media hash).
* **prefill** (P): ``max_tokens=1`` with ``kv_transfer_params={"do_remote_decode":
  True, ...}`` in ``SamplingParams.extra_args``; the result carries the final
  ``RequestOutput.kv_transfer_params`` (what a decoder needs to pull the KV).
* **generate** (D, PD): D puts P's ``kv_transfer_params`` in ``extra_args``.
  Outputs stream in ``RequestOutputKind.DELTA`` mode (each output carries only
  new tokens); the final ``Delta`` has ``finish_reason``, ``usage`` and timings.

E and P wait for one final output (``FINAL_ONLY``), costing two thread hops per
request.  A generate request is a bridge *stream*: one hop per ``RequestOutput``
towards Trio and one per consumed batch back.  vLLM merges the tokens produced
while nobody read into the next output, so a slow consumer gets fewer, larger
batches, never more hops.  Backpressure: at most ``stream_buffer`` outputs exist
between vLLM's generator and ``emit``; past that the asyncio side stops
reading (vLLM keeps decoding the request and merges its tokens).

Cancellation: every vLLM request id the engine submitted is tracked until vLLM
reported it finished.  When a stage call ends any other way (cancelled, failed),
the bridge first cancels the asyncio task iterating ``generate`` (vLLM aborts
the request itself when its generator is cancelled) and then the engine calls
``AsyncLLM.abort`` explicitly; the Trio call returns only after both completed,
each shielded and bounded by ``CLEANUP_TIMEOUT_S``.

``release``: vLLM has no API to free the KV blocks of a *finished* prefill; the
KV connector owns them until a decoder pulls them or its lease expires (NIXL:
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default), and ``AsyncLLM.abort``
of a finished request id does nothing.  So ``release`` can only abort a prefill
that is still running (matched through ``remote_request_id``) and otherwise
answers ``False``.

Errors: vLLM's client errors (``VLLMClientError``: request validation, and
``ValueError``/``TypeError``) become ``invalid_request``; its admission refusals
(``GracefulHTTPError``: queue overflow) a retryable ``overloaded``; its
engine-dead error (or ``AsyncLLM.errored``) ``EngineCrashed``, which takes the
worker down; anything else is a retryable ``engine_error``.  A request vLLM
finished with ``abort``/``error`` is a retryable ``engine_error``.

vLLM itself is imported only by :func:`build_vllm_api`, on the bridge thread,
when ``--engine vllm`` is chosen.  The adapter's whole contract with vLLM is
:class:`AsyncLLMLike` plus a sampling-params constructor (:class:`VllmApi`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ...errors import ConfigError, EngineCrashed, EngineError
from ...limits import CLEANUP_TIMEOUT_S
from ...protocol import (
    ROLE_TRAITS,
    ChatMessage,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
    StageResult,
)
from .asyncio_bridge import BridgeClosed, open_asyncio_bridge
from .vllm_args import VLLM_MISSING, VllmOptions, engine_args_for_role, engine_cli_args
from .vllm_io import (
    VLLM_OPTIONS,
    MediaDecoder,
    RenderedPrompt,
    RequestOutputLike,
    StreamAccumulator,
    check_finish,
    decode_media_item,
    render_prompt,
    sampling_kwargs,
    wire_params,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

    from ...protocol import MediaItem
    from ..engine import DeltaSink, Engine
    from .asyncio_bridge import AsyncioBridge

__all__ = [
    "ENGINE_SHUTDOWN_TIMEOUT_S",
    "REMOTE_DECODE_PARAMS",
    "VLLM_STREAM_BUFFER",
    "ApiFactory",
    "AsyncLLMLike",
    "VllmApi",
    "VllmEngine",
    "VllmOptions",
    "VllmStatistics",
    "build_vllm_api",
    "engine_args_for_role",
    "open_vllm_engine",
]

logger = logging.getLogger(__name__)

# RequestOutputs that may exist between vLLM's generator and the engine's
# ``emit`` for one generate request (outputs).  Each is already a batch of
# tokens (DELTA mode), so a small number keeps the asyncio side one step ahead
# without letting it read far past a slow socket.
VLLM_STREAM_BUFFER: Final = 8

# Seconds ``AsyncLLM.shutdown()`` may take (it stops the engine-core process)
# when the engine closes, before it is abandoned.
ENGINE_SHUTDOWN_TIMEOUT_S: Final = 30.0

# What a prefill asks of the KV connector (vLLM's P/D proxies send the same).
REMOTE_DECODE_PARAMS: Final[Mapping[str, object]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Sampling of the one-token requests E sends (nothing is sampled that matters).
_ENCODE_SAMPLING: Final = SamplingParams(max_tokens=1, temperature=0.0)


# ---------------------------------------------------------------- the contract with vLLM


class AsyncLLMLike(Protocol):
    """Everything the adapter uses of ``vllm.v1.engine.async_llm.AsyncLLM``.

    Every method is called on the bridge's asyncio loop thread.
    """

    def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutputLike]:
        """Submit a request; iterate its outputs.  Cancelling the iteration aborts it.

        ``trace_headers`` is passed only for a traced request (see
        :func:`vllm_trace_headers`).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request by the id given to ``generate``; unknown ids are fine."""
        ...

    def get_tokenizer(self) -> Any:
        """The tokenizer (or an awaitable of it, in older vLLM)."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine core died."""
        ...

    def shutdown(self) -> None:
        """Stop the engine core and release its resources."""
        ...


@dataclass(frozen=True, slots=True)
class VllmApi:
    """An ``AsyncLLM`` and the few vLLM types the adapter needs with it.

    Attributes:
        llm: the engine.
        make_sampling_params: builds vLLM's ``SamplingParams`` from
            :func:`sampling_kwargs` (``output_kind`` is ``"delta"`` or
            ``"final_only"``).
        dead_errors: exception types meaning "the engine core died"
            (``EngineDeadError``).
        client_errors: exception types meaning "this request is wrong"
            (``VLLMClientError``: validation, unknown LoRA, ...), besides
            ``ValueError`` and ``TypeError``.
        overload_errors: exception types meaning "full, try later"
            (``GracefulHTTPError``: queue overflow, too many queued tokens).
        default_sampling: the model's generation-config sampling defaults
            (vLLM's ``ModelConfig.get_diff_sampling_param()``), applied to the
            fields a request leaves unset, as vLLM's OpenAI server does.
    """

    llm: AsyncLLMLike
    make_sampling_params: Callable[[dict[str, Any]], Any]
    dead_errors: tuple[type[BaseException], ...] = ()
    client_errors: tuple[type[BaseException], ...] = ()
    overload_errors: tuple[type[BaseException], ...] = ()
    default_sampling: Mapping[str, Any] = field(default_factory=dict)


ApiFactory = Callable[[list[str]], VllmApi]
"""Builds the engine from vLLM command-line engine arguments; runs on the bridge thread."""

# ---------------------------------------------------------------- asyncio side (bridge thread)


def vllm_trace_headers(traceparent: str | None) -> dict[str, str] | None:
    """The ``trace_headers`` vLLM's ``AsyncLLM.generate`` takes for a stage request.

    vLLM (with ``--otlp-traces-endpoint``) extracts the W3C context from these
    headers and makes its ``llm_request`` span a child of it; None (and the
    argument left out, as older engines lack it) for an untraced request.
    """
    return None if traceparent is None else {"traceparent": traceparent}


def _outputs(
    llm: AsyncLLMLike,
    prompt: dict[str, Any],
    params: Any,
    request_id: str,
    tokenization_kwargs: dict[str, Any] | None,
    trace_headers: dict[str, str] | None = None,
) -> AsyncIterator[RequestOutputLike]:
    if trace_headers is None:
        return llm.generate(prompt, params, request_id, tokenization_kwargs=tokenization_kwargs)
    return llm.generate(
        prompt,
        params,
        request_id,
        tokenization_kwargs=tokenization_kwargs,
        trace_headers=trace_headers,
    )


async def _final_output(
    llm: AsyncLLMLike,
    prompt: dict[str, Any],
    params: Any,
    request_id: str,
    tokenization_kwargs: dict[str, Any] | None,
    trace_headers: dict[str, str] | None = None,
) -> RequestOutputLike | None:
    final: RequestOutputLike | None = None
    async for output in _outputs(
        llm, prompt, params, request_id, tokenization_kwargs, trace_headers
    ):
        final = output
    return final


async def _abort_all(llm: AsyncLLMLike, request_ids: list[str]) -> None:
    for request_id in request_ids:
        await llm.abort(request_id)


async def _tokenizer_of(llm: AsyncLLMLike) -> Any:
    tokenizer = llm.get_tokenizer()
    if inspect.isawaitable(tokenizer):
        tokenizer = await tokenizer
    return tokenizer


# ---------------------------------------------------------------- the engine


@dataclass(frozen=True, slots=True)
class VllmStatistics:
    """A snapshot of one :class:`VllmEngine`.

    Attributes:
        in_flight: stage calls holding vLLM requests now.
        vllm_requests: vLLM requests submitted (E submits one per media item).
        aborts: ``abort`` calls received.
        vllm_aborts: vLLM request ids aborted (cleanup after a cancel or failure).
        releases_found, releases_not_found: ``release`` outcomes.
        dead: the engine core died.
    """

    in_flight: int
    vllm_requests: int
    aborts: int
    vllm_aborts: int
    releases_found: int
    releases_not_found: int
    dead: bool


class VllmEngine:
    """vLLM's ``AsyncLLM`` for one role; obtain one with :func:`open_vllm_engine`.

    Args:
        role: the stage this engine serves (it must match how vLLM was started).
        model: the model name announced to routers.
        api: the engine and its sampling-params constructor.
        bridge: the asyncio bridge ``api.llm`` lives on.
        tokenizer: for chat templates (None: chat prompts are refused).
        chat_template: a template replacing the tokenizer's.
        decode_media: turns media bytes into ``multi_modal_data`` values.
        stream_buffer: outputs that may wait between vLLM and ``emit``.
    """

    capabilities: tuple[str, ...] = ("vllm",)
    supported_options: frozenset[str] = VLLM_OPTIONS

    def __init__(
        self,
        role: Role,
        *,
        model: str,
        api: VllmApi,
        bridge: AsyncioBridge,
        tokenizer: Any,
        chat_template: str | None = None,
        decode_media: MediaDecoder = decode_media_item,
        stream_buffer: int = VLLM_STREAM_BUFFER,
    ) -> None:
        self.role = Role(role)
        self.model = model
        self._api = api
        self._llm = api.llm
        self._bridge = bridge
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._decode_media = decode_media
        self._stream_buffer = stream_buffer
        self._live: dict[str, set[str]] = {}
        self._dead = False
        self._counts = {
            "vllm_requests": 0,
            "aborts": 0,
            "vllm_aborts": 0,
            "releases_found": 0,
            "releases_not_found": 0,
        }

    def __repr__(self) -> str:
        state = "dead" if self._dead else f"in_flight={len(self._live)}"
        return f"<VllmEngine {self.model} role={self.role.value} {state}>"

    def statistics(self) -> VllmStatistics:
        return VllmStatistics(in_flight=len(self._live), dead=self._dead, **self._counts)

    # -- Engine protocol

    async def encode(self, request: EncodeRequest) -> StageResult:
        """Run the encoder on each distinct media item (one ``max_tokens=1`` request each).

        Items run one after the other (a router sends E one item per request).

        Returns:
            The merged ``ec_transfer_params`` vLLM returned (None if it returned
            none: a connector such as ``ECExampleConnector`` finds the output by
            media hash) and timings ``encode_s``, ``total_s``.

        Raises:
            EngineError: ``unsupported_stage``, ``invalid_request``,
                ``engine_error`` (see the module docstring).
            EngineCrashed: the engine core died.

        Cancellation: aborts the running item's vLLM request and waits for it.
        Backpressure: none (two thread hops per item).
        """
        self._check_stage("encode")
        start = trio.current_time()
        distinct = {item.content_hash: item for item in request.media}
        params = self._sampling_params(_ENCODE_SAMPLING, output_kind="final_only", max_tokens=1)
        merged: dict[str, object] = {}
        async with self._tracking(request.request_id) as live:
            for index, item in enumerate(distinct.values()):
                one = Prompt(messages=(ChatMessage("user", (0,)),))
                rendered = await self._render(one, (item,), request.options)
                final = await self._complete(
                    f"{request.request_id}:{index}",
                    rendered,
                    params,
                    live,
                    vllm_trace_headers(request.traceparent),
                )
                params_out = getattr(final, "ec_transfer_params", None)
                merged.update(wire_params(params_out, "ec_transfer_params") or {})
        total = trio.current_time() - start
        return StageResult(
            request.request_id,
            ec_transfer_params=merged or None,
            timings={"encode_s": total, "total_s": total},
        )

    async def prefill(self, request: PrefillRequest) -> StageResult:
        """Prefill with ``do_remote_decode``; return the KV connector's transfer params.

        The request's own ``kv_transfer_params`` (if any) are laid over
        :data:`REMOTE_DECODE_PARAMS`; its ``ec_transfer_params`` go to vLLM too.

        Returns:
            ``kv_transfer_params`` from the final ``RequestOutput`` (None with
            connectors that need none, e.g. ``ExampleConnector``),
            ``prompt_tokens`` and timings ``prefill_s``, ``total_s``.

        Raises:
            EngineError, EngineCrashed: as :meth:`encode`.

        Cancellation: aborts the vLLM request and waits for it.
        Backpressure: none (two thread hops).
        """
        self._check_stage("prefill")
        start = trio.current_time()
        rendered = await self._render(request.prompt, request.media, request.options)
        extra: dict[str, Any] = {
            "kv_transfer_params": {**REMOTE_DECODE_PARAMS, **(request.kv_transfer_params or {})}
        }
        if request.ec_transfer_params:
            extra["ec_transfer_params"] = dict(request.ec_transfer_params)
        params = self._sampling_params(
            request.sampling,
            output_kind="final_only",
            max_tokens=1,
            extra_args=extra,
            options=request.options,
        )
        begun = trio.current_time()
        async with self._tracking(request.request_id) as live:
            final = await self._complete(
                request.request_id, rendered, params, live, vllm_trace_headers(request.traceparent)
            )
        now = trio.current_time()
        return StageResult(
            request.request_id,
            kv_transfer_params=wire_params(final.kv_transfer_params, "kv_transfer_params"),
            prompt_tokens=len(final.prompt_token_ids or ()),
            timings={"prefill_s": now - begun, "total_s": now - start},
        )

    async def generate(self, request: GenerateRequest, emit: DeltaSink) -> None:
        """Stream vLLM's output; D passes P's ``kv_transfer_params`` to vLLM.

        Each batch of outputs received together becomes one ``Delta``; the last
        has ``finish_reason``, ``usage`` (prompt tokens as vLLM counted them,
        completion tokens) and timings ``ttft_s``, ``decode_s``, ``total_s``.
        ``logprobs`` (the sampled tokens') when the request asks for them.

        Raises:
            EngineError, EngineCrashed: as :meth:`encode`; ``engine_error`` also
                when vLLM ends the stream unfinished or finishes it with ``abort``.

        Cancellation: leaving early (cancelled, or ``emit`` failed) cancels the
        asyncio side and aborts the vLLM request; returns after both completed.
        Backpressure: awaits ``emit`` for every delta; at most ``stream_buffer``
        outputs wait for it.
        """
        self._check_stage("generate")
        start = trio.current_time()
        rendered = await self._render(request.prompt, request.media, request.options)
        extra: dict[str, Any] = {}
        if request.kv_transfer_params is not None:
            extra["kv_transfer_params"] = dict(request.kv_transfer_params)
        if request.ec_transfer_params and not ROLE_TRAITS[self.role].takes_kv:
            extra["ec_transfer_params"] = dict(request.ec_transfer_params)
        params = self._sampling_params(
            request.sampling, output_kind="delta", extra_args=extra, options=request.options
        )
        accumulator = StreamAccumulator(
            request.request_id,
            want_logprobs=request.sampling.logprobs is not None,
            start=start,
            alternatives=request.sampling.logprobs or 0,
        )
        async with self._tracking(request.request_id) as live:
            self._submitted(request.request_id, live)
            async with self._bridge.open_stream(
                _outputs,
                self._llm,
                rendered.prompt,
                params,
                request.request_id,
                rendered.tokenization_kwargs,
                vllm_trace_headers(request.traceparent),
                max_buffer=self._stream_buffer,
            ) as stream:
                while True:
                    with self._vllm_errors():
                        try:
                            outputs = await stream.receive_batch()
                        except trio.EndOfChannel:
                            break
                    delta = accumulator.take(outputs, trio.current_time())
                    if accumulator.finish_reason is not None:
                        live.discard(request.request_id)
                        check_finish(accumulator.finish_reason, request.request_id)
                    if delta is not None:
                        await emit(delta)
                    if accumulator.finish_reason is not None:
                        return
        raise EngineError(
            ErrorCode.ENGINE_ERROR,
            f"vLLM ended request {request.request_id} without finishing it",
            retryable=True,
        )

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Abort the prefill these params name if it is still running; else False.

        vLLM cannot free the KV blocks of a finished prefill (see the module
        docstring), so a finished one answers False and its blocks stay until
        a decoder pulls them or the connector's lease expires.

        Cancellation: the abort (if any) is shielded and bounded.
        """
        target = kv_transfer_params.get("remote_request_id")
        for live in self._live.values():
            if isinstance(target, str) and any(
                target == vid or target.startswith(vid + "-") for vid in live
            ):
                self._counts["releases_found"] += 1
                await self._abort_vllm(sorted(live))
                return True
        self._counts["releases_not_found"] += 1
        await trio.lowlevel.cancel_shielded_checkpoint()
        return False

    async def abort(self, request_id: str) -> None:
        """Abort every vLLM request still held for ``request_id``; idempotent.

        The stage call that submitted them aborts them itself when it is
        cancelled, so after a runtime cancel this usually finds nothing.

        Cancellation: the abort is shielded and bounded by ``CLEANUP_TIMEOUT_S``.
        """
        self._counts["aborts"] += 1
        live = self._live.get(request_id)
        if live:
            await self._abort_vllm(sorted(live))
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def is_ready(self) -> bool:
        """True while vLLM's engine core is alive."""
        return not self._dead and not self._llm.errored

    # -- plumbing

    def _check_stage(self, stage: str) -> None:
        if self._dead:
            raise EngineCrashed(f"the vLLM engine ({self.role.value}) is dead")
        if not ROLE_TRAITS[self.role].serves(stage):
            raise EngineError(
                ErrorCode.UNSUPPORTED_STAGE, f"a {self.role.value} worker does not serve {stage}"
            )

    def _sampling_params(
        self,
        sampling: SamplingParams,
        *,
        output_kind: str,
        max_tokens: int | None = None,
        extra_args: Mapping[str, Any] | None = None,
        options: Mapping[str, object] | None = None,
    ) -> Any:
        kwargs = sampling_kwargs(
            sampling,
            output_kind=output_kind,
            max_tokens=max_tokens,
            extra_args=extra_args,
            options=options,
            defaults=self._api.default_sampling,
        )
        with self._vllm_errors():
            return self._api.make_sampling_params(kwargs)

    async def _render(
        self,
        prompt: Prompt,
        media: Sequence[MediaItem],
        options: Mapping[str, object] | None = None,
    ) -> RenderedPrompt:
        """Render in a worker thread when there is real work (templates, decoding)."""
        if not media and prompt.messages is None:
            return render_prompt(prompt, media, tokenizer=self._tokenizer)
        return await trio.to_thread.run_sync(
            lambda: render_prompt(
                prompt,
                media,
                tokenizer=self._tokenizer,
                chat_template=self._chat_template,
                decode_media=self._decode_media,
                options=options,
            )
        )

    def _submitted(self, vllm_id: str, live: set[str]) -> None:
        live.add(vllm_id)
        self._counts["vllm_requests"] += 1

    async def _complete(
        self,
        vllm_id: str,
        rendered: RenderedPrompt,
        params: Any,
        live: set[str],
        trace_headers: dict[str, str] | None,
    ) -> RequestOutputLike:
        """Run one vLLM request to its final output (FINAL_ONLY mode)."""
        self._submitted(vllm_id, live)
        with self._vllm_errors():
            final = await self._bridge.run(
                _final_output,
                self._llm,
                rendered.prompt,
                params,
                vllm_id,
                rendered.tokenization_kwargs,
                trace_headers,
            )
        live.discard(vllm_id)
        if final is None or not final.finished:
            raise EngineError(
                ErrorCode.ENGINE_ERROR,
                f"vLLM ended request {vllm_id} without output",
                retryable=True,
            )
        reason = final.outputs[0].finish_reason if final.outputs else None
        check_finish(reason, vllm_id)
        return final

    @asynccontextmanager
    async def _tracking(self, request_id: str) -> AsyncIterator[set[str]]:
        """Hold the vLLM request ids of one stage call; abort the unfinished ones at the end."""
        if request_id in self._live:
            raise EngineError(
                ErrorCode.DUPLICATE_REQUEST, f"request {request_id!r} is already running"
            )
        live: set[str] = set()
        self._live[request_id] = live
        try:
            yield live
        finally:
            del self._live[request_id]
            if live:
                await self._abort_vllm(sorted(live))

    async def _abort_vllm(self, vllm_ids: list[str]) -> None:
        """Abort in vLLM and wait for it (shielded, bounded); failures are only logged.

        This runs in cleanup paths: raising here would hide the outcome that
        made the cleanup necessary, and a dead engine has nothing to abort.
        """
        self._counts["vllm_aborts"] += len(vllm_ids)
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True) as scope:
            try:
                await self._bridge.run(_abort_all, self._llm, vllm_ids)
            except BridgeClosed:
                logger.debug("vLLM abort of %s skipped: the engine is closed", vllm_ids)
            except Exception:
                logger.warning("vLLM abort of %s failed", vllm_ids, exc_info=True)
        if scope.cancelled_caught:
            logger.warning(
                "vLLM abort of %s took over %.1f s; gave up", vllm_ids, CLEANUP_TIMEOUT_S
            )

    @contextmanager
    def _vllm_errors(self) -> Iterator[None]:
        """Translate what vLLM (or the bridge) raised into the engine contract's errors."""
        try:
            yield
        except (EngineError, EngineCrashed):
            raise
        except BridgeClosed as exc:
            self._dead = True
            raise EngineCrashed(f"the vLLM engine's event loop stopped: {exc}") from exc
        except Exception as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> EngineError | EngineCrashed:
        api = self._api
        if isinstance(exc, api.dead_errors) or self._llm.errored:
            self._dead = True
            return EngineCrashed(f"the vLLM engine core died: {type(exc).__name__}: {exc}")
        if isinstance(exc, api.overload_errors):
            return EngineError(ErrorCode.OVERLOADED, f"vLLM is full: {exc}", retryable=True)
        client: tuple[type[BaseException], ...] = (ValueError, TypeError, *api.client_errors)
        cause = exc if isinstance(exc, client) else exc.__cause__
        if isinstance(cause, client):
            return EngineError(ErrorCode.INVALID_REQUEST, f"vLLM refused the request: {cause}")
        return EngineError(
            ErrorCode.ENGINE_ERROR, f"vLLM failed: {type(exc).__name__}: {exc}", retryable=True
        )


# ---------------------------------------------------------------- building the real engine


def _vllm_module(name: str) -> Any:
    """Import a vLLM module (vLLM is optional: never imported at module level)."""
    return importlib.import_module(name)


def _argument_parser(engine_args_cls: Any) -> Any:
    try:
        parsers = _vllm_module("vllm.utils.argparse_utils")
    except ImportError:  # older vLLM kept it in vllm.utils
        parsers = _vllm_module("vllm.utils")
    parser = parsers.FlexibleArgumentParser(prog="epd_actors worker -- (vLLM engine arguments)")
    return engine_args_cls.add_cli_args(parser) or parser


def build_vllm_api(cli_args: list[str]) -> VllmApi:
    """Build vLLM's ``AsyncLLM`` from engine arguments, with vLLM's own parser.

    Must run on the bridge's loop thread (:func:`open_vllm_engine` does that).
    This is the only place that imports vLLM.

    Raises:
        ConfigError: vLLM is not installed, or its parser rejected the arguments.
    """
    # The worker's stdout carries its announcement line only; vLLM logs to stdout
    # unless told otherwise (its engine processes inherit this too).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        vllm = _vllm_module("vllm")
        arg_utils = _vllm_module("vllm.engine.arg_utils")
        sampling = _vllm_module("vllm.sampling_params")
        async_llm = _vllm_module("vllm.v1.engine.async_llm")
        engine_errors = _vllm_module("vllm.v1.engine.exceptions")
    except ImportError as exc:
        raise ConfigError(f"{VLLM_MISSING} ({exc})") from None
    try:
        vllm_errors: Any = _vllm_module("vllm.exceptions")
    except ImportError:  # older vLLM: ValueError covers its validation errors
        vllm_errors = None
    engine_args_cls = arg_utils.AsyncEngineArgs
    try:
        namespace = _argument_parser(engine_args_cls).parse_args(cli_args)
    except SystemExit:
        raise ConfigError(f"vLLM rejected the engine arguments {cli_args}") from None
    engine_args = engine_args_cls.from_cli_args(namespace)
    kinds = {
        "delta": sampling.RequestOutputKind.DELTA,
        "final_only": sampling.RequestOutputKind.FINAL_ONLY,
    }

    def make_sampling_params(kwargs: dict[str, Any]) -> Any:
        kwargs = {**kwargs, "output_kind": kinds[kwargs["output_kind"]]}
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = sampling.StructuredOutputsParams(
                **kwargs["structured_outputs"]
            )
        return vllm.SamplingParams(**kwargs)

    def error_types(*names: str) -> tuple[type[BaseException], ...]:
        found = (getattr(vllm_errors, name, None) for name in names)
        return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))

    # The engine is built inside the return expression on purpose: no local of
    # this frame names it.  vLLM keeps tracebacks of optional imports that failed
    # (placeholder modules), and those keep this frame -- and its locals -- alive.
    return _with_generation_config(
        VllmApi(
            async_llm.AsyncLLM.from_engine_args(engine_args),
            make_sampling_params,
            dead_errors=(engine_errors.EngineDeadError,),
            client_errors=error_types("VLLMClientError"),
            overload_errors=error_types("GracefulHTTPError"),
        )
    )


def _with_generation_config(api: VllmApi) -> VllmApi:
    """``api`` with the model's generation-config defaults (none if vLLM has no such call)."""
    model_config = getattr(api.llm, "model_config", None)
    read = getattr(model_config, "get_diff_sampling_param", None)
    if read is None:
        return api
    return replace(api, default_sampling=dict(read()))


@asynccontextmanager
async def open_vllm_engine(
    role: Role,
    model: str,
    options: VllmOptions | None = None,
    *,
    api_factory: ApiFactory = build_vllm_api,
    decode_media: MediaDecoder = decode_media_item,
    stream_buffer: int = VLLM_STREAM_BUFFER,
) -> AsyncIterator[VllmEngine]:
    """Start vLLM for ``role`` on a bridge thread; yield the engine once it is ready.

    Args:
        role: the worker's role (decides the transfer configs: see
            :func:`~.vllm_args.engine_args_for_role`).
        model: the model vLLM loads (and the name announced to routers).
        options: connectors, chat template and pass-through engine arguments.
        api_factory: builds the engine from the engine arguments on the loop
            thread (tests pass a fake).
        decode_media, stream_buffer: see :class:`VllmEngine`.

    Raises:
        ConfigError: bad options, vLLM missing, or the engine failed to start
            (vLLM's error is in the message; the traceback is logged).

    Cancellation: while the engine starts, a cancel waits up to
    ``CLEANUP_TIMEOUT_S`` for the constructor (it cannot be interrupted), then
    abandons it with the bridge thread.
    Resource handling: on exit ``AsyncLLM.shutdown()`` runs on the loop
    (shielded, bounded by ``ENGINE_SHUTDOWN_TIMEOUT_S``), then the bridge stops.
    """
    role = Role(role)
    options = options or VllmOptions()
    cli_args = engine_cli_args(role, model, options)
    async with open_asyncio_bridge(name=f"vllm-{role.value}") as bridge:
        with _start_failures():
            api = await bridge.run_sync(api_factory, cli_args)
        try:
            with _start_failures():
                tokenizer = await bridge.run(_tokenizer_of, api.llm)
            yield VllmEngine(
                role,
                model=model,
                api=api,
                bridge=bridge,
                tokenizer=tokenizer,
                chat_template=options.chat_template,
                decode_media=decode_media,
                stream_buffer=stream_buffer,
            )
        finally:
            with trio.move_on_after(ENGINE_SHUTDOWN_TIMEOUT_S, shield=True):
                try:
                    await bridge.run_sync(api.llm.shutdown)
                except Exception:  # the engine is going away either way
                    logger.warning("vLLM shutdown failed", exc_info=True)


@contextmanager
def _start_failures() -> Iterator[None]:
    """Report a failed engine start as a ``ConfigError`` (exit status 2), traceback logged."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        logger.exception("the vLLM engine failed to start")
        raise ConfigError(f"the vLLM engine failed to start: {type(exc).__name__}: {exc}") from exc


if TYPE_CHECKING:

    def _conforms(engine: VllmEngine) -> Engine:
        return engine
