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

The endpoint answers one request per connection, bounded (``MAX_REQUEST_BYTES``
of request head, ``REQUEST_TIMEOUT_S`` in all); only ``GET``/``HEAD
/metrics`` answer 200.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import h11
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..core.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

logger = logging.getLogger(__name__)

PROCESS_LABEL = "process"
SCRAPE_TIMEOUT_S = 5.0
MAX_SCRAPE_BYTES = 64 << 20
MAX_REQUEST_BYTES = 16384
REQUEST_TIMEOUT_S = 10.0
RECEIVE_BYTES = 65536


async def scrape(address: tuple[str, int], *, timeout_s: float = SCRAPE_TIMEOUT_S) -> bytes | None:
    """``GET /metrics`` from ``address``; the body, or None if it did not answer 200 in time.

    Cancellation: cancelling abandons the scrape.  The body is bounded by
    ``MAX_SCRAPE_BYTES``.
    """
    with trio.move_on_after(timeout_s):
        try:
            return await _get(address, b"/metrics")
        except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
            logger.debug("scrape of %s:%d failed: %s", *address, exc)
    return None


async def _get(address: tuple[str, int], target: bytes) -> bytes | None:
    host, port = address
    connection = h11.Connection(h11.CLIENT)
    async with await trio.open_tcp_stream(host, port) as stream:
        request = h11.Request(
            method="GET",
            target=target,
            headers=[("host", f"{host}:{port}"), ("connection", "close")],
        )
        await stream.send_all(connection.send(request) + (connection.send(h11.EndOfMessage())))
        status = 0
        body = bytearray()
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(bytes(await stream.receive_some(RECEIVE_BYTES)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_SCRAPE_BYTES:
                    return None
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return bytes(body) if status == 200 else None


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

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                await _answer(stream, render)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, list(listeners))
        task_status.started()


async def _answer(stream: trio.abc.Stream, render: Callable[[], Awaitable[bytes]]) -> None:
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        request = await _read_request(stream, connection)
    except h11.RemoteProtocolError:
        return
    if request is None:
        return
    path = request.target.split(b"?", 1)[0]
    if path != b"/metrics":
        status, content_type, body = 404, "text/plain; charset=utf-8", b"not found: /metrics\n"
    elif request.method not in (b"GET", b"HEAD"):
        status, content_type, body = 405, "text/plain; charset=utf-8", b"use GET\n"
    else:
        status, content_type, body = 200, CONTENT_TYPE, await render()
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    data = connection.send(h11.Response(status_code=status, headers=headers)) or b""
    if request.method != b"HEAD":
        data += connection.send(h11.Data(data=body)) or b""
    data += connection.send(h11.EndOfMessage()) or b""
    try:
        await stream.send_all(data)
    except trio.BrokenResourceError:
        logger.debug("metrics client went away before its answer")


async def _read_request(stream: trio.abc.Stream, connection: h11.Connection) -> h11.Request | None:
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except trio.BrokenResourceError:
                return None
            connection.receive_data(bytes(data))
            if not data:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None
