"""The WebSocket server's Prometheus metrics, read from it at scrape time.

``epd_ws_connections`` (gauge): accepted connections open now.
``epd_ws_streams_total{outcome}`` (counter): generations ended, by outcome,
one series per outcome of :data:`~.ws.WS_STREAM_OUTCOMES` (a closed set, so
the labels stay bounded whatever clients send).

The server keeps plain integers as it goes (:attr:`~.ws.WsServer.streams`);
this collector costs nothing between scrapes.  Register it on the router's
registry (``router.metrics.registry.register(WsCollector(server))``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .ws import WsServer


class WsCollector(Collector):
    """Exports ``server``'s connections and stream outcomes (see the module doc)."""

    def __init__(self, server: WsServer) -> None:
        self._server = server

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        server = self._server
        connections = GaugeMetricFamily(
            "epd_ws_connections", "Accepted WebSocket connections open now"
        )
        connections.add_metric([], len(server.connections))
        streams = CounterMetricFamily(
            "epd_ws_streams", "WebSocket generations ended, by outcome", labels=["outcome"]
        )
        for outcome, count in server.streams.items():
            streams.add_metric([outcome], count)
        yield connections
        yield streams
