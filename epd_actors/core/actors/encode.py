"""E: encode each distinct media item once, on the encoder its content hash prefers.

With its pool's encoder-output reuse on (``EncoderReuse``, an
:class:`~epd_actors.encoder_cache.EncoderCache` attached by the supervisor),
an item is encoded once across requests as well: :meth:`EncodeActor.recall`
hands P/PD the ``ec_transfer_params`` remembered for an item whose entry is
still trusted and runs no job for it; every encode job's answer is
remembered.  When a later stage refuses with ``missing_encoder_cache``,
:meth:`EncodeActor.redo` forgets the remembered items the refusal names (all
of this request's remembered items when it names none) and returns them, so
the supervisor encodes exactly those again and retries the stage once.
Two requests in flight for the same unseen item encode it once: the second
waits for the first's encode (:meth:`EncodeActor.share`, bounded by the
encode timeout) and encodes the item itself only when that one fails.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Final

import trio

from ...errors import RemoteWorkerError
from ...protocol import EncodeRequest, ErrorCode, Role
from ..encode_flights import EncodeFlights
from ..encoder_cache import missing_hashes
from ..lifecycle import Phase
from ..routing import RouteKey
from .base import BaseActor
from .jobs import Job, StageContext, StageOutput
from .registry import register_stage

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from ...backends.base import StageBackend
    from ...errors import EpdError
    from ...protocol import MediaItem
    from ...request import GenerationRequest
    from ..config import Deadlines
    from ..encoder_cache import EncoderCache


@register_stage
class EncodeActor(BaseActor):
    """One job per distinct media item; the result's encoder transfer params are merged."""

    stage = "encode"
    worker_roles = frozenset({Role.ENCODE})
    default_policy = "consistent_hash"  # the media hash: an item goes back to its encoder cache
    phase = Phase.ENCODING
    order = 10

    encoder_cache: EncoderCache | None = None  # set per actor by use_encoder_cache
    flights: EncodeFlights | None = None  # the items being encoded now, with reuse on

    def use_encoder_cache(self, cache: EncoderCache) -> None:
        self.encoder_cache = cache
        self.flights = EncodeFlights()

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        return deadlines.encode_timeout_s

    @classmethod
    def applies_to(cls, request: GenerationRequest) -> bool:
        return bool(request.media)

    @classmethod
    def split(cls, context: StageContext) -> list[int | None]:
        first_index: dict[str, int] = {}
        for index, item in enumerate(context.request.media):
            first_index.setdefault(item.content_hash, index)
        return list(first_index.values())

    def recall(self, context: StageContext, items: list[int | None]) -> list[int | None]:
        """Fold the remembered params of trusted entries into ``context``; the rest to encode."""
        cache = self.encoder_cache
        if cache is None or not cache.reuse.enabled:
            return items
        now = trio.current_time()
        media = context.request.media
        pending: list[int | None] = []
        for index in items:
            assert index is not None, "encode jobs always cover one media item"
            key = memory_key(media[index], context.request.options)
            entry = cache.recall(key, now, reachable=self._reachable)
            if entry is None:
                pending.append(index)
                continue
            context.absorb(StageOutput(ec_transfer_params=entry.ec_transfer_params))
            context.recalled.add(key)
        return pending

    async def share(
        self,
        context: StageContext,
        items: list[int | None],
        run: Callable[[list[int | None]], Awaitable[None]],
        bound_s: float,
    ) -> None:
        """Encode the items nobody else is encoding; wait for the others' encodes.

        With reuse on, each item is claimed for this request unless another
        request's encode of it (same memory key) is in flight; then this
        request waits for that encode, at most ``bound_s`` seconds, while its
        own items run, and reads the memory again: what the other encode left
        there is absorbed, and the items still missing (that encode failed,
        was cancelled, or outlasted the bound) are encoded here.  Claims end
        when this call does, however it ends, waking their waiters.

        Raises:
            EpdError: the first failure of this request's own encodes.

        Cancellation: cancels the waits and this request's jobs; its claims
        end, so a waiter encodes for itself.
        """
        cache, flights = self.encoder_cache, self.flights
        if cache is None or flights is None or not cache.reuse.enabled:
            await run(items)
            return
        media, options = context.request.media, context.request.options
        mine: list[int | None] = []
        theirs: list[int | None] = []
        waits: list[trio.Event] = []
        claims: list[tuple[str, trio.Event]] = []
        for index in items:
            assert index is not None, "encode jobs always cover one media item"
            key = memory_key(media[index], options)
            claimed = flights.claim(key)
            if claimed is not None:
                claims.append((key, claimed))
                mine.append(index)
                continue
            in_flight = flights.in_flight(key)
            assert in_flight is not None
            waits.append(in_flight)
            theirs.append(index)
        try:
            if not theirs:
                await run(mine)
                return
            await _run_while_waiting(flights, context, self, mine, theirs, waits, run, bound_s)
        finally:
            for key, claimed in claims:
                flights.release(key, claimed)

    def redo(self, context: StageContext, error: EpdError) -> list[int | None]:
        """The remembered items a ``missing_encoder_cache`` refusal names, forgotten; else none."""
        cache = self.encoder_cache
        if cache is None or not context.recalled:
            return []
        if not isinstance(error, RemoteWorkerError):
            return []
        if error.code != ErrorCode.MISSING_ENCODER_CACHE:
            return []
        gone = set(missing_hashes(error.detail, sorted(context.recalled)))
        cache.found_missing(gone)
        context.recalled -= gone
        first_index: dict[str, int] = {}
        options = context.request.options
        for index, item in enumerate(context.request.media):
            key = memory_key(item, options)
            if key in gone:
                first_index.setdefault(key, index)
        return list(first_index.values())

    def _reachable(self, worker_id: str) -> bool:
        member = self.pool.get(worker_id)
        return member is not None and member.reachable()

    def route_key(self, job: Job) -> RouteKey:
        item = job.context.request.media[_index(job)]
        return RouteKey(job.request_id, item.content_hash)

    async def handle(self, job: Job, backend: StageBackend) -> None:
        index = _index(job)
        item = job.context.request.media[index]
        options = processing_options(job.context.request.options)
        result = await backend.run_stage(
            EncodeRequest(f"{job.request_id}:{index}", (item,), options=options)
        )
        if self.encoder_cache is not None:
            self.encoder_cache.remember(
                memory_key(item, job.context.request.options),
                backend.worker_id,
                result.ec_transfer_params,
                len(item.data),
                trio.current_time(),
            )
        await job.answer(StageOutput(ec_transfer_params=result.ec_transfer_params))


