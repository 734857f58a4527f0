"""The OpenTelemetry implementation of :class:`~.hooks.RequestTracing`.

Imported only when tracing is on.  Spans are started with explicit parent
contexts, never through OpenTelemetry's "current span": a stage job may run
in the actor's task rather than its request's, so the request's span travels
with the request (``StageContext.trace``) instead of a context variable.  The
router's provider is its own (not the global one), so routers in one process
keep their own service names and exporters.

The SDK's ``BatchSpanProcessor`` exports from a thread of its own; ending a
span only queues it (bounded by the processor's queue, which drops spans
when full rather than blocking the router).  :meth:`OtelTracing.shutdown`
flushes and blocks, so the router calls it from a worker thread.

Attributes (``epd.*``): on the request span ``epd.request_id``,
``epd.model``, ``epd.priority``, ``epd.outcome``, ``epd.completion_tokens``,
``epd.time_to_first_token_s``, ``epd.retries``, ``epd.workers.<stage>``; on an
attempt span ``epd.stage``, ``epd.worker_id``, ``epd.attempt``, ``epd.item``
(encode), ``epd.outcome``, ``epd.output_started`` and, for the output stage,
``epd.time_to_first_token_s``.  The outcome is ``ok``, ``cancelled`` or the
error's type; anything but ``ok`` sets the span's status to ERROR.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from ...errors import ConfigError
from ...trace_context import CURRENT_TRACEPARENT
from ..lifecycle import Phase

try:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ConfigError(
        f"[tracing] enabled needs OpenTelemetry: pip install 'epd_actors[tracing]' ({exc})"
    ) from None

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span

    from ...request import GenerationRequest
    from .config import TracingConfig
    from .hooks import Progress, TracedJob, TracedOutcome

_PROPAGATOR = TraceContextTextMapPropagator()


def _otlp(config: TracingConfig) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(
            "[tracing] exporter 'otlp' needs opentelemetry-exporter-otlp-proto-http: "
            f"pip install 'epd_actors[tracing]' ({exc})"
        ) from None
    return OTLPSpanExporter(endpoint=config.endpoint or None)


def _console(config: TracingConfig) -> SpanExporter:
    return ConsoleSpanExporter(service_name=config.service_name)


_EXPORTERS: dict[str, Callable[[TracingConfig], SpanExporter]] = {
    "otlp": _otlp,
    "console": _console,
}


def _is_cancellation(error: BaseException) -> bool:
    """A ``trio.Cancelled``, or a group of nothing else (from a nursery on the way)."""
    if isinstance(error, BaseExceptionGroup):
        return error.split(trio.Cancelled)[1] is None
    return isinstance(error, trio.Cancelled)


def _attempt_outcome(error: BaseException | None, job: TracedJob) -> str:
    """``ok``, ``cancelled`` or the error's type.

    An attempt cancelled after the requester took its final event (the
    requester left the job's block while the job was still unwinding) did
    its work: that is ``ok``.
    """
    if error is None:
        return "ok"
    if _is_cancellation(error):
        return "ok" if job.handed_over else "cancelled"
    return type(error).__name__


def _set_outcome(span: Span, outcome: str, error: BaseException | None) -> None:
    span.set_attribute("epd.outcome", outcome)
    if outcome == "ok":
        span.set_status(Status(StatusCode.OK))
        return
    if outcome == "cancelled":
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    if error is not None:
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, outcome if error is None else f"{outcome}: {error}"))


class OtelTracing:
    """Request traces on an OpenTelemetry ``TracerProvider`` of the router's own."""

    def __init__(self, config: TracingConfig, *, processor: SpanProcessor | None = None) -> None:
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        resource = Resource.create({"service.name": config.service_name})
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        if processor is None:
            processor = BatchSpanProcessor(_EXPORTERS[config.exporter](config))
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer("epd_actors")

    def start(self, request: GenerationRequest, progress: Progress) -> OtelRequestTrace:
        parent = None
        if request.traceparent:
            parent = _PROPAGATOR.extract({"traceparent": request.traceparent})
        span = self._tracer.start_span(
            "epd.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "epd.request_id": request.request_id,
                "epd.model": request.model or "",
                "epd.priority": request.priority,
            },
        )
        return OtelRequestTrace(self._tracer, span, progress)

    def shutdown(self) -> None:
        self.provider.shutdown()


class OtelRequestTrace:
    """The root span of one request and its attempt spans."""

    __slots__ = ("_context", "_progress", "_tracer", "retries", "span")

    def __init__(self, tracer: trace.Tracer, span: Span, progress: Progress) -> None:
        self._tracer = tracer
        self.span = span
        self._progress = progress
        self._context = trace.set_span_in_context(span)
        self.retries = 0

    @contextlib.contextmanager
    def attempt(self, job: TracedJob, stage: str, attempt: int) -> Iterator[None]:
        attributes: dict[str, str | int] = {
            "epd.stage": stage,
            "epd.worker_id": job.worker_id or "",
            "epd.attempt": attempt,
            "epd.request_id": job.request_id,
        }
        if job.item is not None:
            attributes["epd.item"] = job.item
        if attempt > 1:
            self.retries += 1
        span = self._tracer.start_span(
            f"epd.{stage}", context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        token = CURRENT_TRACEPARENT.set(carrier.get("traceparent"))
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            CURRENT_TRACEPARENT.reset(token)
            span.set_attribute("epd.output_started", job.output_started)
            progress = self._progress
            if job.output_started and progress.first_token_at is not None:
                ttft = progress.first_token_at - progress.received_at
                span.set_attribute("epd.time_to_first_token_s", ttft)
            _set_outcome(span, _attempt_outcome(error, job), error)
            span.end()

    def end(self, outcome: TracedOutcome) -> None:
        span = self.span
        timings = outcome.timings
        if outcome.phase == Phase.DONE:
            label = "ok"
        elif outcome.phase == Phase.CANCELLED:
            label = "cancelled"
        else:
            label = type(outcome.error).__name__ if outcome.error is not None else "failed"
        span.set_attribute("epd.completion_tokens", outcome.completion_tokens)
        span.set_attribute("epd.retries", self.retries)
        if timings.ttft_s is not None:
            span.set_attribute("epd.time_to_first_token_s", timings.ttft_s)
        for stage, workers in timings.workers.items():
            span.set_attribute(f"epd.workers.{stage}", list(workers))
        error = None if label == "cancelled" else outcome.error
        _set_outcome(span, label, error)
        span.end()
