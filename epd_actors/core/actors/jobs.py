"""What flows between the supervisor and the stage actors.

A request's pipeline carries a :class:`StageContext` from stage to stage.  For
each stage the supervisor submits one :class:`Job` per item the actor class
splits the context into (one per media item for encode, one otherwise).  A job
answers on its own bounded reply channel with one :class:`StageOutput` (what it
hands to later stages; an output stage's finish reason and usage) or one
:class:`StageFailure`.  An output stage's deltas never travel there: they go on
``Job.output`` (:mod:`~epd_actors.core.output_relay`); a ``Delta`` on a reply
is an actor bug, which the supervisor fails the request with
(``InternalError``).  The job
closes its reply channel when it ends; a channel that closes without a final
event means the actor crashed.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import trio

from ...protocol import Delta, Usage

if TYPE_CHECKING:
    from ...errors import EpdError
    from ...protocol import MediaItem, Prompt, SamplingParams
    from ...request import GenerationRequest
    from ..output_relay import OutputRelay
    from ..tracing import RequestTrace

Compensation = Callable[[], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class StageOutput:
    """A stage's result for the stages after it.

    Attributes:
        ec_transfer_params: merged into the context's encoder transfer params.
        kv_transfer_params: replaces the context's KV transfer params.
        prompt_tokens: the prompt length the stage measured, if it did.
        finish_reason: an output stage's end (its deltas went on ``Job.output``).
        usage: an output stage's token counts, when the worker gave them.
    """

    ec_transfer_params: dict[str, object] | None = None
    kv_transfer_params: dict[str, object] | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class StageFailure:
    """The job failed with a typed error."""

    error: EpdError


StageEvent = Delta | StageOutput | StageFailure


class PromptFields(TypedDict):
    """What ``PrefillRequest`` and ``GenerateRequest`` share (``StageContext.prompt_fields``)."""

    prompt: Prompt
    media: tuple[MediaItem, ...]
    sampling: SamplingParams
    ec_transfer_params: dict[str, object] | None
    options: dict[str, object] | None
    lora_adapter: str | None


@dataclass(slots=True)
class StageContext:
    """A request plus what its earlier stages produced.

    ``wire_id`` is the id the workers see (``request_id`` plus a unique suffix,
    so two clients reusing an id never collide on a worker); empty means the
    request id itself.  ``adapter`` is the LoRA adapter the request's model
    names (None: the base model), which stage requests carry.
    ``recalled`` holds the content hashes whose encoder params came from the
    router's memory of earlier requests rather than from an encode job of
    this one (see :mod:`~epd_actors.encoder_cache`).  ``trace`` is
    the request's trace when the router traces (None: not traced).
    """

    request: GenerationRequest
    wire_id: str = ""
    adapter: str | None = None
    ec_transfer_params: dict[str, object] | None = None
    kv_transfer_params: dict[str, object] | None = None
    prompt_tokens: int | None = None
    recalled: set[str] = field(default_factory=set)
    trace: RequestTrace | None = None

    def absorb(self, output: StageOutput) -> None:
        """Fold a stage's output into the context."""
        if output.ec_transfer_params:
            merged = dict(self.ec_transfer_params or {})
            merged.update(output.ec_transfer_params)
            self.ec_transfer_params = merged
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.prompt_tokens is not None:
            self.prompt_tokens = output.prompt_tokens

    def prompt_fields(self) -> PromptFields:
        """What a prefill or generate request takes from the request and E's output.

        The fields ``PrefillRequest`` and ``GenerateRequest`` share, so a field
        added to both is filled in one place.
        """
        request = self.request
        return {
            "prompt": request.prompt,
            "media": request.media,
            "sampling": request.sampling,
            "ec_transfer_params": self.ec_transfer_params,
            "options": request.options,
            "lora_adapter": self.adapter,
        }


@dataclass(eq=False, slots=True)
class Job:
    """One unit of work for a stage actor.

    Attributes:
        context: the request and what earlier stages produced.
        item: which part of the context this job covers (a media index for
            encode), or ``None``.
        reply: where the job's events go; the job task owns and closes it.
        output: for an output stage run by the supervisor, where its non-final
            deltas go instead of ``reply`` (straight to the request's caller);
            ``None``: every event goes on ``reply``.
        enqueued_at / started_at / finished_at: router clock readings.
        worker_id: the worker the job ran on, once chosen.
        scope: cancelled by the requester when it no longer wants the job.
        output_started: set once an output token reached the requester (an
            output stage is never retried after that).
        last_error: the error of the previous attempt, when retrying.
        timed_out: set by the requester when its inter-token deadline expired
            on this job; the worker's circuit breaker counts it as a failure.
        avoid: workers the job must not run on (their earlier result for this
            request was refused by a later stage).
        attempt: the cancel scope of the running attempt, whose deadline is
            the stage's attempt deadline until the output starts.
        compensations: what undoes the job's leftovers (a prefilled KV handle)
            should the request not complete.  The requester takes them over
            together with the job's final event (:meth:`hand_over`).  Untaken,
            they are run by whichever of the two ends last: the job's task when
            the requester had left already, else the requester as it leaves
            (:meth:`BaseActor.submit <.base.BaseActor.submit>`).  So a result
            that waits for its requester in the reply channel is never undone
            under it, whatever order the scheduler runs the two tasks in.
        requester_left: the requester left :meth:`BaseActor.submit
            <.base.BaseActor.submit>` (it takes nothing more from the job).
    """

    context: StageContext
    item: int | None
    reply: trio.MemorySendChannel[StageEvent]
    enqueued_at: float
    started_at: float | None = None
    finished_at: float | None = None
    worker_id: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    compensations: list[Compensation] = field(default_factory=list)
    handed_over: bool = False
    requester_left: bool = False
    output_started: bool = False
    last_error: EpdError | None = None
    timed_out: bool = False
    output: OutputRelay | None = None
    avoid: tuple[str, ...] = ()
    attempt: trio.CancelScope | None = None

    @property
    def request_id(self) -> str:
        """The id this job's worker requests carry."""
        return self.context.wire_id or self.context.request.request_id

    def output_began(self) -> None:
        """An output delta reached the requester: no retry, no attempt deadline from now on."""
        self.output_started = True
        if self.attempt is not None:
            self.attempt.deadline = math.inf

    async def answer(self, event: StageEvent) -> None:
        """Send the job's final event on ``reply``.

        At once when the buffer has room -- the one final event always finds
        it -- so a job ends in the scheduling step that produced its answer,
        without a round through the scheduler for the send; awaited otherwise.

        Raises:
            trio.BrokenResourceError: the requester left.

        Cancellation: not a checkpoint when the event went at once.
        """
        try:
            self.reply.send_nowait(event)
        except trio.WouldBlock:
            await self.reply.send(event)

    def add_compensation(self, compensation: Compensation) -> None:
        """Register an undo step before announcing the result it undoes."""
        self.compensations.append(compensation)

    def hand_over(self) -> list[Compensation]:
        """The requester takes the job's compensations (synchronously, with its result)."""
        self.handed_over = True
        taken, self.compensations = self.compensations, []
        return taken

    def cancel(self) -> None:
        """Stop the job (before or while it runs); idempotent."""
        self.scope.cancel(reason="requester no longer wants the job")
