"""The metrics of several router processes, one endpoint: ``[server] metrics_listen``.

Each router process keeps its own registry (:class:`~epd_actors.core.metrics.RouterMetrics`,
counters and histograms updated as things happen, state gauges read at scrape
time by a custom collector).  The parent of ``serve --processes N`` serves
``GET /metrics`` by scraping every ready child's private listener at that
moment, concurrently and each within ``SCRAPE_TIMEOUT_S``, and merging the
answers: every series gets a ``process="I"`` label (the child's index, stable
across its restarts), one ``# HELP``/``# TYPE`` per family.  The parent adds
``epd_router_process_up{process}`` (1 when that child answered) and
``epd_router_process_restarts_total{process}``.

A child's counters restart at 0 when it restarts; Prometheus' ``rate()`` and
``increase()`` treat that as a counter reset, per series.  Sum over
``process`` for the host's totals.

Why not prometheus-client's multiprocess mode: it keeps only values written
through its metric objects (one mmap file per process and metric), so custom
collectors (our state gauges, read from the router at scrape time) are not
exported; gauges need a per-metric aggregation mode; and its directory must be
wiped at start and dead processes marked (``mark_process_dead``).  Scraping
the children costs one loopback request per child per scrape and keeps every
metric exactly what a single router exports.

The endpoint is :mod:`epd_actors.http.metrics_endpoint` (one bounded request
per connection; only ``GET``/``HEAD /metrics`` answer 200); a scrape of a
child goes through the package's HTTP client (:mod:`epd_actors.http.client`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..core.metrics import CONTENT_TYPE
from ..http.client import ClientLimits, HttpClientError, WorkerHttpClient
from ..http.metrics_endpoint import serve_metrics as serve_endpoint

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

logger = logging.getLogger(__name__)

PROCESS_LABEL = "process"
SCRAPE_TIMEOUT_S = 5.0
MAX_SCRAPE_BYTES = 64 << 20
_SCRAPE_LIMITS = ClientLimits(
    connect_timeout_s=SCRAPE_TIMEOUT_S,
    read_timeout_s=SCRAPE_TIMEOUT_S,
    write_timeout_s=SCRAPE_TIMEOUT_S,
    max_connections=1,
    max_keepalive_connections=0,
)


async def scrape(address: tuple[str, int], *, timeout_s: float = SCRAPE_TIMEOUT_S) -> bytes | None:
    """``GET /metrics`` from ``address``; the body, or None if it did not answer 200 in time.

    Cancellation: cancelling abandons the scrape.  The body is bounded by
    ``MAX_SCRAPE_BYTES``.
    """
    host, port = address
    client = WorkerHttpClient(f"http://{host}:{port}", _SCRAPE_LIMITS)
    try:
        with trio.move_on_after(timeout_s):
            response = await client.request("GET", "/metrics")
            try:
                body = await response.read_all(MAX_SCRAPE_BYTES)
            finally:
                await response.aclose()
            return body if response.status == 200 else None
    except (HttpClientError, ValueError) as exc:
        logger.debug("scrape of %s:%d failed: %s", host, port, exc)
    finally:
        await client.aclose()
    return None


def merge(scrapes: Mapping[str, bytes | None], restarts: Mapping[str, int] | None = None) -> bytes:
    """One exposition of every process's series, labelled ``process``.

    Args:
        scrapes: a process's label value -> its exposition text, or None when
            it did not answer (its ``up`` is 0 and it has no other series).
        restarts: a process's label value -> how often it was restarted.

    A family is merged by name; the type and help of the first process that
    has it win.
    """
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "epd_router_process_up",
        "1 when the router process answered this scrape",
        labels=[PROCESS_LABEL],
    )
    for process, text in scrapes.items():
        up.add_metric([process], 0.0 if text is None else 1.0)
        if text is None:
            continue
        for family in text_string_to_metric_families(text.decode("utf-8", errors="replace")):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, PROCESS_LABEL: process}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    extra: list[Metric] = [up]
    if restarts is not None:
        counter = CounterMetricFamily(
            "epd_router_process_restarts",
            "Times the parent restarted the router process",
            labels=[PROCESS_LABEL],
        )
        for process, count in restarts.items():
            counter.add_metric([process], count)
        extra.append(counter)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), *extra]))
    return bytes(generate_latest(registry))


class _Fixed(Collector):
    def __init__(self, metrics: Sequence[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics


async def serve_metrics(
    listeners: Sequence[trio.SocketListener],
    render: Callable[[], Awaitable[bytes]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` with ``await render()`` on ``listeners`` until cancelled.

    Cancellation: cancelling stops accepting and drops open connections.
    Backpressure: none needed; each connection is one bounded request.
    """
    await serve_endpoint(listeners, render, CONTENT_TYPE, task_status=task_status)
