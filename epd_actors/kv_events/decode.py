"""Sans-IO decoder of vLLM's KV cache events: ZMQ multipart frames -> typed events.

The wire format (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``)
---------------------------------------------------------------------------
A PUB message is three frames: ``[topic, seq, payload]`` -- the topic as
published (UTF-8, possibly empty), the batch's sequence number as 8 bytes
big-endian (counting from 0 per publisher, so a restarted engine starts at 0
again), and a msgpack ``EventBatch``.  A replay answer (ROUTER -> DEALER) is
``[seq, payload]`` per batch, ending with seq -1 (signed) and an empty payload.

``EventBatch`` is ``[ts, events, data_parallel_rank]`` (msgspec
``array_like``; a trailing field left at its default may be omitted), or the
same three fields as a map.  Each event is a msgspec tagged struct, in one of
two encodings:

- **array** (vLLM before PR #42892): ``[tag, field, field, ...]`` in field
  declaration order, trailing defaults omitted:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]``, ``["BlockRemoved", block_hashes, medium,
  group_idx]``, ``["AllBlocksCleared"]``;
- **map** (vLLM after PR #42892): ``{"type": tag, "block_hashes": ..., ...}``,
  fields by name in any order, defaults possibly omitted.

Both are decoded, in any mix within one batch.  Fields this module does not
know (a later vLLM's additions) are ignored; fields it needs and does not find,
or finds with the wrong type, are an error.  Block hashes are ``int`` (older
vLLM, 64-bit) or ``bytes`` (newer vLLM); both are kept as they came, since the
index only uses them to name blocks of one engine (it computes its own keys).

Errors
------
Every way received bytes can be wrong -- garbage, a truncated frame, the wrong
number of frames, a wrong type, an unknown event tag, a declared length larger
than the bytes that follow (msgpack checks each declared length against the
buffer before allocating), a payload over ``max_payload_bytes`` -- raises one
:class:`KVEventDecodeError`.  Nothing else escapes, so one bad message never
stops a subscriber.  Unknown tags are errors rather than skipped: an event the
index cannot apply makes it inexact, and the feed says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeAlias

import msgpack

from ..errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "END_OF_REPLAY",
    "MAX_PAYLOAD_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExtraKey",
    "KVEvent",
    "KVEventDecodeError",
    "KVEventMessage",
    "decode_batch",
    "decode_message",
    "decode_replay_frames",
    "decode_seq",
]

MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024
"""The largest payload decoded by default (a batch of 10k 16-token blocks is ~1.5 MiB)."""

END_OF_REPLAY: Final = -1
"""The sequence number of the frame that ends a replay answer."""

_MAX_DEPTH: Final = 16
"""How deep an extra key may nest (they are flat tuples in vLLM)."""

BlockHash: TypeAlias = int | bytes
"""An engine's block hash: an int (older vLLM) or bytes (newer vLLM)."""

ExtraKey: TypeAlias = tuple[object, ...] | None
"""One block's extra keys (media ids, LoRA name, cache salt...), lists frozen into tuples."""


class KVEventDecodeError(RemoteProtocolError):
    """A KV event message (or replay frame) that is not what vLLM publishes."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached: ``block_hashes[i]`` holds ``token_ids[i*bs:(i+1)*bs]``.

    ``parent_block_hash`` names the block before the first one (None at the
    start of a sequence); each later block's parent is the one before it.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[ExtraKey, ...] | None = None
    group_idx: int | None = None

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """The token ids of block ``i``."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: its events in order."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class KVEventMessage:
    """One PUB message: topic, sequence number, batch."""

    topic: str
    seq: int
    batch: EventBatch


# ---------------------------------------------------------------- field checks


def _fail(message: str) -> KVEventDecodeError:
    return KVEventDecodeError(f"KV event: {message}")


def _int(value: object, what: str) -> int:
    if type(value) is not int:
        raise _fail(f"{what} must be an integer, got {type(value).__name__}")
    return value


