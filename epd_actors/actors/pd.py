"""PD: merged prefill and decode; consumes encoder outputs, streams the output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lifecycle import Phase
from ..protocol import GenerateRequest
from .base import BaseActor
from .registry import register_stage

if TYPE_CHECKING:
    from ..backends.base import StageBackend
    from .jobs import Job


@register_stage
class PDActor(BaseActor):
    """Streams deltas from a merged prefill+decode worker (no KV hand-off)."""

    stage = "pd"
    phase = Phase.DECODING
    order = 30
    produces_output = True

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
                ec_transfer_params=context.ec_transfer_params,
            ),
        )
