"""vLLM's KV cache events: decode them, index them exactly, subscribe to them.

- :mod:`.decode`: sans-IO decoder of one ZMQ multipart message (or replay
  frame) into typed events; bad bytes raise :class:`KVEventDecodeError`.
- :mod:`.index`: per-worker block index keyed on hashes the router computes
  itself from the events' token ids, bounded in memory.
- :mod:`.feed`: sans-IO sequencing of one worker's stream: gaps, replay,
  restarts, and the worker's state (exact / degraded / fallback).
- :mod:`.subscriber`: one subscriber per worker over pyzmq (the optional
  ``kv-events`` extra), feeding the index through a bounded Trio channel.

docs/routing.md ("The KV-event index") is the narrative.
"""

from __future__ import annotations

from .decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventDecodeError,
    KVEventMessage,
    decode_batch,
    decode_message,
    decode_replay_frames,
)
from .feed import FeedState
from .index import KVBlockIndex, block_keys

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "FeedState",
    "KVBlockIndex",
    "KVEvent",
    "KVEventDecodeError",
    "KVEventMessage",
    "block_keys",
    "decode_batch",
    "decode_message",
    "decode_replay_frames",
]
