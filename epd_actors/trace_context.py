"""The W3C ``traceparent`` of the stage attempt running in the current task.

The router's tracing (:mod:`epd_actors.core.tracing`) sets
:data:`CURRENT_TRACEPARENT` around each traced attempt, in the attempt's task
(and the tasks it starts); a backend that sends requests from that task puts
it on them (:func:`trace_headers`), so a worker's own spans join the request's
trace.  Kept apart so the backends read it without importing the router core.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Final

CURRENT_TRACEPARENT: Final[ContextVar[str | None]] = ContextVar("epd_traceparent", default=None)
"""The ``traceparent`` of the stage attempt running in this task, if traced."""


def trace_headers() -> tuple[tuple[str, str], ...]:
    """``(("traceparent", ...),)`` inside a traced attempt, else ``()``."""
    value = CURRENT_TRACEPARENT.get()
    return () if value is None else (("traceparent", value),)