def _opt_int(value: object, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _opt_str(value: object, what: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _fail(f"{what} must be a string or nil, got {type(value).__name__}")


def _hash(value: object, what: str) -> BlockHash:
    if type(value) is int or type(value) is bytes:
        return value
    raise _fail(f"{what} must be an integer or bytes, got {type(value).__name__}")


def _list(value: object, what: str) -> list[object]:
    if type(value) is not list:
        raise _fail(f"{what} must be an array, got {type(value).__name__}")
    return value


def _hashes(value: object, what: str) -> tuple[BlockHash, ...]:
    return tuple(_hash(h, f"{what}[]") for h in _list(value, what))


def _tokens(value: object) -> tuple[int, ...]:
    items = _list(value, "token_ids")
    if not all(type(t) is int for t in items):
        raise _fail("token_ids must be integers")
    return tuple(items)  # type: ignore[arg-type]


def _freeze(value: object, depth: int = 0) -> object:
    if depth > _MAX_DEPTH:
        raise _fail(f"extra_keys nest deeper than {_MAX_DEPTH}")
    if type(value) is list:
        return tuple(_freeze(v, depth + 1) for v in value)
    if type(value) is dict:
        return tuple((k, _freeze(v, depth + 1)) for k, v in value.items())
    if value is None or type(value) in (int, str, bytes, float, bool):
        return value
    raise _fail(f"extra_keys hold an unsupported {type(value).__name__}")


def _extra_keys(value: object, blocks: int) -> tuple[ExtraKey, ...] | None:
    if value is None:
        return None
    items = _list(value, "extra_keys")
    if len(items) != blocks:
        raise _fail(f"extra_keys has {len(items)} entries for {blocks} blocks")
    out: list[ExtraKey] = []
    for item in items:
        if item is None:
            out.append(None)
        else:
            out.append(_freeze(_list(item, "extra_keys[]")))  # type: ignore[arg-type]
    return tuple(out)


# ---------------------------------------------------------------- events

_STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_STORED_REQUIRED: Final = 4  # block_hashes .. block_size, in every vLLM version
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")


def _stored(f: Mapping[str, object]) -> BlockStored:
    for name in _STORED_FIELDS[:_STORED_REQUIRED]:
        if name not in f:
            raise _fail(f"BlockStored lacks {name}")
    hashes = _hashes(f["block_hashes"], "block_hashes")
    parent = f["parent_block_hash"]
    tokens = _tokens(f["token_ids"])
    size = _int(f["block_size"], "block_size")
    if size <= 0:
        raise _fail(f"block_size must be positive, got {size}")
    if len(tokens) != size * len(hashes):
        raise _fail(f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tokens,
        block_size=size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(f.get("extra_keys"), len(hashes)),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _removed(f: Mapping[str, object]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise _fail("BlockRemoved lacks block_hashes")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], "block_hashes"),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _cleared(f: Mapping[str, object]) -> AllBlocksCleared:
    return AllBlocksCleared()


_Builder: TypeAlias = "Callable[[Mapping[str, object]], KVEvent]"

_EVENTS: Final[dict[str, tuple[tuple[str, ...], _Builder]]] = {
    "BlockStored": (_STORED_FIELDS, _stored),
    "BlockRemoved": (_REMOVED_FIELDS, _removed),
    "AllBlocksCleared": ((), _cleared),
}
"""tag -> (array field order, builder from named fields)."""


def _event(raw: object) -> KVEvent:
    if type(raw) is list:
        if not raw or type(raw[0]) is not str:
            raise _fail("an array-encoded event must start with its tag")
        tag, values = raw[0], raw[1:]
        spec = _EVENTS.get(tag)
        if spec is None:
            raise _fail(f"unknown event tag {tag[:64]!r}")
        order, build = spec
        return build(dict(zip(order, values, strict=False)))
    if type(raw) is dict:
        name = raw.get("type")
        if type(name) is not str:
            raise _fail("a map-encoded event needs a string 'type'")
        spec = _EVENTS.get(name)
        if spec is None:
            raise _fail(f"unknown event tag {name[:64]!r}")
        return spec[1](raw)
    raise _fail(f"an event must be an array or a map, got {type(raw).__name__}")


# ---------------------------------------------------------------- batches and frames


def _unpack(payload: bytes, max_payload_bytes: int) -> object:
    if len(payload) > max_payload_bytes:
        raise _fail(f"payload of {len(payload)} bytes is over the {max_payload_bytes} limit")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # msgpack's ExtraData, FormatError, StackError, invalid UTF-8 and
        # "N exceeds max_array_len" (a declared length past the buffer) are all ValueError.
        raise _fail(f"payload is not msgpack: {str(e)[:120]}") from None


def decode_batch(payload: bytes, *, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> EventBatch:
    """Decode one msgpack ``EventBatch`` (array- or map-encoded, events of either encoding).

    Raises:
        KVEventDecodeError: anything that is not a valid batch.
    """
    raw = _unpack(bytes(payload), max_payload_bytes)
    if type(raw) is list:
        if len(raw) < 2:
            raise _fail(f"a batch array needs ts and events, got {len(raw)} items")
        fields: Mapping[str, object] = dict(
            zip(("ts", "events", "data_parallel_rank"), raw, strict=False)
        )
    elif type(raw) is dict:
        fields = raw
        if "ts" not in fields or "events" not in fields:
            raise _fail("a batch map needs ts and events")
    else:
        raise _fail(f"a batch must be an array or a map, got {type(raw).__name__}")
    ts = fields["ts"]
    if type(ts) not in (int, float) or not math.isfinite(ts):  # type: ignore[arg-type]
        raise _fail("ts must be a finite number")
    events = tuple(_event(e) for e in _list(fields["events"], "events"))
    rank = _opt_int(fields.get("data_parallel_rank"), "data_parallel_rank")
    return EventBatch(float(ts), events, rank)  # type: ignore[arg-type]


def decode_seq(frame: bytes) -> int:
    """An 8-byte big-endian signed sequence number.

    Raises:
        KVEventDecodeError: the frame is not 8 bytes.
    """
    if len(frame) != 8:
        raise _fail(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_message(
    frames: Sequence[bytes], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> KVEventMessage:
    """Decode one PUB multipart message ``[topic, seq, payload]``.

    Raises:
        KVEventDecodeError: wrong frame count, a bad topic, sequence or payload;
            a negative sequence number.
    """
    if len(frames) != 3:
        raise _fail(f"a message is 3 frames (topic, seq, payload), got {len(frames)}")
    topic_frame, seq_frame, payload = frames
    try:
        topic = bytes(topic_frame).decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("the topic is not UTF-8") from None
    seq = decode_seq(bytes(seq_frame))
    if seq < 0:
        raise _fail(f"a published sequence number is >= 0, got {seq}")
    return KVEventMessage(topic, seq, decode_batch(payload, max_payload_bytes=max_payload_bytes))


def decode_replay_frames(
    frames: Sequence[bytes], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> tuple[int, EventBatch | None]:
    """Decode one replay answer ``[seq, payload]``: ``(seq, batch)``, or ``(-1, None)`` at the end.

    A DEALER receives the frames the ROUTER sent after the identity, which
    vLLM follows with an empty delimiter frame; a leading empty frame is skipped.

    Raises:
        KVEventDecodeError: wrong frame count, bad sequence or payload.
    """
    parts = list(frames)
    if len(parts) == 3 and len(parts[0]) == 0:
        parts = parts[1:]
    if len(parts) != 2:
        raise _fail(f"a replay frame is (seq, payload), got {len(parts)} frames")
    seq = decode_seq(bytes(parts[0]))
    if seq == END_OF_REPLAY:
        return END_OF_REPLAY, None
    if seq < 0:
        raise _fail(f"a replayed sequence number is >= 0, got {seq}")
    return seq, decode_batch(parts[1], max_payload_bytes=max_payload_bytes)
