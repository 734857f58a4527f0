"""What the router core calls to trace a request, whatever implements it.

The supervisor starts one :class:`RequestTrace` per request (when the router
has a :class:`RequestTracing`) and puts it on the request's ``StageContext``;
each stage actor wraps every attempt on a worker in :func:`attempt_span`.
Nothing here imports OpenTelemetry: with tracing off the supervisor holds
``None``, the context carries ``None``, and :func:`attempt_span` returns one
shared no-op context manager.

While an attempt runs, :data:`CURRENT_TRACEPARENT` holds the W3C
``traceparent`` of its span, in the attempt's task (and the tasks it starts):
a backend that sends requests from that task puts it on them
(:func:`trace_headers`), so a worker's own spans join the request's trace.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ..actors.jobs import Job
    from ..request import GenerationRequest
    from ..supervisor import RequestOutcome

CURRENT_TRACEPARENT: Final[ContextVar[str | None]] = ContextVar("epd_traceparent", default=None)
"""The ``traceparent`` of the stage attempt running in this task, if traced."""

_OFF: Final[AbstractContextManager[None]] = contextlib.nullcontext()


class Progress(Protocol):
    """What a trace reads from the supervisor's record of its request."""

    received_at: float
    first_token_at: float | None


class RequestTrace(Protocol):
    """The spans of one request."""

    def attempt(self, job: Job, stage: str, attempt: int) -> AbstractContextManager[None]:
        """A child span around one attempt of ``job`` on its worker (``job.worker_id``).

        The span ends with the attempt: its outcome, and the error that ended
        it, a cancellation included.
        """
        ...

    def end(self, outcome: RequestOutcome) -> None:
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


def attempt_span(job: Job, stage: str, attempt: int) -> AbstractContextManager[None]:
    """The span of one attempt, or a no-op when the request is not traced."""
    trace = job.context.trace
    if trace is None:
        return _OFF
    return trace.attempt(job, stage, attempt)


def trace_headers() -> tuple[tuple[str, str], ...]:
    """``(("traceparent", ...),)`` inside a traced attempt, else ``()``."""
    value = CURRENT_TRACEPARENT.get()
    return () if value is None else (("traceparent", value),)
