"""D: stream the output from the KV cache P handed over.

A decoder that refuses the hand-off itself -- ``unknown_kv_handle``, or an
invalid-request answer blaming ``kv_transfer_params`` -- before any output is
not the client's fault: the job fails with ``HandoffRejected``, which the
supervisor charges to the worker that produced the handle (and runs that
stage again elsewhere), and which no other decoder would fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ...errors import HandoffRejected, RemoteWorkerError
from ...protocol import ErrorCode, GenerateRequest, Role
from ..lifecycle import Phase
from .base import BaseActor
from .registry import register_stage

if TYPE_CHECKING:
    from ...backends.base import StageBackend
    from ..config import Deadlines
    from .jobs import Job


@register_stage
class DecodeActor(BaseActor):
    """Streams deltas; the request carries P's ``kv_transfer_params`` (when P ran)."""

    stage = "decode"
    worker_roles = frozenset({Role.DECODE})
    consumes_kv_handoff = True
    phase = Phase.DECODING
    order = 30
    produces_output = True
    requires: ClassVar[tuple[str, ...]] = ("prefill",)

    @classmethod
    def attempt_timeout(cls, deadlines: Deadlines) -> float:
        return deadlines.first_token_timeout_s

    async def handle(self, job: Job, backend: StageBackend) -> None:
        context = job.context
        generate = GenerateRequest(
            job.request_id, kv_transfer_params=context.kv_transfer_params, **context.prompt_fields()
        )
        try:
            await self.stream_output(job, backend, generate)
        except RemoteWorkerError as exc:
            if generate.kv_transfer_params is None or job.output_started:
                raise
            if not _refuses_the_handle(exc):
                raise
            raise HandoffRejected(
                f"{self.stage} worker {job.worker_id} refused the KV handle it was handed: "
                f"{exc.detail}",
                cause=exc,
                stage=self.stage,
            ) from exc


def _refuses_the_handle(error: RemoteWorkerError) -> bool:
    """Whether a decoder's refusal is about the KV hand-off rather than the request."""
    if error.code == ErrorCode.UNKNOWN_KV_HANDLE:
        return True
    return error.code == ErrorCode.INVALID_REQUEST and error.param == "kv_transfer_params"
