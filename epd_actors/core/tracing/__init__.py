"""Request tracing with OpenTelemetry (the ``tracing`` extra), off by default.

One trace per request: a root span from the moment the router took the
request to its final event, and one child span per stage attempt on a worker
(encode items, prefill, decode or pd), with the worker, the attempt number,
its outcome and, for the output stage, the time to first token.  A client's
W3C ``traceparent`` makes the root a child of the client's span; each attempt's
``traceparent`` goes to HTTP-backend workers (``vllm serve`` continues the
trace); the native protocol does not carry it (it refuses unknown fields).

:func:`open_tracing` imports OpenTelemetry only when ``[tracing] enabled``.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ...trace_context import CURRENT_TRACEPARENT, trace_headers
from .config import EXPORTERS, TracingConfig
from .hooks import RequestTrace, RequestTracing, attempt_span

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from opentelemetry.sdk.trace import SpanProcessor

__all__ = [
    "CURRENT_TRACEPARENT",
    "EXPORTERS",
    "RequestTrace",
    "RequestTracing",
    "TracingConfig",
    "attempt_span",
    "closing_tracing",
    "open_tracing",
    "trace_headers",
]


def open_tracing(
    config: TracingConfig, *, processor: SpanProcessor | None = None
) -> RequestTracing | None:
    """The router's tracing, or None when ``config`` leaves it off.

    ``processor`` replaces the configured exporter's batching processor
    (tests pass a ``SimpleSpanProcessor`` over an ``InMemorySpanExporter``).

    Raises:
        ConfigError: tracing is on but the ``tracing`` extra is not installed.
    """
    if not config.enabled:
        return None
    from .otel import OtelTracing

    return OtelTracing(config, processor=processor)


SHUTDOWN_TIMEOUT_S = 10.0
"""How long a closing router waits for its last spans to be exported."""


@asynccontextmanager
async def closing_tracing(tracing: RequestTracing | None) -> AsyncIterator[None]:
    """Shut ``tracing`` down when the block exits (nothing to do for None).

    Cancellation: the flush runs in a worker thread, shielded and bounded by
    :data:`SHUTDOWN_TIMEOUT_S`; past it the router stops waiting (the thread
    finishes the export on its own and the spans may be lost).
    """
    try:
        yield
    finally:
        if tracing is not None:
            with trio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)
