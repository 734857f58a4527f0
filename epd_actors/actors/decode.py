"""D: stream the output from the KV cache P handed over."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..lifecycle import Phase
from ..protocol import GenerateRequest, Role
from .base import BaseActor
from .registry import register_stage

if TYPE_CHECKING:
    from ..backends.base import StageBackend
    from .jobs import Job


@register_stage
class DecodeActor(BaseActor):
    """Streams deltas; the request carries P's ``kv_transfer_params`` (when P ran)."""

    stage = "decode"
    worker_roles = frozenset({Role.DECODE})
    phase = Phase.DECODING
    order = 30
    produces_output = True
    requires: ClassVar[tuple[str, ...]] = ("prefill",)

    async def handle(self, job: Job, backend: StageBackend) -> None:
        context = job.context
        request = context.request
        await self.stream_output(
            job,
            backend,
            GenerateRequest(
                job.request_id,
                request.prompt,
                request.media,
                request.sampling,
                kv_transfer_params=context.kv_transfer_params,
                ec_transfer_params=context.ec_transfer_params,
                options=request.options,
            ),
        )
