"""The stores the simulator's engines share: an encoder cache and a KV-handle table.

Theory of operation
-------------------
Real EPD serving moves two kinds of state between stages: encoder outputs (E
writes them, keyed by the media item's content hash; P/PD read them) and KV
caches (P produces them and names them in ``kv_transfer_params``; exactly one D
pulls them).  The simulator keeps the *bookkeeping* of both, not the tensors:

* an :class:`EncoderCacheStore` maps a content hash to an :class:`EncoderCacheEntry`;
* a :class:`KVStore` maps a random handle to a :class:`KVEntry` and supports an
  atomic, at-most-once :meth:`KVStore.take` (D's consume) and
  :meth:`KVStore.discard` (release, abort, expiry).

Two implementations of each:

* in memory: one object shared by several engines in one process, like the GPUs
  of one host (tests, the embedded demo);
* in a directory: ``<dir>/ec/<content_hash>`` and ``<dir>/kv/<handle>`` files,
  like vLLM's shared-storage connectors, so worker *processes* on one machine
  share them.  Writes go to a dot-prefixed temporary name and are renamed into
  place; a consume renames the file away first, so two consumers racing for one
  handle cannot both win.  Keys are checked against :data:`SAFE_KEY` before they
  become file names (no ``/``, no ``.``, no traversal).

Expiry deadlines are Trio times of the producing ``trio.run``; each
:class:`KVEntry` records a token of that run (``clock``) so a consumer only
compares deadlines it can interpret.

File I/O here is synchronous on purpose: an entry is ~200 bytes; a write plus
rename measured ~100 us on ext4 and a whole create/peek/take cycle ~145 us, while
a ``trio.to_thread.run_sync`` round trip alone measured ~80 us.  A thread hop
would roughly double each call's latency to spare the event loop a tenth of a
millisecond, well below the simulated stage latencies.  Do not point a directory
store at a network file system, where that measurement does not hold.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Protocol, TypeVar

_T = TypeVar("_T")

SAFE_KEY: Final = re.compile(r"[0-9a-z][0-9a-z_-]{0,127}")
"""Content hashes and KV handles must match this (lowercase, no dots or slashes)."""

# Entries an in-memory encoder cache keeps before evicting the least recently used
# one (entries, ~200 bytes each).  A real encoder cache is bounded too; eviction
# shows up as a strict-mode refusal or a recompute, exactly like the real thing.
DEFAULT_EC_CAPACITY: Final = 65_536


def is_safe_key(key: str) -> bool:
    """True when ``key`` may be used as a content hash or KV handle (and file name)."""
    return SAFE_KEY.fullmatch(key) is not None


def _check_key(key: str) -> str:
    if not is_safe_key(key):
        raise ValueError(f"unsafe store key {key[:80]!r}: must match {SAFE_KEY.pattern}")
    return key


@dataclass(frozen=True, slots=True)
class EncoderCacheEntry:
    """What E leaves behind for one media item (the embeddings themselves are not kept)."""

    content_hash: str
    producer: str
    modality: str
    num_bytes: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class KVEntry:
    """A prefilled KV cache waiting for its decoder.

    Attributes:
        handle: the random name P put in ``kv_transfer_params``.
        producer: worker id of the prefill engine.
        request_id: the request P prefilled (abort frees by this id).
        prompt_digest: digest of the prompt and media; D refuses a mismatch.
        prompt_tokens: prompt length, which D reports as usage.
        expires_at: ``trio.current_time()`` deadline in the producer's run.
        clock: token of the producer's ``trio.run``; deadlines compare only within one.
    """

    handle: str
    producer: str
    request_id: str
    prompt_digest: str
    prompt_tokens: int
    expires_at: float
    clock: str


class EncoderCacheStore(Protocol):
    """Encoder-cache entries keyed by content hash (safe keys only)."""

    def put(self, entry: EncoderCacheEntry) -> None:
        """Store (or overwrite) the entry for ``entry.content_hash``."""
        ...

    def get(self, content_hash: str) -> EncoderCacheEntry | None:
        """The entry for ``content_hash``, or None."""
        ...

    def __len__(self) -> int: ...


class KVStore(Protocol):
    """KV handles waiting for a decoder; every removal is atomic and happens once."""

    def create(self, entry: KVEntry) -> None:
        """Publish ``entry`` under ``entry.handle``."""
        ...

    def peek(self, handle: str) -> KVEntry | None:
        """The entry, without consuming it; None when absent."""
        ...

    def take(self, handle: str) -> KVEntry | None:
        """Consume the entry: exactly one caller gets it, every other gets None."""
        ...

    def discard(self, handle: str) -> bool:
        """Remove the entry; True if this call removed it, False if it was gone."""
        ...

    def contains(self, handle: str) -> bool:
        """Whether the handle is still waiting to be consumed."""
        ...

    def __len__(self) -> int: ...


# ---------------------------------------------------------------- in memory


class MemoryEncoderCacheStore:
    """An LRU-bounded encoder cache shared by the engines of one process."""

    def __init__(self, capacity: int = DEFAULT_EC_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[str, EncoderCacheEntry] = OrderedDict()

    def put(self, entry: EncoderCacheEntry) -> None:
        key = _check_key(entry.content_hash)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, content_hash: str) -> EncoderCacheEntry | None:
        entry = self._entries.get(_check_key(content_hash))
        if entry is not None:
            self._entries.move_to_end(content_hash)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"MemoryEncoderCacheStore(entries={len(self)}, capacity={self.capacity})"


class MemoryKVStore:
    """KV handles shared by the engines of one process.

    Not bounded by a count: every handle is owned by a producer engine that
    discards it when its TTL passes, so the table holds at most a TTL's worth.
    """

    def __init__(self) -> None:
        self._entries: dict[str, KVEntry] = {}

    def create(self, entry: KVEntry) -> None:
        key = _check_key(entry.handle)
        if key in self._entries:
            raise ValueError(f"KV handle {key} already exists")
        self._entries[key] = entry

    def peek(self, handle: str) -> KVEntry | None:
        return self._entries.get(_check_key(handle))

    def take(self, handle: str) -> KVEntry | None:
        return self._entries.pop(_check_key(handle), None)

    def discard(self, handle: str) -> bool:
        return self._entries.pop(_check_key(handle), None) is not None

    def contains(self, handle: str) -> bool:
        return _check_key(handle) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"MemoryKVStore(handles={len(self)})"


# ---------------------------------------------------------------- in a directory


def _write_atomically(directory: Path, key: str, payload: dict[str, object]) -> None:
    tmp = directory / f".tmp-{secrets.token_hex(8)}"
    try:
        tmp.write_bytes(json.dumps(payload).encode())
        tmp.replace(directory / key)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, object] | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    loaded = json.loads(data)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path.name}: store file does not hold an object")
    return loaded


def _count_entries(directory: Path) -> int:
    with os.scandir(directory) as it:
        return sum(1 for item in it if not item.name.startswith("."))


def _field(raw: dict[str, object], name: str, kind: type[_T]) -> _T:
    value = raw.get(name)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ValueError(f"store entry field {name!r} is missing or not {kind.__name__}")
    return value


def _ec_entry(raw: dict[str, object] | None) -> EncoderCacheEntry | None:
    """Rebuild an entry, checking each field's type (a file may be stale or foreign)."""
    if raw is None:
        return None
    return EncoderCacheEntry(
        content_hash=_field(raw, "content_hash", str),
        producer=_field(raw, "producer", str),
        modality=_field(raw, "modality", str),
        num_bytes=_field(raw, "num_bytes", int),
        num_tokens=_field(raw, "num_tokens", int),
    )


