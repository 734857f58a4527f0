"""Prometheus metrics of one router (its own registry, so routers can share a process).

Counters and histograms are updated as things happen: the HTTP front end calls
:meth:`RouterMetrics.observe_http`, the supervisor reports every finished
request through :meth:`RouterMetrics.request_finished` (it is a
``RequestObserver``).  Gauges that describe state (in-flight per pool and per
worker, worker health, actor queues, restarts) are read from the router's
statistics at scrape time by a custom collector, so they cost nothing between
scrapes.

Inter-token latency has vLLM's shape: one observation per gap between output
tokens.  The output relay counts a request's gaps into bucket counts as deltas
pass (:mod:`.token_gaps`), and :meth:`RouterMetrics.request_finished` adds
them to the histogram's totals, which a collector exports at scrape time; so
no histogram is touched per token.

Labels stay bounded: ``stage`` and ``worker`` series of the state gauges are
read from the pools' current members at each scrape (a worker removed at run
time has none from then on); ``model`` is the configured model a request
resolved to (never the string a client sent: an unknown name fails the
request before it has a model); ``outcome`` is ``done``, ``cancelled`` or an
error class of the router; ``route`` is a known path or ``other``.

The router's registry also holds prometheus-client's ``ProcessCollector``
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...), as a
worker's default registry does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .health import BreakerState
from .lifecycle import Phase
from .token_gaps import TOKEN_GAP_BUCKETS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .statistics import RouterStatistics
    from .supervisor import RequestOutcome

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class RouterMetrics:
    """The metrics of one router.

    Args:
        statistics: returns the router's current statistics (read at scrape).
    """

    def __init__(self, statistics: Callable[[], RouterStatistics] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.http_requests = Counter(
            "epd_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=registry,
        )
        self.requests = Counter(
            "epd_requests", "Generation requests by outcome", ["outcome"], registry=registry
        )
        self.ttft = Histogram(
            "epd_time_to_first_token_seconds",
            "Request received to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = _TokenGapHistogram()
        registry.register(self.inter_token)
        ProcessCollector(registry=registry)
        self.e2e = Histogram(
            "epd_request_duration_seconds",
            "Request received to its last event",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage_duration = Histogram(
            "epd_stage_duration_seconds",
            "Wall time of one stage of a request",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "epd_queue_wait_seconds",
            "Time a request's jobs waited for an actor and a worker",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.output_tokens = Counter(
            "epd_output_tokens", "Output tokens streamed to clients", registry=registry
        )
        self.prompt_tokens = Counter(
            "epd_prompt_tokens",
            "Prompt tokens of finished requests, by configured model",
            ["model"],
            registry=registry,
        )
        self.generation_tokens = Counter(
            "epd_generation_tokens",
            "Output tokens generated, by configured model",
            ["model"],
            registry=registry,
        )
        # Labelled children, looked up once each (``labels()`` takes a lock
        # and builds its key on every call); created on first use as before.
        self._http_children: dict[tuple[str, int], Counter] = {}
        self._outcome_children: dict[str, Counter] = {}
        self._stage_children: dict[str, Histogram] = {}
        self._model_children: dict[str | None, tuple[Counter, Counter]] = {}
        if statistics is not None:
            self.watch(statistics)

    def watch(self, statistics: Callable[[], RouterStatistics]) -> None:
        """Export the state gauges read from ``statistics`` at every scrape."""
        self.registry.register(_StateCollector(statistics))

    def observe_http(self, route: str, status: int) -> None:
        key = (route, status)
        child = self._http_children.get(key)
        if child is None:
            child = self._http_children[key] = self.http_requests.labels(route, str(status))
        child.inc()

    def request_finished(self, outcome: RequestOutcome) -> None:
        """Record a finished request (``RequestObserver``)."""
        if outcome.phase == Phase.DONE:
            label = "done"
        elif outcome.phase == Phase.CANCELLED:
            label = "cancelled"
        else:
            label = type(outcome.error).__name__ if outcome.error is not None else "failed"
        outcome_child = self._outcome_children.get(label)
        if outcome_child is None:
            outcome_child = self._outcome_children[label] = self.requests.labels(label)
        outcome_child.inc()
        timings = outcome.timings
        self.e2e.observe(timings.total_s)
        self.queue_wait.observe(timings.queue_wait_s)
        for stage, seconds in timings.stages.items():
            stage_child = self._stage_children.get(stage)
            if stage_child is None:
                stage_child = self._stage_children[stage] = self.stage_duration.labels(stage)
            stage_child.observe(seconds)
        self.output_tokens.inc(outcome.completion_tokens)
        if outcome.prompt_tokens or outcome.completion_tokens:
            prompt, generation = self._model_counters(outcome.model)
            prompt.inc(outcome.prompt_tokens)
            generation.inc(outcome.completion_tokens)
        if timings.ttft_s is not None:
            self.ttft.observe(timings.ttft_s)
        if outcome.token_gaps is not None:
            self.inter_token.add(outcome.token_gaps.counts, outcome.token_gaps.total_s)

    def _model_counters(self, model: str | None) -> tuple[Counter, Counter]:
        """The token counters of ``model`` (a configured model; None: pools name none)."""
        children = self._model_children.get(model)
        if children is None:
            label = model or ""
            children = self._model_children[model] = (
                self.prompt_tokens.labels(label),
                self.generation_tokens.labels(label),
            )
        return children

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))


class _TokenGapHistogram(Collector):
    """``epd_inter_token_latency_seconds``: the gaps of finished requests, summed.

    Requests' bucket counts (:class:`~.token_gaps.TokenGaps`) are added here
    once each; a scrape makes them cumulative.
    """

    def __init__(self) -> None:
        self.counts = [0] * (len(TOKEN_GAP_BUCKETS) + 1)
        self.total_s = 0.0

    def add(self, counts: list[int], total_s: float) -> None:
        """Add one request's gaps (``counts`` per bucket, not cumulative)."""
        totals = self.counts
        for index, count in enumerate(counts):
            if count:
                totals[index] += count
        self.total_s += total_s

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*TOKEN_GAP_BUCKETS, None), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound is None else repr(bound), running))
        yield HistogramMetricFamily(
            "epd_inter_token_latency_seconds",
            "Gaps between output tokens, one observation per gap",
            buckets=buckets,
            sum_value=self.total_s,
        )


