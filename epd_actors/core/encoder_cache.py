"""What the router remembers of the encoder outputs its encoders produced.

Theory of operation
-------------------
An encode stage leaves one encoder-cache entry per media item behind, keyed by
the item's content hash, where the consumers (P, PD) can load it: in a shared
directory (vLLM's ``ECSharedStorageConnector``, the simulator's stores) or on
the producing worker, to be pulled (Mooncake/NIXL-style connectors, named in
``ec_transfer_params``).  Without a memory the router encodes an item again on
every request that carries it -- a multi-turn conversation pays E for its
image on every turn.

:class:`EncoderCache` is that memory, one per encode pool: content hash ->
:class:`RememberedEntry` (the producer, the ``ec_transfer_params`` E answered
with for that item, the item's size, until when the entry may be trusted).  It
is pure and synchronous: time is passed in, nothing awaits, nothing does I/O.
It is bounded by a count and by an estimate of the bytes it holds; the least
recently used entry goes first.

Whether an entry is "still there" is the connector's business, and the router
cannot ask; :class:`EncoderReuse` says what to assume, per pool:

* ``mode = "off"`` (the default): remember nothing, encode every time.  Right
  for any connector whose producer may drop an entry once it was pulled.
* ``mode = "ttl"``: trust an entry for ``ttl_s`` after it was written (refreshed
  by no read: the producer's own expiry counts from the write).
  ``scope = "shared"``: the entry lives in storage every consumer reads, so it
  outlives its producer; ``scope = "worker"``: it lives on the producer, so it
  is trusted only while that worker is still reachable in the pool.

An entry that turns out to be gone is the consumer's to report (the
simulator's strict P answers ``missing_encoder_cache``; vLLM's shared-storage
consumer silently runs the encoder itself); :func:`missing_hashes` reads
which remembered items a refusal names, and :meth:`EncoderCache.found_missing`
forgets them, so the router encodes exactly those again (see
``actors/encode.py`` and the supervisor).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

REUSE_MODES: Final = ("off", "ttl")
REUSE_SCOPES: Final = ("shared", "worker")
HASH_PREFIX: Final = 16
"""How many leading characters of a content hash a refusal must name to count as naming it."""
_ENTRY_OVERHEAD: Final = 160
"""Bytes charged per entry beyond its hash and params (the objects themselves, roughly)."""


@dataclass(frozen=True, slots=True)
class EncoderReuse:
    """How an encode pool reuses encoder outputs across requests (``[pools.encode]``).

    Attributes:
        mode: ``off`` (encode every request's items) or ``ttl`` (skip E for an
            item whose entry was written less than ``ttl_s`` ago).
        ttl_s: how long after E wrote an entry the router trusts it (seconds).
        scope: ``shared`` (the entry lives where every consumer reads it, and
            outlives its producer) or ``worker`` (it lives on the producer and
            is trusted only while that worker is reachable in the pool).
        max_entries: entries remembered at most (least recently used dropped).
        max_bytes: bytes the remembered entries may take (an estimate: hash,
            ``ec_transfer_params`` as JSON, a fixed overhead per entry).
    """

    mode: str = "off"
    ttl_s: float = 300.0
    scope: str = "shared"
    max_entries: int = 65_536
    max_bytes: int = 64 * 1024 * 1024

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def check(self, key: str) -> None:
        """Raise ``ConfigError`` naming ``key``'s bad field."""
        if self.mode not in REUSE_MODES:
            raise ConfigError(f"{key}.reuse must be one of {list(REUSE_MODES)}, got {self.mode!r}")
        if self.scope not in REUSE_SCOPES:
            raise ConfigError(
                f"{key}.reuse_scope must be one of {list(REUSE_SCOPES)}, got {self.scope!r}"
            )
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ConfigError(f"{key}.reuse_ttl_s must be a positive number, got {self.ttl_s!r}")
        if self.max_entries < 1:
            raise ConfigError(f"{key}.reuse_max_entries must be >= 1")
        if self.max_bytes < 1:
            raise ConfigError(f"{key}.reuse_max_bytes must be >= 1")


@dataclass(frozen=True, slots=True)
class RememberedEntry:
    """One encoder output the router knows of.

    Attributes:
        content_hash: the media item's content hash (the entry's key).
        producer: the worker that encoded it.
        ec_transfer_params: what E answered for the item (None: nothing; the
            consumer finds the entry by hash), handed to P/PD unchanged.
        media_bytes: the item's size, counted as not re-encoded on each reuse.
        expires_at: when the router stops trusting the entry (router clock).
        cost: bytes charged against ``max_bytes``.
    """

    content_hash: str
    producer: str
    ec_transfer_params: dict[str, object] | None
    media_bytes: int
    expires_at: float
    cost: int


