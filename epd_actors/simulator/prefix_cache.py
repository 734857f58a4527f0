"""The simulator's prefix cache: full KV blocks per engine, LRU eviction, KV events.

Theory of operation
-------------------
A prompt is turned into deterministic token ids (:func:`prompt_token_ids`:
one id per whitespace word, derived from the word; ``media_tokens_per_item``
ids per media item, derived from its content hash -- exactly
:func:`~epd_actors.simulator.text.count_prompt_tokens` of them) and cut into full blocks of
``block_size``.  Each block gets an *engine* hash chained over the blocks
before it and seeded by ``hash_seed`` (random per engine when None, as vLLM's
is without ``PYTHONHASHSEED``), so two engines name the same block differently,
as real ones do.

A prefill asks :meth:`SimPrefixCache.begin` how many leading blocks are cached
(they become the most recently used), spends its time on the *uncached* tokens
only (at least one token is always computed, as in vLLM), then
:meth:`SimPrefixCache.store` caches the rest of its full blocks, evicting the
least recently used blocks beyond ``capacity_blocks`` -- never those of the
prompt being stored.  Every change is published, one batch per call, to the
:class:`KVEventSink` (``BlockStored`` with the parent's hash and the blocks'
token ids, ``BlockRemoved``, ``AllBlocksCleared``): the same events vLLM's
scheduler publishes.  No sink, no events.

Synchronous, no I/O: the sink does whatever publishing costs.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored
from .text import VOCAB_SIZE

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from prometheus_client.core import Metric

    from ..kv_events.decode import KVEvent
    from ..protocol import MediaItem, Prompt

__all__ = [
    "KVEventSink",
    "PrefixCacheCollector",
    "PrefixCacheCounters",
    "SimPrefixCache",
    "prompt_token_ids",
]


def _word_id(word: str) -> int:
    raw = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(raw, "big") % VOCAB_SIZE


def _media_ids(item: MediaItem, count: int) -> list[int]:
    seed = hashlib.blake2b(item.content_hash.encode(), digest_size=8).digest()
    base = int.from_bytes(seed, "big")
    return [(base + i * 7919) % VOCAB_SIZE for i in range(count)]


def prompt_token_ids(prompt: Prompt, media: tuple[MediaItem, ...], per_item: int) -> list[int]:
    """The simulator's token ids of a prompt (as many as ``count_prompt_tokens`` says).

    Text: one id per whitespace word.  Token ids: themselves.  Chat: the words
    of each string part in order, each media item's ids where a part first
    names it.  Media not placed by a part follow at the end.
    """
    ids: list[int] = []
    placed: set[int] = set()
    if prompt.text is not None:
        ids += map(_word_id, prompt.text.split())
    elif prompt.token_ids is not None:
        ids += prompt.token_ids
    for message in prompt.messages or ():
        for part in message.parts:
            if isinstance(part, str):
                ids += map(_word_id, part.split())
            elif 0 <= part < len(media) and part not in placed:
                placed.add(part)
                ids += _media_ids(media[part], per_item)
    for i, item in enumerate(media):
        if i not in placed:
            ids += _media_ids(item, per_item)
    return ids


class KVEventSink(Protocol):
    """Where the cache's events go (a publisher, or a list in tests)."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Take one batch of events, in order; must not block."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    """Totals of one :class:`SimPrefixCache` since it was built.

    Attributes:
        queries: prefills that looked their prompt up.
        query_tokens: prompt tokens looked up.
        hit_tokens: prompt tokens found cached (not computed).
        blocks_stored, blocks_evicted: blocks added, and dropped for room.
        clears: :meth:`SimPrefixCache.clear` calls.
        blocks: blocks cached now.
    """

    queries: int
    query_tokens: int
    hit_tokens: int
    blocks_stored: int
    blocks_evicted: int
    clears: int
    blocks: int


class SimPrefixCache:
    """One engine's cache of full KV blocks (see the module docstring).

    Args:
        block_size: tokens per block (>= 1).
        capacity_blocks: blocks held at most (>= 1).
        hash_seed: seeds the engine's block hashes; None draws one.
        sink: receives the events; may be set later (``cache.sink = ...``).
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        capacity_blocks: int = 4096,
        hash_seed: int | None = None,
        sink: KVEventSink | None = None,
    ) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        seed = secrets.randbits(64) if hash_seed is None else hash_seed
        self._root = seed.to_bytes(16, "big", signed=True)
        self.sink = sink
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._queries = self._query_tokens = self._hit_tokens = 0
        self._stored = self._evicted = self._clears = 0

    # -- hashing

    def _hash(self, parent: int | None, tokens: Sequence[int], lora_name: str | None) -> int:
        h = hashlib.blake2b(self._root, digest_size=8)
        if parent is None:  # a chain's first block: rooted at its adapter
            h.update(b"-" + (lora_name or "").encode("utf-8", "surrogatepass") + b"-")
        else:
            h.update(parent.to_bytes(8, "big"))
        h.update(",".join(map(str, tokens)).encode())
        return int.from_bytes(h.digest(), "big")

    def block_hashes(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[int]:
        """The engine's chained hash of every full block of ``token_ids``."""
        out: list[int] = []
        parent: int | None = None
        size = self.block_size
        for i in range(len(token_ids) // size):
            parent = self._hash(parent, token_ids[i * size : (i + 1) * size], lora_name)
            out.append(parent)
        return out

    # -- the prefill's view

    def lookup(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` are cached (no side effects)."""
        matched = 0
        for h in self.block_hashes(token_ids, lora_name):
            if h not in self._blocks:
                break
            matched += 1
        return matched

    def begin(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """Look a prompt up for its prefill: the cached tokens it need not compute.

        The matched blocks become the most recently used.  At most
        ``len(token_ids) - 1`` tokens count as cached (the last is always computed).
        """
        matched = 0
        for h in self.block_hashes(token_ids, lora_name):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            matched += 1
        hit = min(matched * self.block_size, max(len(token_ids) - 1, 0))
        self._queries += 1
        self._query_tokens += len(token_ids)
        self._hit_tokens += hit
        return hit

    def store(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> None:
        """Cache every full block of a prefilled prompt; publish what changed.

        One ``BlockStored`` per run of consecutive new blocks (its parent is the
        block before the run), then one ``BlockRemoved`` for the evictions.
        """
        hashes = self.block_hashes(token_ids, lora_name)
        runs: list[tuple[int, int]] = []  # [start, end) of new blocks
        for i, h in enumerate(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        size = self.block_size
        events: list[KVEvent] = [
            BlockStored(
                block_hashes=tuple(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=tuple(token_ids[start * size : end * size]),
                block_size=size,
                lora_id=None,
                medium="GPU",
                lora_name=lora_name,
            )
            for start, end in runs
        ]
        self._stored += sum(end - start for start, end in runs)
        keep = set(hashes)
        evicted: list[int] = []
        while len(self._blocks) > self.capacity_blocks:
            victim = next((h for h in self._blocks if h not in keep), None)
            if victim is None:
                break  # the prompt alone fills the cache: keep it
            del self._blocks[victim]
            evicted.append(victim)
        if evicted:
            self._evicted += len(evicted)
            events.append(BlockRemoved(block_hashes=tuple(evicted), medium="GPU"))
        self._emit(events)

    def clear(self) -> None:
        """Drop every block (vLLM's ``reset_prefix_cache``); publishes ``AllBlocksCleared``."""
        self._blocks.clear()
        self._clears += 1
        self._emit([AllBlocksCleared()])

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self.sink is not None:
            self.sink.publish(events)

    # -- inspection

    def contents(self) -> frozenset[int]:
        """The engine hashes of every cached block."""
        return frozenset(self._blocks)

    def counters(self) -> PrefixCacheCounters:
        """A snapshot of the counters."""
        return PrefixCacheCounters(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            blocks_stored=self._stored,
            blocks_evicted=self._evicted,
            clears=self._clears,
            blocks=len(self._blocks),
        )


class PrefixCacheCollector(Collector):
    """Exports a :class:`SimPrefixCache`'s counters (``epd_sim_prefix_cache_*``) at scrape time."""

    def __init__(self, cache: SimPrefixCache, worker_id: str) -> None:
        self._cache = cache
        self._worker = worker_id

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self._cache.counters()
        labels = ["worker"]
        for name, doc, value in (
            ("queries", "Prefills that looked their prompt up", c.queries),
            ("query_tokens", "Prompt tokens looked up", c.query_tokens),
            ("hit_tokens", "Prompt tokens found cached", c.hit_tokens),
            ("blocks_stored", "KV blocks cached", c.blocks_stored),
            ("blocks_evicted", "KV blocks evicted for room", c.blocks_evicted),
        ):
            counter = CounterMetricFamily(f"epd_sim_prefix_cache_{name}", doc, labels=labels)
            counter.add_metric([self._worker], value)
            yield counter
        gauge = GaugeMetricFamily(
            "epd_sim_prefix_cache_blocks", "KV blocks cached now", labels=labels
        )
        gauge.add_metric([self._worker], c.blocks)
        yield gauge
