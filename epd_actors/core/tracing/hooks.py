"""What the router core calls to trace a request, whatever implements it.

The supervisor starts one :class:`RequestTrace` per request (when the router
has a :class:`RequestTracing`) and puts it on the request's ``StageContext``;
each stage actor wraps every attempt on a worker in :func:`attempt_span`.
Nothing here imports OpenTelemetry: with tracing off the supervisor holds
``None``, the context carries ``None``, and :func:`attempt_span` returns one
shared no-op context manager.

While an attempt runs, :data:`epd_actors.trace_context.CURRENT_TRACEPARENT`
holds the W3C ``traceparent`` of its span, which backends put on their
requests (:func:`epd_actors.trace_context.trace_headers`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ...errors import EpdError
    from ...request import GenerationRequest, RequestTimings
    from ..lifecycle import Phase

_OFF: Final[AbstractContextManager[None]] = contextlib.nullcontext()


class TracedJob(Protocol):
    """What an attempt's span reads of the job it wraps (an actor's ``Job``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def item(self) -> int | None: ...
    @property
    def worker_id(self) -> str | None: ...
    @property
    def handed_over(self) -> bool: ...
    @property
    def output_started(self) -> bool: ...


class TracedOutcome(Protocol):
    """What a request's span reads of how it ended (the supervisor's ``RequestOutcome``)."""

    @property
    def phase(self) -> Phase: ...
    @property
    def error(self) -> EpdError | None: ...
    @property
    def timings(self) -> RequestTimings: ...
    @property
    def completion_tokens(self) -> int: ...


class Progress(Protocol):
    """What a trace reads from the supervisor's record of its request."""

    received_at: float
    first_token_at: float | None


class RequestTrace(Protocol):
    """The spans of one request."""

    def attempt(self, job: TracedJob, stage: str, attempt: int) -> AbstractContextManager[None]:
        """A child span around one attempt of ``job`` on its worker (``job.worker_id``).

        The span ends with the attempt: its outcome, and the error that ended
        it, a cancellation included.
        """
        ...

    def end(self, outcome: TracedOutcome) -> None:
        """End the request's span with how the request ended (must not raise)."""
        ...


class RequestTracing(Protocol):
    """Starts request traces; owned by a router."""

    def start(self, request: GenerationRequest, progress: Progress) -> RequestTrace:
        """The trace of ``request``, a child of the client's ``traceparent`` if it sent one."""
        ...

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: call it from a thread)."""
        ...


def attempt_span(
    trace: RequestTrace | None, job: TracedJob, stage: str, attempt: int
) -> AbstractContextManager[None]:
    """The span of one attempt of ``job``, or a no-op when its request is not traced."""
    if trace is None:
        return _OFF
    return trace.attempt(job, stage, attempt)
