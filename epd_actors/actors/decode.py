"""D: stream the output from the KV cache P handed over."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..lifecycle import Phase
from ..protocol import GenerateRequest
from .base import BaseActor
from .registry import register_stage

if TYPE_CHECKING:
    from ..backends.base import StageBackend
    from ..config import Deadlines
    from .jobs import Job


@register_stage
class DecodeActor(BaseActor):
    """Streams deltas; the request carries P's ``kv_transfer_params`` (when P ran)."""

    stage = "decode"
    phase = Phase.DECODING
    order = 30
    produces_output = True
    requires: ClassVar[tuple[str, ...]] = ("prefill",)

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        return deadlines.first_token_timeout_s

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
            ),
        )