@dataclass(frozen=True, slots=True)
class EncoderCacheStatistics:
    """Counters of one pool's memory (exported as Prometheus metrics).

    Attributes:
        entries / bytes: held now.
        hits: encoder calls skipped (an item's entry was reused).
        media_bytes_reused: bytes of media not re-encoded thanks to those hits.
        misses: lookups that found nothing usable (never seen, expired, producer gone).
        expired: entries dropped because their TTL passed.
        evicted: entries dropped to stay within ``max_entries``/``max_bytes``.
        found_missing: remembered entries a consumer reported gone (re-encoded).
    """

    entries: int
    bytes: int
    hits: int
    media_bytes_reused: int
    misses: int
    expired: int
    evicted: int
    found_missing: int


class EncoderCache:
    """A bounded LRU memory of encoder outputs, with time passed in.

    Not thread-safe; one per encode pool, used from the router's Trio thread.

    Args:
        reuse: the pool's reuse settings (checked here).
    """

    def __init__(self, reuse: EncoderReuse) -> None:
        reuse.check("encoder_cache")
        self.reuse = reuse
        self._entries: OrderedDict[str, RememberedEntry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.media_bytes_reused = 0
        self.misses = 0
        self.expired = 0
        self.evicted = 0
        self.missing = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"EncoderCache(entries={len(self)}, bytes={self._bytes}, mode={self.reuse.mode})"

    def recall(
        self,
        content_hash: str,
        now: float,
        *,
        reachable: Callable[[str], bool] | None = None,
    ) -> RememberedEntry | None:
        """The usable entry for ``content_hash`` (counted as a skipped encoder call), or None.

        ``reachable(worker_id)`` tells, for the ``worker`` scope, whether the
        producer is still there; an entry whose producer is not is dropped.
        With ``mode = "off"`` nothing is ever found.
        """
        entry = self._entries.get(content_hash)
        if entry is None:
            self.misses += self.reuse.enabled
            return None
        if now >= entry.expires_at:
            self._drop(content_hash)
            self.expired += 1
            self.misses += 1
            return None
        if self.reuse.scope == "worker" and reachable is not None and not reachable(entry.producer):
            self._drop(content_hash)
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        self.media_bytes_reused += entry.media_bytes
        return entry

    def remember(
        self,
        content_hash: str,
        producer: str,
        ec_transfer_params: dict[str, object] | None,
        media_bytes: int,
        now: float,
    ) -> None:
        """Record that ``producer`` wrote the entry of ``content_hash`` at ``now``.

        Replaces an older entry of the same hash; evicts the least recently
        used entries until both bounds hold.  An entry larger than
        ``max_bytes`` on its own is not kept.  Does nothing with ``mode = "off"``.
        """
        if not self.reuse.enabled:
            return
        cost = _ENTRY_OVERHEAD + len(content_hash) + len(producer)
        cost += _params_size(ec_transfer_params)
        if content_hash in self._entries:
            self._drop(content_hash)
        if cost > self.reuse.max_bytes:
            return
        self._entries[content_hash] = RememberedEntry(
            content_hash,
            producer,
            ec_transfer_params,
            media_bytes,
            now + self.reuse.ttl_s,
            cost,
        )
        self._bytes += cost
        while len(self._entries) > self.reuse.max_entries or self._bytes > self.reuse.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evicted += 1

    def found_missing(self, content_hashes: Iterable[str]) -> None:
        """A consumer reported these remembered entries gone: forget and count them."""
        for content_hash in content_hashes:
            self.missing += 1
            if content_hash in self._entries:
                self._drop(content_hash)

    def forget(self, content_hash: str) -> bool:
        """Drop one entry; True if it was there."""
        if content_hash not in self._entries:
            return False
        self._drop(content_hash)
        return True

    def statistics(self) -> EncoderCacheStatistics:
        return EncoderCacheStatistics(
            entries=len(self._entries),
            bytes=self._bytes,
            hits=self.hits,
            media_bytes_reused=self.media_bytes_reused,
            misses=self.misses,
            expired=self.expired,
            evicted=self.evicted,
            found_missing=self.missing,
        )

    def _drop(self, content_hash: str) -> None:
        entry = self._entries.pop(content_hash)
        self._bytes -= entry.cost


def missing_hashes(detail: str, remembered: Iterable[str]) -> list[str]:
    """The remembered content hashes a consumer's refusal names as missing.

    A hash counts as named when its first :data:`HASH_PREFIX` characters appear
    in ``detail`` (the simulator names each missing item that way).  When the
    refusal names none of them recognisably, every remembered hash is returned:
    re-encoding one item too many is slower, a missing one would fail again.
    """
    candidates = list(dict.fromkeys(remembered))
    named = [h for h in candidates if h[:HASH_PREFIX] in detail]
    return named or candidates


def _params_size(params: dict[str, object] | None) -> int:
    if not params:
        return 0
    return len(json.dumps(params, separators=(",", ":"), default=str))
