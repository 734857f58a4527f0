"""Cut a run of KV events into pieces of at most N blocks, each applied like the whole.

Theory of operation
-------------------
The subscriber applies events to the index on the Trio thread; to hand the
loop back between pieces it needs pieces of bounded cost, and the cost of
an event is its blocks.  :func:`split_events` walks the events in order and
yields lists holding at most ``max_blocks`` blocks (an ``AllBlocksCleared``
weighs one).  An event larger than that is cut:

- a ``BlockRemoved`` into runs of its hashes;
- a ``BlockStored`` into runs of its blocks, each naming the last block of
  the run before as its parent, with the matching slices of ``token_ids``
  and ``extra_keys``.  Applied in order, the pieces insert the same keys as
  the whole event: the index finds each piece's parent by that hash, which
  the piece before just inserted as the newest entry.  (Only if the index's
  bounds evict that newest entry between two pieces -- other workers
  storing ``max_blocks`` blocks in between -- are the rest orphans, as they
  would be after any eviction of their parent.)

Pure functions; no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .decode import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from .decode import KVEvent

__all__ = ["event_blocks", "split_events"]


def event_blocks(event: KVEvent) -> int:
    """The blocks ``event`` touches (1 for ``AllBlocksCleared``)."""
    if isinstance(event, AllBlocksCleared):
        return 1
    return max(1, len(event.block_hashes))


def _cut(event: KVEvent, max_blocks: int) -> Iterator[KVEvent]:
    """``event`` as pieces of at most ``max_blocks`` blocks, in order."""
    if isinstance(event, BlockRemoved):
        for i in range(0, len(event.block_hashes), max_blocks):
            yield dataclasses.replace(event, block_hashes=event.block_hashes[i : i + max_blocks])
        return
    if not isinstance(event, BlockStored):
        yield event
        return
    bs = event.block_size
    parent = event.parent_block_hash
    for i in range(0, len(event.block_hashes), max_blocks):
        hashes = event.block_hashes[i : i + max_blocks]
        extras = event.extra_keys
        yield dataclasses.replace(
            event,
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=event.token_ids[i * bs : (i + len(hashes)) * bs],
            extra_keys=None if extras is None else extras[i : i + len(hashes)],
        )
        parent = hashes[-1]


def split_events(events: Iterable[KVEvent], max_blocks: int) -> Iterator[list[KVEvent]]:
    """``events`` in order, as lists of at most ``max_blocks`` (>= 1) blocks each."""
    limit = max(1, max_blocks)
    piece: list[KVEvent] = []
    weight = 0
    for event in events:
        parts = _cut(event, limit) if event_blocks(event) > limit else (event,)
        for part in parts:
            blocks = event_blocks(part)
            if piece and weight + blocks > limit:
                yield piece
                piece, weight = [], 0
            piece.append(part)
            weight += blocks
    if piece:
        yield piece
