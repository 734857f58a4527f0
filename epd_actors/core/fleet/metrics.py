"""Prometheus metrics of the shared state, read from :class:`~.sync.FleetSync` at scrape time.

========================================  =======  ===========================================
metric                                    type     meaning
========================================  =======  ===========================================
``epd_fleet_store_up``                    gauge    1 while the last exchange with the store
                                                   succeeded, else 0 (the router serves on its
                                                   local view)
``epd_fleet_store_failures_total``        counter  failed or late exchanges
``epd_fleet_store_outages_total``         counter  times the store went from answering to not
``epd_fleet_routers``                     gauge    live routers the store lists (this one too)
``epd_fleet_remote_requests_in_flight``   gauge    the other routers' requests in flight
``epd_fleet_remote_in_flight``            gauge    the other routers' jobs per worker
                                                   (label ``worker``)
``epd_fleet_changes_pending``             gauge    admin changes waiting to be sent
``epd_fleet_changes_applied_total``       counter  other routers' admin changes applied here
========================================  =======  ===========================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .status import FleetStatus


class FleetCollector:
    """A Prometheus collector over one router's fleet status (``FleetSync.status``)."""

    def __init__(self, status: Callable[[], FleetStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        up = GaugeMetricFamily("epd_fleet_store_up", "Whether the shared store answers")
        up.add_metric([], 1.0 if status.up else 0.0)
        failures = CounterMetricFamily(
            "epd_fleet_store_failures", "Failed or late exchanges with the shared store"
        )
        failures.add_metric([], status.failures)
        outages = CounterMetricFamily(
            "epd_fleet_store_outages", "Times the shared store stopped answering"
        )
        outages.add_metric([], status.outages)
        routers = GaugeMetricFamily("epd_fleet_routers", "Live routers the shared store lists")
        routers.add_metric([], len(status.routers))
        requests = GaugeMetricFamily(
            "epd_fleet_remote_requests_in_flight", "Other routers' requests in flight"
        )
        requests.add_metric([], status.remote_requests_in_flight)
        remote = GaugeMetricFamily(
            "epd_fleet_remote_in_flight",
            "Other routers' jobs in flight per worker",
            labels=["worker"],
        )
        for worker, count in sorted(status.remote_in_flight.items()):
            remote.add_metric([worker], count)
        pending = GaugeMetricFamily(
            "epd_fleet_changes_pending", "Admin changes waiting for the shared store"
        )
        pending.add_metric([], status.pending_changes)
        applied = CounterMetricFamily(
            "epd_fleet_changes_applied", "Other routers' admin changes applied here"
        )
        applied.add_metric([], status.changes_applied)
        yield from (up, failures, outages, routers, requests, remote, pending, applied)
