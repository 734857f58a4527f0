"""Prometheus metrics of the encoder-output memories, read at scrape time.

One series per encode pool (label ``pool``: the pool's name, ``encode`` or
``encode@model``) of each :class:`~epd_actors.core.encoder_cache.EncoderCache`'s
counters.  Reading them costs nothing between scrapes; see docs/media.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from .encoder_cache import EncoderCache


class EncoderCacheCollector(Collector):
    """Exports the counters of ``caches`` (pool name -> memory) at every scrape."""

    def __init__(self, caches: Mapping[str, EncoderCache]) -> None:
        self._caches = caches

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if not self._caches:
            return  # no pool reuses encoder outputs: no families without series
        labels = ["pool"]
        skipped = CounterMetricFamily(
            "epd_encoder_calls_skipped",
            "Encoder calls skipped: the item's output was remembered from an earlier request",
            labels=labels,
        )
        reused = CounterMetricFamily(
            "epd_encoder_media_bytes_reused",
            "Bytes of media not encoded again thanks to remembered encoder outputs",
            labels=labels,
        )
        missing = CounterMetricFamily(
            "epd_encoder_cache_entries_missing",
            "Remembered encoder outputs a consumer reported gone (encoded again)",
            labels=labels,
        )
        evicted = CounterMetricFamily(
            "epd_encoder_cache_evictions",
            "Remembered encoder outputs dropped to stay within the memory's bounds",
            labels=labels,
        )
        expired = CounterMetricFamily(
            "epd_encoder_cache_expirations",
            "Remembered encoder outputs dropped because their reuse TTL passed",
            labels=labels,
        )
        entries = GaugeMetricFamily(
            "epd_encoder_cache_entries", "Encoder outputs the router remembers", labels=labels
        )
        size = GaugeMetricFamily(
            "epd_encoder_cache_bytes",
            "Estimated bytes the remembered encoder outputs take in the router",
            labels=labels,
        )
        for pool, cache in self._caches.items():
            stats = cache.statistics()
            skipped.add_metric([pool], stats.hits)
            reused.add_metric([pool], stats.media_bytes_reused)
            missing.add_metric([pool], stats.found_missing)
            evicted.add_metric([pool], stats.evicted)
            expired.add_metric([pool], stats.expired)
            entries.add_metric([pool], stats.entries)
            size.add_metric([pool], stats.bytes)
        yield from (skipped, reused, missing, evicted, expired, entries, size)
