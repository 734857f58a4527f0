"""P: prefill the prompt and hand its KV cache on; release it if nobody consumes it."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ...protocol import PrefillRequest, Role
from ..lifecycle import Phase
from .base import BaseActor
from .jobs import Job, StageOutput
from .registry import register_stage

if TYPE_CHECKING:
    from ...backends.base import StageBackend
    from ..config import Deadlines


@register_stage
class PrefillActor(BaseActor):
    """Returns P's ``kv_transfer_params``; releasing the handle is the compensation."""

    stage = "prefill"
    worker_roles = frozenset({Role.PREFILL})
    phase = Phase.PREFILLING
    order = 20
    requires = ("decode",)

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        return deadlines.prefill_timeout_s

    async def handle(self, job: Job, backend: StageBackend) -> None:
        result = await backend.run_stage(
            PrefillRequest(job.request_id, **job.context.prompt_fields())
        )
        kv = result.kv_transfer_params
        if kv is not None:
            job.add_compensation(partial(backend.release, kv))
        await job.reply.send(StageOutput(kv_transfer_params=kv, prompt_tokens=result.prompt_tokens))