def _kv_entry(raw: dict[str, object] | None) -> KVEntry | None:
    if raw is None:
        return None
    return KVEntry(
        handle=_field(raw, "handle", str),
        producer=_field(raw, "producer", str),
        request_id=_field(raw, "request_id", str),
        prompt_digest=_field(raw, "prompt_digest", str),
        prompt_tokens=_field(raw, "prompt_tokens", int),
        expires_at=_field(raw, "expires_at", float),
        clock=_field(raw, "clock", str),
    )


class DirectoryEncoderCacheStore:
    """Encoder-cache entries as ``<root>/<content_hash>`` files (never evicted).

    Like vLLM's shared-storage encoder-cache connector, nothing cleans the
    directory up; remove it between runs.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, entry: EncoderCacheEntry) -> None:
        _write_atomically(self.root, _check_key(entry.content_hash), asdict(entry))

    def get(self, content_hash: str) -> EncoderCacheEntry | None:
        return _ec_entry(_read(self.root / _check_key(content_hash)))

    def __len__(self) -> int:
        return _count_entries(self.root)

    def __repr__(self) -> str:
        return f"DirectoryEncoderCacheStore({str(self.root)!r})"


class DirectoryKVStore:
    """KV handles as ``<root>/<handle>`` files; consumes are atomic renames."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def create(self, entry: KVEntry) -> None:
        _write_atomically(self.root, _check_key(entry.handle), asdict(entry))

    def peek(self, handle: str) -> KVEntry | None:
        return _kv_entry(_read(self.root / _check_key(handle)))

    def take(self, handle: str) -> KVEntry | None:
        source = self.root / _check_key(handle)
        claimed = self.root / f".taken-{handle}-{secrets.token_hex(4)}"
        try:
            source.rename(claimed)
        except FileNotFoundError:
            return None
        try:
            return _kv_entry(_read(claimed))
        finally:
            claimed.unlink(missing_ok=True)

    def discard(self, handle: str) -> bool:
        try:
            (self.root / _check_key(handle)).unlink()
        except FileNotFoundError:
            return False
        return True

    def contains(self, handle: str) -> bool:
        return (self.root / _check_key(handle)).exists()

    def __len__(self) -> int:
        return _count_entries(self.root)

    def __repr__(self) -> str:
        return f"DirectoryKVStore({str(self.root)!r})"


# ---------------------------------------------------------------- factory


@dataclass(frozen=True, slots=True)
class SimStores:
    """The pair of stores a group of simulated engines shares."""

    ec: EncoderCacheStore
    kv: KVStore


def create_sim_stores(
    directory: str | os.PathLike[str] | None = None, *, ec_capacity: int = DEFAULT_EC_CAPACITY
) -> SimStores:
    """Stores for simulated engines: in memory, or under ``directory``.

    Args:
        directory: None for in-memory stores (share the returned object between
            the engines of one process); a path for ``<directory>/ec`` and
            ``<directory>/kv`` (give every worker process the same path).
        ec_capacity: entries the in-memory encoder cache keeps (LRU); ignored for
            directory stores.

    Returns:
        A :class:`SimStores` pair.
    """
    if directory is None:
        return SimStores(MemoryEncoderCacheStore(ec_capacity), MemoryKVStore())
    root = Path(directory)
    return SimStores(DirectoryEncoderCacheStore(root / "ec"), DirectoryKVStore(root / "kv"))
