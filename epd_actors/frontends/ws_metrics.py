"""The WebSocket server's Prometheus metrics, read from it at scrape time.

``epd_ws_connections`` (gauge): accepted connections open now.
``epd_ws_streams_total{outcome}`` (counter): generations ended, by outcome,
one series per outcome of :data:`~.ws.WS_STREAM_OUTCOMES` (a closed set, so
the labels stay bounded whatever clients send).

The server keeps plain integers as it goes (:attr:`~.ws.WsServer.streams`);
this collector costs nothing between scrapes and sums every server it is
given (the upgrades on the HTTP port and the separate listener).  Register it
once on the router's registry
(``router.metrics.registry.register(WsCollector(servers))``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .ws import WsServer


class WsCollector(Collector):
    """Exports the connections and stream outcomes of ``servers``, summed (see the module doc).

    Args:
        servers: the WebSocket servers of one router; the list may grow after
            registration (a listener that starts later).
    """

    def __init__(self, servers: list[WsServer]) -> None:
        self._servers = servers

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        connections = GaugeMetricFamily(
            "epd_ws_connections", "Accepted WebSocket connections open now"
        )
        connections.add_metric([], sum(len(server.connections) for server in self._servers))
        streams = CounterMetricFamily(
            "epd_ws_streams", "WebSocket generations ended, by outcome", labels=["outcome"]
        )
        totals: dict[str, int] = {}
        for server in self._servers:
            for outcome, count in server.streams.items():
                totals[outcome] = totals.get(outcome, 0) + count
        for outcome, count in totals.items():
            streams.add_metric([outcome], count)
        yield connections
        yield streams
