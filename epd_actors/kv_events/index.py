"""An exact prefix index of every worker's KV cache, built from its KV events.

Theory of operation
-------------------
An engine names each cached block by a hash chained over the blocks before it,
seeded by the engine's hash seed (vLLM: ``PYTHONHASHSEED``, random per process
unless set).  Two engines with the same blocks therefore publish different
hashes, and the router could not turn a prompt into an engine's hashes even if
it wanted to.  So the index keys blocks on hashes it computes itself from the
events' token ids, chained the same way (:func:`block_key`):
``key(parent_key, block token ids, block extra keys)``, rooted at the LoRA
adapter name -- the approach of llm-d's KV-cache indexer.  The engine's hashes
are kept only to translate the engine's later references (a ``BlockStored``'s
parent, a ``BlockRemoved``) into router keys.

Per worker the index holds ``engine hash -> entry`` and ``router key ->
entry``; across workers one ``router key -> workers`` map answers
:meth:`KVBlockIndex.match`: a prompt's token ids are cut into full blocks of
the worker's block size, each block keyed, and a worker's match is the number
of leading blocks in a row that it holds.

What the index holds is a subset of what the engines cache: a block arrives
with the event that stored it and leaves with the event that evicted it, the
whole worker's cache when it cleared, restarted or lost events
(:meth:`purge`).  A stored block whose parent the index does not know (stored
before the subscription, or dropped by the bounds below) cannot be keyed and is
skipped -- no prompt could reach it from the root anyway.

Bounds: at most ``max_blocks_per_worker`` entries per worker and
``max_blocks`` in all.  A store beyond either bound drops the oldest stored
entries first (of that worker, or of anyone for the total), which only makes
the index miss hits, never invent them.  Events for other media than
``mediums`` (CPU offload tiers) and other KV cache groups than 0 (the sliding
window groups of hybrid models) are counted and ignored.

Pure and synchronous: no I/O, no clock; the subscriber applies events in order.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import msgpack

from ..errors import ConfigError
from .decode import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from .decode import BlockHash, ExtraKey, KVEvent

__all__ = [
    "DEFAULT_MEDIUMS",
    "IndexStatistics",
    "KVBlockIndex",
    "block_key",
    "block_keys",
    "root_key",
]

DEFAULT_MEDIUMS: Final = frozenset({None, "GPU"})
"""The media indexed by default: the engine's own GPU cache (older vLLM sends no medium)."""

_PACK: Final = msgpack.Packer(use_bin_type=True, autoreset=True)


def root_key(lora_name: str | None = None) -> bytes:
    """The key a chain starts from: one per LoRA adapter (None: the base model)."""
    name = b"" if lora_name is None else lora_name.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(name, digest_size=16, person=b"epd-kv-root").digest()


def block_key(parent: bytes, tokens: Sequence[int], extra: ExtraKey = None) -> bytes:
    """The router's key of one block: BLAKE2b-128 over (parent key, token ids, extra keys).

    The same in every process and router (no salted ``hash()``), whatever the
    engine's hash seed.
    """
    h = hashlib.blake2b(parent, digest_size=16, person=b"epd-kv-block")
    h.update(_PACK.pack([list(tokens), extra]))
    return h.digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: Sequence[ExtraKey] | None = None,
) -> list[bytes]:
    """The chained keys of every full block of ``token_ids`` (a partial last block has none)."""
    keys: list[bytes] = []
    parent = root_key(lora_name)
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Entry:
    key: bytes
    engine_hash: BlockHash


@dataclass(slots=True)
class _Worker:
    by_hash: dict[BlockHash, _Entry]
    by_key: OrderedDict[bytes, _Entry]  # oldest stored first
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    """Counters of one :class:`KVBlockIndex` (totals since it was built).

    Attributes:
        blocks: entries held now, over all workers.
        workers: workers with at least one entry or a known block size.
        stored, removed: blocks added and removed by events.
        orphans: stored blocks skipped because their parent was unknown.
        ignored: blocks of other media or KV cache groups.
        evicted: entries dropped by the bounds.
        purges: whole-worker purges (clears, restarts, losses).
    """

    blocks: int
    workers: int
    stored: int
    removed: int
    orphans: int
    ignored: int
    evicted: int
    purges: int


