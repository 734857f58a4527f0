"""Prometheus metrics of the KV event feeds, read at scrape time (``epd_kv_*``).

Register a :class:`KVFeedCollector` in the router's registry
(``RouterMetrics.registry.register(...)``); it costs nothing between scrapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .feed import FeedState

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from prometheus_client.core import Metric

    from .subscriber import KVEventSubscriber

__all__ = ["BlockCounts", "KVFeedCollector"]


class BlockCounts(Protocol):
    """What the collector reads of an index: a :class:`~.index.KVBlockIndex`, or several."""

    def blocks(self, worker_id: str) -> int:
        """How many entries ``worker_id`` holds."""
        ...


class KVFeedCollector(Collector):
    """Per-worker feed state and index size, plus each feed's counters.

    ``epd_kv_index_state{worker, state}`` is 1 for the worker's current state
    (``exact``, ``degraded``, ``fallback``) and 0 for the others, the
    Prometheus way of exporting an enum.

    Args:
        subscribers: returns the subscribers to report (read at every scrape).
        index: the index they feed (anything that counts a worker's blocks).
    """

    def __init__(
        self, subscribers: Callable[[], Iterable[KVEventSubscriber]], index: BlockCounts
    ) -> None:
        self._subscribers = subscribers
        self._index = index

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "epd_kv_index_state",
            "1 for the worker's KV event index state (exact, degraded, fallback)",
            labels=["worker", "state"],
        )
        blocks = GaugeMetricFamily(
            "epd_kv_index_blocks", "KV blocks indexed per worker", labels=["worker"]
        )
        counters = {
            name: CounterMetricFamily(f"epd_kv_events_{name}", doc, labels=["worker"])
            for name, doc in (
                ("batches", "KV event batches applied"),
                ("gaps", "Sequence gaps seen"),
                ("losses", "Losses that purged the worker's entries"),
                ("restarts", "Engine restarts seen (the sequence went back)"),
                ("decode_errors", "KV event messages that did not decode"),
                ("disconnects", "Connections to the publisher that dropped"),
            )
        }
        for sub in self._subscribers():
            stats = sub.statistics()
            worker = stats.worker_id
            for s in FeedState:
                state.add_metric([worker, s.value], 1.0 if stats.state is s else 0.0)
            blocks.add_metric([worker], self._index.blocks(worker))
            for name, family in counters.items():
                family.add_metric([worker], getattr(stats, name))
        yield state
        yield blocks
        yield from counters.values()