PROCESSING_OPTIONS: Final = ("mm_processor_kwargs", "media_io_kwargs")
"""Request fields that change what an encoder makes of an item (vLLM's processor and loader)."""


def processing_options(options: Mapping[str, object] | None) -> dict[str, object] | None:
    """The request options E must see (:data:`PROCESSING_OPTIONS`); None without any."""
    chosen = {name: options[name] for name in PROCESSING_OPTIONS if options and name in options}
    return chosen or None


def memory_key(item: MediaItem, options: Mapping[str, object] | None) -> str:
    """What the router remembers ``item``'s encoder output under.

    Its content hash; with per-kind processing options in the request, the
    hash plus a digest of them, so an output made under other options is
    never reused.  It starts with the content hash either way (refusals name
    items by their hash's first characters).
    """
    chosen = processing_options(options)
    if not chosen:
        return item.content_hash
    text = json.dumps(chosen, sort_keys=True, separators=(",", ":"), default=str)
    return f"{item.content_hash}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


async def _run_while_waiting(
    flights: EncodeFlights,
    context: StageContext,
    actor: EncodeActor,
    mine: list[int | None],
    theirs: list[int | None],
    waits: list[trio.Event],
    run: Callable[[list[int | None]], Awaitable[None]],
    bound_s: float,
) -> None:
    """Run ``mine`` while waiting for ``waits``; then run what ``theirs`` still lacks.

    Both runs share one nursery; the first failure cancels the rest and is
    raised as it is (not in a group), as the supervisor's own fan-out does.
    """
    failures: list[Exception] = []

    async def guarded(chosen: list[int | None]) -> None:
        try:
            await run(chosen)
        except Exception as exc:  # re-raised unchanged below
            failures.append(exc)
            nursery.cancel_scope.cancel(reason="an encode job failed")

    async with trio.open_nursery() as nursery:
        if mine:
            nursery.start_soon(guarded, mine)
        await flights.wait(waits, trio.current_time() + bound_s)
        rest = actor.recall(context, theirs)
        if rest:
            nursery.start_soon(guarded, rest)
    if failures:
        raise failures[0]


def _index(job: Job) -> int:
    assert job.item is not None, "encode jobs always cover one media item"
    return job.item
