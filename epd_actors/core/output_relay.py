"""The output relay: an output stage's deltas go straight to the request's caller.

Theory of operation
-------------------
A request's output stage (decode, or merged PD) produces one delta per engine
step or burst.  Passing each through the supervisor's request task would cost
one more task wake-up per delta; instead the supervisor hands the output job an
:class:`OutputRelay` (``Job.output``), and the job's own task puts each
non-final delta on the request's event channel as a ``DeltaEvent``, doing the
supervisor's bookkeeping (first-token time, tokens so far) as it goes.  The
job's reply channel carries only the end (a ``StageOutput`` with the finish
reason and usage, after the last delta), so the supervisor sees the end of
the stage, takes over the job's compensations and sends the usage and done
events after the last ``DeltaEvent``: the order the caller sees
is the order the worker produced.  The supervisor closes the relay
(:meth:`OutputRelay.close`) when it is done with the job, before it sends
anything else, so a delta of a job being cancelled never follows that.

Who calls it: the job's task (:meth:`OutputRelay.offer`, :meth:`OutputRelay.put`),
or, while that task waits with nothing queued, the backend's reader on its
behalf (:meth:`OutputRelay.sink`, never raising).  The event channel is a
hand-off channel (:mod:`~epd_actors.handoff`): a caller that attached a taker
to it, as the HTTP front end does to write the token to its client at once,
gets each ``DeltaEvent`` in the task that relays it while it waits with
nothing queued.

Deadlines: the relay notes when the last delta passed (``last_delta_at``) and
whether it is waiting for the caller (``waiting_for_caller``).  The supervisor,
waiting for the final event, takes its deadline from those
(:meth:`OutputRelay.deadline`) and, when it passes, asks again before it gives
up.  A job run in the supervisor's own task (``job_watches``) does the same
around each wait for its stream (:meth:`OutputRelay.watched`): the
supervisor is not waiting then, the job is.  Only the first delta touches the
waiting scope (``watch``), because the inter-token deadline may come before the
first-token one; the same first delta lifts the job's attempt deadline
(``attempt``, the actor's first-token deadline of the attempt running).  So the
inter-token timeout still measures the gap between two deltas, without a
deadline change per delta; and while the caller reads too slowly for the event channel to take
a delta, the timeout does not run: a slow reader is not a stalled worker (the
request's own deadline still applies).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from ..errors import StageTimeout
from ..request import DeltaEvent, GenerationEvent

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..handoff import HandoffSender
    from ..protocol import Delta
    from .token_gaps import TokenGaps

T = TypeVar("T")


def delta_event(delta: Delta) -> DeltaEvent:
    """The caller's event for ``delta``: everything of it but the terminal parts."""
    return DeltaEvent(
        delta.text, delta.token_ids, delta.logprobs, delta.tokens, delta.top_logprobs, delta.fields
    )


class OutputProgress(Protocol):
    """The part of a request's record the relay keeps up to date."""

    first_token_at: float | None
    completion_tokens: int


