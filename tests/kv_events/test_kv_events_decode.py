"""The KV event decoder: vLLM's array and map encodings, and every way bytes can be wrong."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_actors.errors import RemoteProtocolError
from epd_actors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    decode_batch,
    decode_message,
    decode_replay_frames,
)
from epd_actors.simulator.kv_events import encode_batch

SEQ7 = (7).to_bytes(8, "big")


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# What vLLM 0.26 published (the map encoding; a capture quoted in volcano-sh/kthena#1535).
MAP_CAPTURE = [
    1789095808.8378847,
    [
        {
            "type": "BlockStored",
            "block_hashes": [15760518052499183552],
            "parent_block_hash": None,
            "token_ids": list(range(151644, 151660)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ],
    0,
]

# The same in the array encoding of vLLM before PR #42892, with trailing defaults omitted.
ARRAY_CAPTURE = [
    1789095808.8378847,
    [
        ["BlockStored", [15760518052499183552], None, list(range(151644, 151660)), 16, None, "GPU"],
        ["BlockRemoved", [b"\x01" * 32], "GPU"],
        ["AllBlocksCleared"],
    ],
]


def test_map_encoded_capture_decodes_and_ignores_unknown_fields():
    batch = decode_batch(pack(MAP_CAPTURE))
    assert batch.data_parallel_rank == 0
    (event,) = batch.events
    assert event == BlockStored(
        block_hashes=(15760518052499183552,),
        parent_block_hash=None,
        token_ids=tuple(range(151644, 151660)),
        block_size=16,
        medium="GPU",
        extra_keys=(None,),
        group_idx=0,
    )


def test_array_encoded_batch_with_omitted_trailing_fields():
    batch = decode_batch(pack(ARRAY_CAPTURE))
    assert batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.lora_name is None
    assert stored.extra_keys is None
    assert removed == BlockRemoved(block_hashes=(b"\x01" * 32,), medium="GPU")
    assert cleared == AllBlocksCleared()


def test_a_map_encoded_batch_and_mixed_event_encodings():
    raw = {
        "ts": 1.0,
        "events": [["AllBlocksCleared"], {"type": "BlockRemoved", "block_hashes": [5]}],
        "data_parallel_rank": 2,
    }
    batch = decode_batch(pack(raw))
    assert batch.events == (AllBlocksCleared(), BlockRemoved((5,)))
    assert batch.data_parallel_rank == 2


def test_extra_keys_are_frozen_into_tuples():
    event = ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, None, "ad", [["img", 0], None]]
    (stored,) = decode_batch(pack([0.0, [event]])).events
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "ad"
    assert stored.extra_keys == (("img", 0), None)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_the_simulator_encoder_round_trips(encoding):
    events = (
        BlockStored((1, 2), 9, (1, 2, 3, 4), 2, None, "GPU", "lora-a", (("m", 1), None), 0),
        BlockStored((3,), None, (5, 6), 2, None, "GPU", None),
        BlockRemoved((1,), "GPU", None),
        AllBlocksCleared(),
    )
    batch = decode_batch(encode_batch(events, ts=3.5, encoding=encoding))
    assert batch.events == events
    assert batch.ts == 3.5


def test_the_array_encoding_matches_vllms_positions():
    raw = msgpack.unpackb(
        encode_batch(
            [BlockStored((1,), None, (7, 8), 2, None, "GPU", None)], ts=0.0, encoding="array"
        )
    )
    assert raw == [0.0, [["BlockStored", [1], None, [7, 8], 2, None, "GPU", None]], 0]
    raw = msgpack.unpackb(encode_batch([BlockRemoved((1,), "GPU")], ts=0.0, encoding="map"))
    assert raw[1] == [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]


def test_a_message_and_a_replay_frame():
    payload = pack(ARRAY_CAPTURE)
    message = decode_message([b"kv-events", SEQ7, payload])
    assert (message.topic, message.seq) == ("kv-events", 7)
    assert decode_replay_frames([b"", SEQ7, payload])[0] == 7
    assert decode_replay_frames([SEQ7, payload])[0] == 7
    assert decode_replay_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]) == (-1, None)


GOOD_STORED = ["BlockStored", [1], None, [1, 2], 2, None, "GPU"]

BAD_PAYLOADS = {
    "garbage": b"\xc1\xc1\xc1",
    "truncated": pack(ARRAY_CAPTURE)[:-5],
    "empty": b"",
    "extra bytes": pack(ARRAY_CAPTURE) + b"\x00",
    "2 GB array": b"\xdd\x7f\xff\xff\xff",
    "2 GB bin": b"\xc6\x7f\xff\xff\xff" + b"x" * 10,
    "4 GB str": b"\xdb\xff\xff\xff\xff",
    "not a batch": pack("hello"),
    "short batch": pack([1.0]),
    "ts not a number": pack(["x", []]),
    "ts infinite": pack([float("inf"), []]),
    "events not a list": pack([1.0, {"a": 1}]),
    "event not a list": pack([1.0, [7]]),
    "unknown tag": pack([1.0, [["BlockExploded", [1]]]]),
    "tag not a string": pack([1.0, [[1, [1]]]]),
    "map without type": pack([1.0, [{"block_hashes": [1]}]]),
    "missing field": pack([1.0, [["BlockStored", [1], None]]]),
    "hash of a wrong type": pack([1.0, [["BlockStored", ["h"], None, [1, 2], 2]]]),
    "tokens of a wrong type": pack([1.0, [["BlockStored", [1], None, ["a", "b"], 2]]]),
    "token count mismatch": pack([1.0, [["BlockStored", [1], None, [1, 2, 3], 2]]]),
    "zero block size": pack([1.0, [["BlockStored", [], None, [], 0]]]),
    "bool as int": pack([1.0, [["BlockStored", [1], None, [1, 2], True]]]),
    "medium not a string": pack([1.0, [[*GOOD_STORED[:6], 5]]]),
    "extra_keys count": pack([1.0, [[*GOOD_STORED, None, [None, None]]]]),
    "deep extra_keys": pack([1.0, [[*GOOD_STORED, None, [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]),
    "int map key": pack({1: 2}),
    "bad utf-8": b"\xa2\xff\xfe",
    "timestamp ext": pack([1.0, [["BlockRemoved", [msgpack.Timestamp(1)]]]]),
    "deep nesting": b"\x91" * 100_000,
}


@pytest.mark.parametrize("payload", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
def test_bad_payloads_raise_one_typed_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_message([b"t", SEQ7, payload])


def test_the_error_is_a_remote_protocol_error_and_the_size_limit_holds():
    assert issubclass(KVEventDecodeError, RemoteProtocolError)
    with pytest.raises(KVEventDecodeError, match="over the 10 limit"):
        decode_batch(pack(ARRAY_CAPTURE), max_payload_bytes=10)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"t", SEQ7],
        [b"t", SEQ7, b"", b""],
        [b"t", b"\x00\x01", pack(ARRAY_CAPTURE)],
        [b"\xff", SEQ7, pack(ARRAY_CAPTURE)],
        [b"t", (-3).to_bytes(8, "big", signed=True), pack(ARRAY_CAPTURE)],
    ],
    ids=["none", "two", "four", "short seq", "topic not utf-8", "negative seq"],
)
def test_bad_frames_raise_one_typed_error(frames):
    with pytest.raises(KVEventDecodeError):
        decode_message(frames)


@pytest.mark.parametrize(
    "frames", [[SEQ7], [b"x", b"y", b"z"], [(-2).to_bytes(8, "big", signed=True), b""]]
)
def test_bad_replay_frames_raise_one_typed_error(frames):
    with pytest.raises(KVEventDecodeError):
        decode_replay_frames(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_as_another_error(data):
    with contextlib.suppress(KVEventDecodeError):
        decode_message([b"t", SEQ7, data])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_truncation_of_a_valid_payload_is_a_typed_error(data):
    payload = encode_batch(
        [BlockStored((1, 2), None, (1, 2, 3, 4), 2, None, "GPU", None)],
        ts=1.0,
        encoding=data.draw(st.sampled_from(["array", "map"])),
    )
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload[:cut])
