"""E: encode each distinct media item once, on the encoder its content hash prefers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...protocol import EncodeRequest, Role
from ..lifecycle import Phase
from ..routing import RouteKey
from .base import BaseActor
from .jobs import Job, StageContext, StageOutput
from .registry import register_stage

if TYPE_CHECKING:
    from ...backends.base import StageBackend
    from ...request import GenerationRequest
    from ..config import Deadlines


@register_stage
class EncodeActor(BaseActor):
    """One job per distinct media item; the result's encoder transfer params are merged."""

    stage = "encode"
    worker_roles = frozenset({Role.ENCODE})
    default_policy = "consistent_hash"  # the media hash: an item goes back to its encoder cache
    phase = Phase.ENCODING
    order = 10

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

    def route_key(self, job: Job) -> RouteKey:
        item = job.context.request.media[_index(job)]
        return RouteKey(job.request_id, item.content_hash)

    async def handle(self, job: Job, backend: StageBackend) -> None:
        index = _index(job)
        item = job.context.request.media[index]
        result = await backend.run_stage(EncodeRequest(f"{job.request_id}:{index}", (item,)))
        await job.reply.send(StageOutput(ec_transfer_params=result.ec_transfer_params))


def _index(job: Job) -> int:
    assert job.item is not None, "encode jobs always cover one media item"
    return job.item