class _StateCollector(Collector):
    """Reads pool, worker and actor state from the router at scrape time."""

    def __init__(self, statistics: Callable[[], RouterStatistics]) -> None:
        self._statistics = statistics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        pool_in_flight = GaugeMetricFamily(
            "epd_pool_in_flight", "Jobs in flight per pool", labels=["stage"]
        )
        pool_usable = GaugeMetricFamily(
            "epd_pool_usable_workers", "Workers able to take work, per pool", labels=["stage"]
        )
        worker_in_flight = GaugeMetricFamily(
            "epd_worker_in_flight", "Jobs in flight per worker", labels=["stage", "worker"]
        )
        worker_up = GaugeMetricFamily(
            "epd_worker_healthy", "1 when the worker can take work", labels=["stage", "worker"]
        )
        aborts = CounterMetricFamily(
            "epd_aborts_sent", "Aborts sent to workers", labels=["stage", "worker"]
        )
        refused = GaugeMetricFamily(
            "epd_worker_refused",
            "1 while the worker is refused: it announced a role or model its pool cannot use",
            labels=["stage", "worker"],
        )
        refusals = CounterMetricFamily(
            "epd_worker_refusals",
            "Times the worker was refused for what it announced",
            labels=["stage", "worker"],
        )
        jobs = CounterMetricFamily(
            "epd_worker_jobs",
            "Jobs given to the worker (leases granted)",
            labels=["stage", "worker"],
        )
        failures = CounterMetricFamily(
            "epd_worker_job_failures",
            "Jobs of the worker that failed on the worker's side",
            labels=["stage", "worker"],
        )
        connected = GaugeMetricFamily(
            "epd_worker_connected", "1 while the worker is connected", labels=["stage", "worker"]
        )
        draining = GaugeMetricFamily(
            "epd_worker_draining", "1 while the worker drains", labels=["stage", "worker"]
        )
        breaker = GaugeMetricFamily(
            "epd_worker_breaker_state",
            "1 for the circuit breaker state the worker is in, 0 for the others",
            labels=["stage", "worker", "state"],
        )
        for stage, members in stats.pools.items():
            pool_in_flight.add_metric([stage], sum(m.in_flight for m in members))
            pool_usable.add_metric([stage], sum(m.usable for m in members))
            for member in members:
                worker_in_flight.add_metric([stage, member.worker_id], member.in_flight)
                worker_up.add_metric([stage, member.worker_id], 1.0 if member.usable else 0.0)
                aborts.add_metric([stage, member.worker_id], member.aborts_sent)
                refused.add_metric([stage, member.worker_id], float(member.refused is not None))
                refusals.add_metric([stage, member.worker_id], member.refusals)
                jobs.add_metric([stage, member.worker_id], member.served)
                failures.add_metric([stage, member.worker_id], member.failures)
                connected.add_metric([stage, member.worker_id], float(member.connected))
                draining.add_metric([stage, member.worker_id], float(member.draining))
                for state in BreakerState:
                    breaker.add_metric(
                        [stage, member.worker_id, state.value], float(member.breaker == state)
                    )
        supervisor = stats.supervisor
        retries = CounterMetricFamily(
            "epd_retries", "Stage attempts retried on another worker", labels=["stage"]
        )
        queued = GaugeMetricFamily(
            "epd_actor_queued_jobs", "Jobs waiting in a stage actor's inbox", labels=["stage"]
        )
        for stage, actor in stats.actors.items():
            retries.add_metric([stage], actor.retries_total)
            queued.add_metric([stage], actor.queued)
        admission_refusals = CounterMetricFamily(
            "epd_admission_refusals", "Requests refused at the in-flight limit"
        )
        admission_refusals.add_metric([], supervisor.requests_refused)
        in_flight = GaugeMetricFamily("epd_requests_in_flight", "Requests being served")
        in_flight.add_metric([], supervisor.requests_in_flight)
        restarts = CounterMetricFamily(
            "epd_actor_restarts", "Times each stage actor was restarted", labels=["stage"]
        )
        for stage, count in supervisor.actor_restarts.items():
            restarts.add_metric([stage], count)
        yield from (pool_in_flight, pool_usable, worker_in_flight, worker_up, in_flight, restarts)
        yield from (retries, queued, admission_refusals, aborts, refused, refusals)
        yield from (connected, draining, breaker, jobs, failures)