class OutputRelay:
    """Puts an output job's deltas on its request's event channel (see the module doc).

    Args:
        events: the request's event channel (the caller reads the other end).
        progress: where the first-token time and the token count are kept.
        inter_token_s: the inter-token timeout the deadline is moved by.
        gaps: where the gaps between output tokens are counted (the request's
            :class:`~.token_gaps.TokenGaps`), if anywhere.
    """

    __slots__ = (
        "_events",
        "_gaps",
        "_inter_token_s",
        "_now",
        "_progress",
        "attempt",
        "caller_left",
        "closed",
        "job_watches",
        "last_delta_at",
        "relayed",
        "waiting_for_caller",
        "watch",
    )

    def __init__(
        self,
        events: HandoffSender[GenerationEvent],
        progress: OutputProgress,
        inter_token_s: float,
        gaps: TokenGaps | None = None,
    ) -> None:
        self._gaps = gaps
        self._events = events
        self._progress = progress
        self._inter_token_s = inter_token_s
        self._now = trio.lowlevel.current_clock().current_time  # once per delta: the cheapest clock
        self.relayed = False  # a delta arrived through this relay
        self.last_delta_at = -math.inf
        self.waiting_for_caller = False
        self.caller_left = False
        self.closed = False
        self.watch: trio.CancelScope | None = None  # the wait for the stage, while it waits
        self.attempt: trio.CancelScope | None = None  # the job's attempt, while one runs
        # The job runs in the supervisor's task and watches the inter-token deadline itself.
        self.job_watches = False

    def deadline(self, first_token_deadline: float) -> float:
        """When the output stage counts as stalled, as of now.

        ``first_token_deadline`` until a delta arrived, then the inter-token
        timeout after the last one; while the relay waits for the caller, one
        inter-token timeout from now (to be asked again then).
        """
        if self.waiting_for_caller:
            return trio.current_time() + self._inter_token_s
        if not self.relayed:
            return first_token_deadline
        return self.last_delta_at + self._inter_token_s

    def stalled(self) -> StageTimeout:
        """The error of an output stage that passed its inter-token deadline."""
        return StageTimeout(f"no inter token within {self._inter_token_s:g}s", phase="inter_token")

    async def watched(self, receive: Callable[[], Awaitable[T]]) -> T:
        """``await receive()`` under the inter-token deadline: the wait for the stage.

        The supervisor waits so for its job's final event, and a job run in the
        supervisor's task (``job_watches``) for its stream's next delta.  The
        wait is the ``watch`` the first delta tightens; when its deadline
        passes, the deadline is asked again (a delta may have passed meanwhile,
        or the caller may be slow), and the wait goes on until it passes for
        good.  Before the first delta there is none: the attempt's first-token
        deadline applies.

        Raises:
            StageTimeout: no delta within the inter-token timeout.
            what ``receive`` raises.

        Cancellation: as ``receive``'s, which must resume where it stood after
        a wait the deadline cut short (a channel's does; so does a stream's).
        """
        while True:
            deadline = self.deadline(math.inf)
            if deadline <= self._now():
                raise self.stalled()
            with trio.move_on_at(deadline) as self.watch:
                try:
                    return await receive()
                finally:
                    self.watch = None

    def close(self) -> None:
        """The supervisor is done with the job: drop whatever still comes, quietly.

        Whatever the supervisor sends next (the stage's end, an error) must
        not be followed by a late delta of a job that is being cancelled.
        """
        self.closed = True

    def sink(self, delta: Delta) -> bool:
        """Relay ``delta`` if the event channel has room now; False (nothing done) if not.

        Not a checkpoint, never raises: a backend's reader calls it with a delta
        of the job's stream as soon as the delta arrives, while the job's task
        waits with nothing queued.  False: the delta was not taken (no room, or
        the caller left, which sets ``caller_left``); the reader then queues it
        for the job's task, which meets the same condition itself
        (:meth:`offer`).  A closed relay drops the delta (and returns True).
        """
        if self.closed:
            return True
        if delta.token_ids or delta.text or delta.fields:
            try:
                # ``delta_event`` and (below) ``_progressed`` inline: once per token relayed.
                self._events.send_nowait(
                    DeltaEvent(
                        delta.text,
                        delta.token_ids,
                        delta.logprobs,
                        delta.tokens,
                        delta.top_logprobs,
                        delta.fields,
                    )
                )
            except trio.WouldBlock:
                return False
            except trio.BrokenResourceError:
                self.caller_left = True
                return False
            now = self._count(delta)
        else:
            now = self._now()
        self.last_delta_at = now
        if not self.relayed:
            self._first_delta(now)
        return True

    def offer(self, delta: Delta) -> bool:
        """:meth:`sink` for the job's own task, where the caller's leaving raises.

        Raises:
            trio.BrokenResourceError: the caller closed its end (``caller_left`` is set).
        """
        if self.sink(delta):
            return True
        if self.caller_left:
            raise trio.BrokenResourceError("the caller closed its event channel")
        return False

    async def put(self, delta: Delta) -> None:
        """Relay ``delta``, waiting for room in the event channel.

        Raises:
            trio.BrokenResourceError: the caller closed its end (``caller_left`` is set).

        Cancellation: safe; a delta cancelled here was not relayed.
        Backpressure: waits while the caller has ``REQUEST_EVENT_BUFFER`` events
        unread; the inter-token timeout does not run meanwhile.
        """
        if self.closed:
            await trio.lowlevel.checkpoint()
            return
        if delta.token_ids or delta.text or delta.fields:
            self.waiting_for_caller = True
            try:
                await self._events.send(delta_event(delta))
            except trio.BrokenResourceError:
                self.caller_left = True
                raise
            finally:
                self.waiting_for_caller = False
            now = self._count(delta)
        else:
            await trio.lowlevel.checkpoint()
            now = self._now()
        self._progressed(now)

    def _progressed(self, now: float) -> None:
        """A delta passed at ``now``; the first one also moves the deadlines only it changes."""
        self.last_delta_at = now
        if not self.relayed:
            self._first_delta(now)

    def _first_delta(self, now: float) -> None:
        """The first delta passed at ``now``: move the deadlines only it changes."""
        self.relayed = True
        # The inter-token deadline may come before the first-token one.
        if self.watch is not None:
            self.watch.deadline = min(self.watch.deadline, now + self._inter_token_s)
        if self.attempt is not None:  # the output started: no first-token deadline
            self.attempt.deadline = math.inf

    def _count(self, delta: Delta) -> float:
        """Count ``delta``'s tokens; return the time it was counted at (now)."""
        progress = self._progress
        now = self._now()
        if progress.first_token_at is None:
            progress.first_token_at = now
        tokens = len(delta.token_ids)
        progress.completion_tokens += tokens
        if tokens and self._gaps is not None:
            self._gaps.add(now, tokens)
        return now
