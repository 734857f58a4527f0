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
    from .jobs import StageContext
    from .local_prefill import LocalPrefillRule


@register_stage
class PrefillActor(BaseActor):
    """Returns P's ``kv_transfer_params``; releasing the handle is the compensation."""

    stage = "prefill"
    worker_roles = frozenset({Role.PREFILL})
    phase = Phase.PREFILLING
    order = 20
    requires = ("decode",)
    default_policy = "cache_aware"  # a prefix hit removes most of a prefill

    local_prefill: LocalPrefillRule | None = None
    """Skips the stage for prompts the decoder prefills cheaply itself (off: None)."""

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        return deadlines.prefill_timeout_s

    def use_local_prefill(self, rule: LocalPrefillRule) -> None:
        """Run no job for the requests ``rule`` leaves to the decoder (conditional P/D)."""
        self.local_prefill = rule

    def recall(self, context: StageContext, items: list[int | None]) -> list[int | None]:
        """No job when the decoder prefills the prompt itself (``local_prefill``)."""
        rule = self.local_prefill
        if rule is not None and rule.prefills_locally(context):
            return []
        return items

    async def handle(self, job: Job, backend: StageBackend) -> None:
        result = await backend.run_stage(
            PrefillRequest(job.request_id, **job.context.prompt_fields())
        )
        kv = result.kv_transfer_params
        if kv is not None:
            job.add_compensation(partial(backend.release, kv))
        await job.answer(StageOutput(kv_transfer_params=kv, prompt_tokens=result.prompt_tokens))