class KVBlockIndex:
    """Every worker's cached blocks, keyed on router-computed chained hashes.

    Args:
        max_blocks_per_worker: entries one worker may hold (>= 1).
        max_blocks: entries all workers together may hold (>= 1).
        mediums: the ``medium`` values indexed.

    Raises:
        ConfigError: a bound below 1.
    """

    def __init__(
        self,
        *,
        max_blocks_per_worker: int = 1 << 20,
        max_blocks: int = 1 << 22,
        mediums: Iterable[str | None] = DEFAULT_MEDIUMS,
    ) -> None:
        if max_blocks_per_worker < 1 or max_blocks < 1:
            raise ConfigError("KV index bounds must be >= 1")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_blocks = max_blocks
        self._mediums = frozenset(mediums)
        self._workers: dict[str, _Worker] = {}
        self._owners: dict[bytes, set[str]] = {}
        self._order: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # oldest first
        self._stored = self._removed = self._orphans = self._ignored = 0
        self._evicted = self._purges = 0

    # -- applying events

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch's events of ``worker_id``, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker_id, event)
            elif isinstance(event, BlockRemoved):
                self._remove(worker_id, event)
            elif isinstance(event, AllBlocksCleared):
                self.purge(worker_id)

    def purge(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (its block size too)."""
        worker = self._workers.pop(worker_id, None)
        self._purges += 1
        if worker is None:
            return
        for key in worker.by_key:
            self._drop_owner(worker_id, key)
            self._order.pop((worker_id, key), None)

    def _worker(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._workers[worker_id] = _Worker({}, OrderedDict())
        return worker

    def _indexed(self, medium: str | None, group_idx: int | None) -> bool:
        return medium in self._mediums and group_idx in (None, 0)

    def _store(self, worker_id: str, event: BlockStored) -> None:
        if not self._indexed(event.medium, event.group_idx):
            self._ignored += len(event.block_hashes)
            return
        worker = self._worker(worker_id)
        if worker.block_size != event.block_size:
            if worker.block_size is not None:
                self.purge(worker_id)  # a changed engine: nothing old can be trusted
                worker = self._worker(worker_id)
            worker.block_size = event.block_size
        if event.parent_block_hash is None:
            parent: bytes | None = root_key(event.lora_name)
        else:
            known = worker.by_hash.get(event.parent_block_hash)
            parent = None if known is None else known.key
        if parent is None:
            self._orphans += len(event.block_hashes)
            return
        extras = event.extra_keys
        for i, engine_hash in enumerate(event.block_hashes):
            parent = block_key(parent, event.block_tokens(i), extras[i] if extras else None)
            self._insert(worker_id, worker, parent, engine_hash)
        self._stored += len(event.block_hashes)

    def _insert(self, worker_id: str, worker: _Worker, key: bytes, engine_hash: BlockHash) -> None:
        old = worker.by_hash.get(engine_hash)
        if old is not None and old.key != key:
            self._forget(worker_id, worker, old)
        entry = worker.by_key.get(key)
        if entry is not None:  # stored again: now the newest
            if entry.engine_hash != engine_hash:
                worker.by_hash.pop(entry.engine_hash, None)
                entry.engine_hash = engine_hash
            worker.by_hash[engine_hash] = entry
            worker.by_key.move_to_end(key)
            self._order.move_to_end((worker_id, key))
            return
        entry = _Entry(key, engine_hash)
        worker.by_hash[engine_hash] = entry
        worker.by_key[key] = entry
        self._order[(worker_id, key)] = None
        self._owners.setdefault(key, set()).add(worker_id)
        while len(worker.by_key) > self.max_blocks_per_worker:
            self._evict(worker_id, worker, next(iter(worker.by_key.values())))
        while len(self._order) > self.max_blocks:
            victim_worker, victim_key = next(iter(self._order))
            victim = self._workers[victim_worker]
            self._evict(victim_worker, victim, victim.by_key[victim_key])

    def _evict(self, worker_id: str, worker: _Worker, entry: _Entry) -> None:
        self._forget(worker_id, worker, entry)
        self._evicted += 1

    def _forget(self, worker_id: str, worker: _Worker, entry: _Entry) -> None:
        worker.by_key.pop(entry.key, None)
        if worker.by_hash.get(entry.engine_hash) is entry:
            del worker.by_hash[entry.engine_hash]
        self._order.pop((worker_id, entry.key), None)
        self._drop_owner(worker_id, entry.key)

    def _drop_owner(self, worker_id: str, key: bytes) -> None:
        owners = self._owners.get(key)
        if owners is not None:
            owners.discard(worker_id)
            if not owners:
                del self._owners[key]

    def _remove(self, worker_id: str, event: BlockRemoved) -> None:
        if not self._indexed(event.medium, event.group_idx):
            self._ignored += len(event.block_hashes)
            return
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        for engine_hash in event.block_hashes:
            entry = worker.by_hash.get(engine_hash)
            if entry is not None:
                self._forget(worker_id, worker, entry)
                self._removed += 1

    # -- queries

    def match(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKey] | None = None,
        workers: Iterable[str] | None = None,
    ) -> dict[str, int]:
        """How many leading full blocks of ``token_ids`` each worker holds.

        Args:
            token_ids: the prompt's token ids, as the engine will see them.
            lora_name: the adapter the request names (blocks of other adapters
                never match).
            extra_keys: per-block extra keys, when the prompt has any (media
                ids, a cache salt) -- the engine puts them in its events.
            workers: the workers to answer for (default: every known one);
                a worker with no entries, or unknown, matches 0.

        Returns:
            ``{worker_id: matched blocks}`` for every worker asked about.
        """
        wanted = list(self._workers) if workers is None else list(workers)
        result = dict.fromkeys(wanted, 0)
        by_size: dict[int, list[str]] = {}
        for w in wanted:
            state = self._workers.get(w)
            if state is not None and state.block_size is not None and state.by_key:
                by_size.setdefault(state.block_size, []).append(w)
        for size, group in by_size.items():
            alive = set(group)
            parent = root_key(lora_name)
            for i in range(len(token_ids) // size):
                extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
                parent = block_key(parent, token_ids[i * size : (i + 1) * size], extra)
                alive &= self._owners.get(parent, set())
                if not alive:
                    break
                for w in alive:
                    result[w] = i + 1
        return result

    def block_size(self, worker_id: str) -> int | None:
        """The block size ``worker_id``'s events use (None before its first store)."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.block_size

    def blocks(self, worker_id: str) -> int:
        """How many entries ``worker_id`` holds."""
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.by_key)

    def engine_hashes(self, worker_id: str) -> frozenset[BlockHash]:
        """The engine's hashes of every block held for ``worker_id`` (tests compare them)."""
        worker = self._workers.get(worker_id)
        return frozenset() if worker is None else frozenset(worker.by_hash)

    def blocks_per_worker(self) -> Mapping[str, int]:
        """``{worker_id: entries}`` for every known worker."""
        return {w: len(state.by_key) for w, state in self._workers.items()}

    def statistics(self) -> IndexStatistics:
        """A snapshot of the counters."""
        return IndexStatistics(
            blocks=len(self._order),
            workers=len(self._workers),
            stored=self._stored,
            removed=self._removed,
            orphans=self._orphans,
            ignored=self._ignored,
            evicted=self._evicted,
            purges=self._purges,
        )
