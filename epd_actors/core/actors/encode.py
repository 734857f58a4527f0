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
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Final

import trio

from ...errors import RemoteWorkerError
from ...protocol import EncodeRequest, ErrorCode, Role
from ..encoder_cache import missing_hashes
from ..lifecycle import Phase
from ..routing import RouteKey
from .base import BaseActor
from .jobs import Job, StageContext, StageOutput
from .registry import register_stage

if TYPE_CHECKING:
    from collections.abc import Mapping

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

    def use_encoder_cache(self, cache: EncoderCache) -> None:
        self.encoder_cache = cache

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
        result = await backend.run_stage(EncodeRequest(f"{job.request_id}:{index}", (item,)))
        if self.encoder_cache is not None:
            self.encoder_cache.remember(
                memory_key(item, job.context.request.options),
                backend.worker_id,
                result.ec_transfer_params,
                len(item.data),
                trio.current_time(),
            )
        await job.reply.send(StageOutput(ec_transfer_params=result.ec_transfer_params))


PROCESSING_OPTIONS: Final = ("mm_processor_kwargs", "media_io_kwargs")
"""Request fields that change what an encoder makes of an item (vLLM's processor and loader)."""


def memory_key(item: MediaItem, options: Mapping[str, object] | None) -> str:
    """What the router remembers ``item``'s encoder output under.

    Its content hash; with per-kind processing options in the request, the
    hash plus a digest of them, so an output made under other options is
    never reused.  It starts with the content hash either way (refusals name
    items by their hash's first characters).
    """
    chosen = {name: options[name] for name in PROCESSING_OPTIONS if options and name in options}
    if not chosen:
        return item.content_hash
    text = json.dumps(chosen, sort_keys=True, separators=(",", ":"), default=str)
    return f"{item.content_hash}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _index(job: Job) -> int:
    assert job.item is not None, "encode jobs always cover one media item"
    return job.item
