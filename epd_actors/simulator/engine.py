"""The EPD simulator: a stand-in for GPU-backed vLLM workers, faithful where routers break.

Theory of operation
-------------------
:class:`SimEngine` implements :class:`~epd_actors.worker.engine.Engine` for every
role and keeps the data dependencies of real disaggregated serving, through
stores shared with its peers (see :mod:`epd_actors.simulator.store`):

* **E** writes one encoder-cache entry per media item (keyed by content hash).
* **P** needs those entries (``strict``: refuses with ``missing_encoder_cache``;
  ``recompute``: runs the encoder itself, like vLLM does, at the encoder's cost),
  then publishes a KV handle (random; records request id, prompt digest and
  length) and names it in ``kv_transfer_params``.
* **D** consumes that handle exactly once and refuses unknown, expired, consumed
  or mismatched ones (``unknown_kv_handle``); its usage reports P's prompt length.
* **PD** needs encoder entries (or recomputes) and no handle.

A handle belongs to the engine that created it: that engine discards it when
``kv_ttl_s`` passes (counted as leaked; swept lazily on every call and on
:meth:`SimEngine.statistics`), on :meth:`SimEngine.release`, on
:meth:`SimEngine.abort` of its request, and when it crashes.  Cancelling a
prefill does *not* free its handle; the runtime's ``abort`` does -- so a runtime
that forgets to abort shows up as a leak.

Output is deterministic: token ``i`` is a stable hash of (prompt digest, seed,
``i``) -- temperature 0 ignores the seed, an unseeded sampled request uses seed
0 -- and its text is a word from a small list, so the same request gives the
same text through E+P+D and through PD.  Latencies are ``trio.sleep`` calls
(virtual under ``MockClock``); faults come from a ``random.Random`` seeded by
``fault_seed`` and the worker id.  Every knob, with its default and unit, is a
:class:`SimConfig` field (:mod:`epd_actors.simulator.config`); the text model lives in
:mod:`epd_actors.simulator.text`; docs/simulator.md is the narrative.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import random
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NoReturn

import trio

from ..errors import EngineCrashed, EngineError
from ..lora import lora_capabilities
from ..protocol import (
    ROLE_TRAITS,
    Delta,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    MediaItem,
    PrefillRequest,
    Prompt,
    Role,
    StageResult,
    TokenLogprob,
    Usage,
)
from .config import Knob, KnobSpec, SimConfig, sim_knobs
from .prefix_cache import SimPrefixCache, prompt_token_ids
from .store import SAFE_KEY, EncoderCacheEntry, KVEntry, is_safe_key
from .text import (
    MAX_ALTERNATIVES,
    VOCAB_SIZE,
    _StopText,
    _TokenSource,
    count_prompt_tokens,
    prompt_digest,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from ..worker.engine import DeltaSink, Engine
    from .store import EncoderCacheStore, KVStore

__all__ = [
    "KV_HANDLE_KEY",
    "VOCAB_SIZE",
    "Knob",
    "KnobSpec",
    "SimConfig",
    "SimCounters",
    "SimEngine",
    "count_prompt_tokens",
    "prompt_digest",
    "sim_knobs",
]

logger = logging.getLogger(__name__)

KV_HANDLE_KEY: Final = "sim_kv_handle"
"""The ``kv_transfer_params`` key naming a simulated KV handle."""


# ---------------------------------------------------------------- statistics


@dataclass(slots=True)
class _Counts:
    encode_requests: int = 0
    prefill_requests: int = 0
    generate_requests: int = 0
    aborts: int = 0
    releases_found: int = 0
    releases_not_found: int = 0
    kv_handles_created: int = 0
    kv_handles_consumed: int = 0
    kv_handles_released: int = 0
    kv_handles_aborted: int = 0
    kv_handles_leaked: int = 0
    kv_handles_lost: int = 0
    ec_entries_written: int = 0
    ec_entries_read: int = 0
    recomputed_items: int = 0
    errors_injected: int = 0
    tokens_generated: int = 0


@dataclass(frozen=True, slots=True)
class SimCounters:
    """A snapshot of one :class:`SimEngine`'s counters (totals since it was built).

    Attributes:
        encode_requests, prefill_requests, generate_requests: stage calls received
            (on a role that serves them; injected failures and refusals included).
        aborts: ``abort`` calls received.
        releases_found, releases_not_found: ``release`` outcomes.
        kv_handles_created: handles this engine (P) published.
        kv_handles_consumed: handles this engine (D) consumed.
        kv_handles_released: handles freed by ``release`` (equals releases_found).
        kv_handles_aborted: this engine's handles freed by ``abort``.
        kv_handles_leaked: this engine's handles that expired unconsumed.
        kv_handles_lost: this engine's handles dropped when it crashed.
        kv_handles_outstanding: this engine's handles still waiting for a decoder.
        ec_entries_written: encoder-cache entries this engine (E) wrote.
        ec_entries_read: encoder-cache entries this engine (P/PD) found.
        recomputed_items: media items P/PD encoded itself (``recompute`` mode).
        errors_injected: failures raised by ``*_error_rate``.
        tokens_generated: output tokens emitted.
        in_flight: stage calls running now.
        crashed: whether the engine crashed (``is_ready()`` is then False).
    """

    encode_requests: int
    prefill_requests: int
    generate_requests: int
    aborts: int
    releases_found: int
    releases_not_found: int
    kv_handles_created: int
    kv_handles_consumed: int
    kv_handles_released: int
    kv_handles_aborted: int
    kv_handles_leaked: int
    kv_handles_lost: int
    ec_entries_written: int
    ec_entries_read: int
    recomputed_items: int
    errors_injected: int
    tokens_generated: int
    kv_handles_outstanding: int
    in_flight: int
    crashed: bool


# ---------------------------------------------------------------- helpers


async def _pause(seconds: float) -> None:
    """Sleep ``seconds`` (forever when infinite); always a checkpoint."""
    if math.isinf(seconds):
        await trio.sleep_forever()
    elif seconds > 0:
        await trio.sleep(seconds)
    else:
        await trio.lowlevel.checkpoint()


async def _next_step(step_s: float) -> None:
    """Sleep until the next tick of a clock ticking every ``step_s`` seconds since time 0.

    Every stream waiting for the same tick wakes in the same scheduling batch, as
    the sequences of one decode step of a continuous-batching engine do (vLLM
    emits one step's outputs for all running requests together).  ``step_s`` 0
    or infinite falls back to :func:`_pause`.
    """
    if step_s <= 0 or math.isinf(step_s):
        await _pause(step_s)
        return
    await trio.sleep_until((math.floor(trio.current_time() / step_s) + 1) * step_s)


_RUN_TOKEN: trio.lowlevel.RunVar[str] = trio.lowlevel.RunVar("epd_sim_run_token")


def _run_token() -> str:
    """A random token of the current ``trio.run``: deadlines compare only within one run."""
    try:
        return _RUN_TOKEN.get()
    except LookupError:
        token = secrets.token_hex(8)
        _RUN_TOKEN.set(token)
        return token


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorCode.INVALID_REQUEST, message)


def _handle_from(params: dict[str, object] | None) -> str:
    if params is None:
        raise _invalid("a decode worker needs kv_transfer_params from a prefill")
    handle = params.get(KV_HANDLE_KEY)
    if not isinstance(handle, str) or not is_safe_key(handle):
        raise _invalid(f"kv_transfer_params[{KV_HANDLE_KEY!r}] must match {SAFE_KEY.pattern}")
    return handle


@dataclass(frozen=True, slots=True)
class _Held:
    request_id: str
    expires_at: float


# ---------------------------------------------------------------- the engine


SIM_OPTIONS: Final = frozenset(
    {
        "ignore_eos",  # the simulator has no end-of-sequence token: nothing to ignore
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",  # and no special tokens to skip or space
        "spaces_between_special_tokens",
    }
)
"""The request options the simulator honours (docs/simulator.md); it refuses the rest."""


def _stop_token_ids(options: dict[str, object]) -> frozenset[int]:
    value = options.get("stop_token_ids")
    if not isinstance(value, list):
        return frozenset()
    return frozenset(t for t in value if type(t) is int)


class SimEngine:
    """A simulated engine for one role; see the module docstring for the model.

    Args:
        role: the stage this engine serves.
        worker_id: names the producer in transfer params, logs and the fault RNG.
        config: latency, behaviour and fault knobs.
        ec_store, kv_store: shared with the engines of the other stages
            (``store.create_sim_stores``).
        model: the model name the worker announces.
        lora_adapters: the LoRA adapters it serves (announced as ``lora:NAME``
            capabilities; a request naming another adapter is refused).

    Every stage coroutine raises ``EngineError`` for refusals and injected
    failures and ``EngineCrashed`` once the simulated engine has died.
    """

    capabilities: tuple[str, ...]
    supported_options: frozenset[str] = SIM_OPTIONS

    def __init__(
        self,
        role: Role,
        *,
        worker_id: str,
        config: SimConfig,
        ec_store: EncoderCacheStore,
        kv_store: KVStore,
        model: str = "sim-model",
        lora_adapters: Iterable[str] = (),
    ) -> None:
        self.role = Role(role)
        self.model = model
        self.capabilities = ("sim", *lora_capabilities(lora_adapters))
        self.worker_id = worker_id
        self.config = config
        self._ec = ec_store
        self._kv = kv_store
        self._rng = random.Random(f"{config.fault_seed}:{worker_id}")
        self._counts = _Counts()
        self._own: dict[str, _Held] = {}  # creation order == expiry order (one TTL)
        self._by_request: dict[str, list[str]] = {}
        self._stage_requests = 0
        self._in_flight = 0
        self._crashed = False
        self._wedged = False
        # The prefix cache of a role that prefills (prefix_cache_blocks > 0); set its sink.
        traits = ROLE_TRAITS[self.role]
        prefills = traits.serves("prefill") or (traits.serves("generate") and not traits.takes_kv)
        self.prefix_cache: SimPrefixCache | None = None
        if config.prefix_cache_blocks and prefills:
            self.prefix_cache = SimPrefixCache(
                block_size=config.prefix_block_size,
                capacity_blocks=config.prefix_cache_blocks,
                hash_seed=config.prefix_hash_seed,
            )

    def __repr__(self) -> str:
        state = "crashed" if self._crashed else f"in_flight={self._in_flight}"
        return f"<SimEngine {self.worker_id} role={self.role.value} {state}>"

    # -- Engine protocol

    async def encode(self, request: EncodeRequest) -> StageResult:
        """Encode each distinct media item and write its encoder-cache entry.

        Returns:
            ``ec_transfer_params`` of ``{content_hash: {"producer": worker_id}}``
            and timings ``encode_s``, ``total_s``.

        Raises:
            EngineError: ``invalid_request`` (unsafe or wrong content hash),
                ``engine_error`` (injected), ``unsupported_stage``.
            EngineCrashed: the simulated engine died.

        Cancellation: safe at any await; entries written so far stay (a cache).
        Backpressure: none; each item costs ``encode_item_s`` + size x ``encode_kib_s``.
        """
        await self._admit("encode")
        with self._running():
            start = trio.current_time()
            items = self._checked_media(request.media)
            begun = await self._prologue(self.config.encode_error_rate, "encode")
            for item in items.values():
                await _pause(self._encode_cost(item))
                self._check_alive()
                self._ec.put(
                    EncoderCacheEntry(
                        item.content_hash,
                        self.worker_id,
                        item.modality,
                        len(item.data),
                        self.config.media_tokens_per_item,
                    )
                )
                self._counts.ec_entries_written += 1
            now = trio.current_time()
            params: dict[str, object] = {h: {"producer": self.worker_id} for h in items}
            return StageResult(
                request.request_id,
                ec_transfer_params=params,
                timings={"encode_s": now - begun, "total_s": now - start},
            )

    async def prefill(self, request: PrefillRequest) -> StageResult:
        """Check the encoder cache, publish a KV handle, spend the prefill time.

        Returns:
            ``kv_transfer_params`` of ``{"sim_kv_handle", "producer",
            "prompt_tokens"}``, ``prompt_tokens``, and timings ``encode_s``
            (recompute), ``prefill_s``, ``total_s``.

        Raises:
            EngineError: ``missing_encoder_cache`` (strict mode),
                ``invalid_request``, ``engine_error`` (injected), ``unsupported_stage``.
            EngineCrashed: the simulated engine died.

        Cancellation: the handle exists from the start of the prefill time on; if
        the call is cancelled after that, the handle stays until ``abort`` (which
        the runtime sends after a cancel) or its TTL.
        Backpressure: none; costs ``prefill_token_s`` per prompt token.
        """
        await self._admit("prefill")
        with self._running():
            start = trio.current_time()
            items = self._checked_media(request.media)
            digest = prompt_digest(request.prompt, request.media)
            tokens = self._prompt_tokens(request.prompt, request.media)
            await self._prologue(self.config.prefill_error_rate, "prefill")
            encode_s = await self._load_encoder_outputs(items)
            handle = self._create_handle(request.request_id, digest, tokens)
            begun = trio.current_time()
            await self._prefill_time(request.prompt, request.media, tokens, request.lora_adapter)
            self._check_alive()
            now = trio.current_time()
            return StageResult(
                request.request_id,
                kv_transfer_params={
                    KV_HANDLE_KEY: handle,
                    "producer": self.worker_id,
                    "prompt_tokens": tokens,
                },
                prompt_tokens=tokens,
                timings={"encode_s": encode_s, "prefill_s": now - begun, "total_s": now - start},
            )

    async def generate(self, request: GenerateRequest, emit: DeltaSink) -> None:
        """Stream deterministic tokens; D consumes P's handle, PD prefills itself.

        The final delta has ``finish_reason`` (``stop`` or ``length``), usage and
        timings (``ttft_s``, ``decode_s``, ``total_s``; PD adds ``encode_s`` and
        ``prefill_s``).

        Raises:
            EngineError: ``unknown_kv_handle`` (unknown, expired, consumed or
                mismatched handle), ``invalid_request`` (D without a handle),
                ``missing_encoder_cache`` (PD, strict), ``engine_error`` (injected,
                before any token and before the handle is consumed),
                ``unsupported_stage``.
            EngineCrashed: the simulated engine died (``crash_after_tokens``).

        Cancellation: safe at any await; a consumed handle is gone either way.
        Backpressure: awaits ``emit`` for every delta; one token per delta when
        paced (``output_token_s`` > 0), else ``tokens_per_delta`` per delta.
        """
        await self._admit("generate")
        with self._running():
            start = trio.current_time()
            decode = ROLE_TRAITS[self.role].takes_kv
            handle = _handle_from(request.kv_transfer_params) if decode else ""
            items = {} if decode else self._checked_media(request.media)
            digest = prompt_digest(request.prompt, request.media)
            await self._prologue(self.config.generate_error_rate, "generate")
            timings: dict[str, float] = {}
            if decode:
                prompt_tokens = self._consume(handle, digest)
            else:
                prompt_tokens = self._prompt_tokens(request.prompt, request.media)
                timings["encode_s"] = await self._load_encoder_outputs(items)
                begun = trio.current_time()
                await self._prefill_time(
                    request.prompt, request.media, prompt_tokens, request.lora_adapter
                )
                self._check_alive()
                timings["prefill_s"] = trio.current_time() - begun
            await self._stream(request, emit, digest, prompt_tokens, start, timings)

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Free the named KV handle; False when it was already consumed or gone.

        Raises:
            EngineError: ``invalid_request`` when the params name no valid handle.

        Cancellation: the work is done before the only (cancel-shielded)
        checkpoint, so it completes even when called from a cancelled scope.
        Backpressure: none.
        """
        self._sweep()
        handle = _handle_from(kv_transfer_params)
        found = self._kv.discard(handle)
        self._forget(handle)
        if found:
            self._counts.releases_found += 1
            self._counts.kv_handles_released += 1
        else:
            self._counts.releases_not_found += 1
        await trio.lowlevel.cancel_shielded_checkpoint()
        return found

    async def abort(self, request_id: str) -> None:
        """Free every KV handle this engine still holds for ``request_id``; idempotent.

        Cancellation: as :meth:`release`, completes even in a cancelled scope.
        Backpressure: none.
        """
        self._sweep()
        self._counts.aborts += 1
        for handle in self._by_request.pop(request_id, []):
            self._own.pop(handle, None)
            if self._kv.discard(handle):
                self._counts.kv_handles_aborted += 1
        await trio.lowlevel.cancel_shielded_checkpoint()

    def is_ready(self) -> bool:
        """True until the simulated engine crashes (or ``wedge`` was called)."""
        return not self._crashed and not self._wedged

    def wedge(self) -> None:
        """Fault injection: report not ready from now on, as a wedged engine would.

        Work already running is left alone (it hangs or finishes as configured);
        health checks see the engine as down.
        """
        self._wedged = True

    def statistics(self) -> SimCounters:
        """A snapshot of the counters (sweeps expired handles first inside Trio)."""
        if trio.lowlevel.in_trio_run():
            self._sweep()
        for handle in [h for h in self._own if not self._kv.contains(h)]:
            self._forget(handle)  # consumed (or released) through another engine
        return SimCounters(
            **dataclasses.asdict(self._counts),
            kv_handles_outstanding=len(self._own),
            in_flight=self._in_flight,
            crashed=self._crashed,
        )

    # -- stage plumbing

    async def _admit(self, stage: str) -> None:
        await trio.lowlevel.checkpoint()
        self._sweep()
        self._check_alive()
        if not ROLE_TRAITS[self.role].serves(stage):
            raise EngineError(
                ErrorCode.UNSUPPORTED_STAGE, f"a {self.role.value} worker does not serve {stage}"
            )
        setattr(self._counts, f"{stage}_requests", getattr(self._counts, f"{stage}_requests") + 1)
        self._stage_requests += 1
        if self._stage_requests == self.config.crash_on_request:
            self._crash(f"stage request #{self._stage_requests} (crash_on_request)")

    async def _prologue(self, error_rate: float, stage: str) -> float:
        """Injected stall, then injected failure; returns when the work begins."""
        if self.config.stall_s > 0:
            await _pause(self.config.stall_s)
            self._check_alive()
        if error_rate > 0 and self._rng.random() < error_rate:
            self._counts.errors_injected += 1
            raise EngineError(
                ErrorCode.ENGINE_ERROR,
                f"injected {stage} failure on {self.worker_id}",
                retryable=True,
            )
        return trio.current_time()

    @contextmanager
    def _running(self) -> Iterator[None]:
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def _checked_media(self, media: tuple[MediaItem, ...]) -> dict[str, MediaItem]:
        distinct: dict[str, MediaItem] = {}
        for item in media:
            if not is_safe_key(item.content_hash):
                raise _invalid(f"media content_hash must match {SAFE_KEY.pattern}")
            if self.config.verify_media_hash and (
                hashlib.sha256(item.data).hexdigest() != item.content_hash
            ):
                raise _invalid(f"media content_hash {item.content_hash} is not sha256 of its data")
            distinct.setdefault(item.content_hash, item)
        return distinct

    def _encode_cost(self, item: MediaItem) -> float:
        return self.config.encode_item_s + len(item.data) / 1024 * self.config.encode_kib_s

    def _prompt_tokens(self, prompt: Prompt, media: tuple[MediaItem, ...]) -> int:
        tokens = count_prompt_tokens(prompt, media, self.config.media_tokens_per_item)
        if tokens >= self.config.max_model_len:
            raise EngineError(
                ErrorCode.INVALID_REQUEST,
                f"the prompt has {tokens} tokens; this model's context is "
                f"{self.config.max_model_len} tokens",
            )
        return tokens

    async def _prefill_time(
        self, prompt: Prompt, media: tuple[MediaItem, ...], tokens: int, lora: str | None
    ) -> None:
        """Spend the prefill time of the tokens the prefix cache lacks, then cache the blocks."""
        cache = self.prefix_cache
        if cache is None:
            await _pause(tokens * self.config.prefill_token_s)
            return
        ids = prompt_token_ids(prompt, media, self.config.media_tokens_per_item)
        hit = cache.begin(ids, lora)
        await _pause((tokens - hit) * self.config.prefill_token_s)
        self._check_alive()
        cache.store(ids, lora_name=lora)

    def _output_limit(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """How many tokens a stream may produce: ``max_tokens``, else the rest of the context."""
        room = self.config.max_model_len - prompt_tokens
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise EngineError(
                ErrorCode.INVALID_REQUEST,
                f"max_tokens ({max_tokens}) is more than the {room} tokens left in this "
                f"model's context of {self.config.max_model_len} after the prompt",
                param="max_tokens",
            )
        return max_tokens

    async def _load_encoder_outputs(self, items: dict[str, MediaItem]) -> float:
        """Find every item's entry, or refuse (strict) / encode it here (recompute)."""
        missing = [item for h, item in items.items() if self._ec.get(h) is None]
        self._counts.ec_entries_read += len(items) - len(missing)
        if missing and self.config.ec_mode == "strict":
            # Every missing item, by its hash's first 16 characters: a router
            # that reused entries encodes exactly these again.
            hashes = ", ".join(item.content_hash[:16] for item in missing)
            raise EngineError(
                ErrorCode.MISSING_ENCODER_CACHE,
                f"no encoder-cache entry for {len(missing)} media item(s): {hashes}",
            )
        begun = trio.current_time()
        for item in missing:
            await _pause(self._encode_cost(item))
            self._check_alive()
            self._counts.recomputed_items += 1
        return trio.current_time() - begun

    # -- KV handles

    def _create_handle(self, request_id: str, digest: str, prompt_tokens: int) -> str:
        handle = secrets.token_hex(16)
        expires_at = trio.current_time() + self.config.kv_ttl_s
        self._kv.create(
            KVEntry(
                handle, self.worker_id, request_id, digest, prompt_tokens, expires_at, _run_token()
            )
        )
        self._own[handle] = _Held(request_id, expires_at)
        self._by_request.setdefault(request_id, []).append(handle)
        self._counts.kv_handles_created += 1
        return handle

    def _consume(self, handle: str, digest: str) -> int:
        """Validate, then take the handle atomically; returns the prompt length it holds."""
        entry = self._kv.peek(handle)
        if entry is None:
            raise self._unknown(handle, "is unknown or already consumed")
        if entry.clock == _run_token() and entry.expires_at <= trio.current_time():
            raise self._unknown(handle, "expired")
        if entry.prompt_digest != digest:
            raise self._unknown(
                handle, f"prompt mismatch: it holds the prefill of request {entry.request_id!r}"
            )
        if self._kv.take(handle) is None:
            raise self._unknown(handle, "was consumed concurrently")
        self._counts.kv_handles_consumed += 1
        return entry.prompt_tokens

    def _unknown(self, handle: str, why: str) -> EngineError:
        return EngineError(ErrorCode.UNKNOWN_KV_HANDLE, f"KV handle {handle} {why}")

    def _forget(self, handle: str) -> None:
        held = self._own.pop(handle, None)
        if held is None:
            return
        handles = self._by_request.get(held.request_id, [])
        if handle in handles:
            handles.remove(handle)
        if not handles:
            self._by_request.pop(held.request_id, None)

    def _sweep(self) -> None:
        """Discard this engine's handles whose TTL passed; unconsumed ones leaked."""
        now = trio.current_time()
        while self._own:
            handle, held = next(iter(self._own.items()))
            if held.expires_at > now:
                return
            self._forget(handle)
            if self._kv.discard(handle):
                self._counts.kv_handles_leaked += 1
                logger.warning(
                    "%s: KV handle %s of request %s expired unconsumed",
                    self.worker_id,
                    handle,
                    held.request_id,
                )

    # -- failure

    def _check_alive(self) -> None:
        if self._crashed:
            raise EngineCrashed(f"simulated engine {self.worker_id} has crashed")

    def _crash(self, why: str) -> NoReturn:
        if not self._crashed:
            self._crashed = True
            logger.warning("%s: simulated engine crash (%s)", self.worker_id, why)
            for handle in list(self._own):
                if self._kv.discard(handle):
                    self._counts.kv_handles_lost += 1
            self._own.clear()
            self._by_request.clear()
        raise EngineCrashed(f"simulated engine {self.worker_id} crashed: {why}")

    # -- streaming

    async def _stream(
        self,
        request: GenerateRequest,
        emit: DeltaSink,
        digest: str,
        prompt_tokens: int,
        start: float,
        timings: dict[str, float],
    ) -> None:
        config, sampling, rid = self.config, request.sampling, request.request_id
        options = request.options or {}
        limit = self._output_limit(sampling.max_tokens, prompt_tokens)
        stop_ids = _stop_token_ids(options)
        source = _TokenSource(digest, sampling)
        text = _StopText(sampling.stop, keep_stop=options.get("include_stop_str_in_output") is True)
        chunk = 1 if config.output_token_s > 0 else config.tokens_per_delta
        faults = {config.stall_after_tokens, config.crash_after_tokens}
        ids: list[int] = []
        logprobs: list[float] = []
        pieces: list[str] = []
        alternatives: list[tuple[TokenLogprob, ...]] = []
        want_tokens = sampling.logprobs is not None
        top = min(sampling.logprobs or 0, MAX_ALTERNATIVES)
        produced = 0
        first_at: float | None = None
        await _pause(config.first_token_s)
        while True:
            self._check_alive()
            if produced == config.crash_after_tokens:
                self._crash(f"after {produced} tokens of {rid} (crash_after_tokens)")
            if produced == config.stall_after_tokens:
                await trio.sleep_forever()
            token_id, logprob, piece = source.token(produced)
            if top:
                alternatives.append(source.alternatives(produced, top))
            produced += 1
            ids.append(token_id)
            logprobs.append(logprob)
            pieces.append(piece)
            finish: str | None = None
            may_stop = produced >= sampling.min_tokens
            if may_stop and token_id in stop_ids:
                finish = "stop"  # a stop token's text is not output
            elif text.push(piece, may_stop=may_stop):
                finish = "stop"
            elif produced >= limit:
                finish = "length"
            if finish is None and len(ids) < chunk and produced not in faults:
                continue
            now = trio.current_time()
            first_at = now if first_at is None else first_at
            self._counts.tokens_generated += len(ids)
            delta = Delta(
                rid,
                token_ids=tuple(ids),
                text=text.take(final=finish is not None),
                logprobs=tuple(logprobs) if want_tokens else None,
                tokens=tuple(pieces) if want_tokens else None,
                top_logprobs=tuple(alternatives) if top else None,
            )
            ids.clear()
            logprobs.clear()
            pieces.clear()
            alternatives.clear()
            if finish is not None:
                timings.update(
                    ttft_s=first_at - start, decode_s=now - first_at, total_s=now - start
                )
                usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=produced)
                await emit(
                    dataclasses.replace(delta, finish_reason=finish, usage=usage, timings=timings)
                )
                return
            await emit(delta)
            if config.step_clock:
                await _next_step(config.output_token_s)
            else:
                await _pause(config.output_token_s)


if TYPE_CHECKING:

    def _conforms(engine: SimEngine) -> Engine:
        return engine
