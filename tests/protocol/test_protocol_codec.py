"""Sans-IO framing: feeding patterns, EOF, truncation, oversized frames, fuzzing."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_actors.errors import FrameTooLarge, RemoteProtocolError
from epd_actors.protocol import MESSAGE_TYPES, FrameDecoder, Message, Ping, encode
from epd_actors.protocol.codec import HEADER
from tests.wire_strategies import (
    FUZZ_SETTINGS,
    SAMPLE_MESSAGES,
    WIRE_SETTINGS,
    messages,
    opaque_values,
    texts,
)

PING = Ping(nonce=1)
PING_FRAME = encode(PING)
SMALL_LIMIT = 256
message_lists = st.lists(messages, min_size=1, max_size=5)


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def encode_all(items: list[Message]) -> bytes:
    return b"".join(encode(m) for m in items)


def drain(decoder: FrameDecoder) -> list[Message]:
    """Every message ready now; a protocol error here fails the test."""
    out: list[Message] = []
    while (message := decoder.next_message()) is not None:
        out.append(message)
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (any order, duplicates allowed)."""
    points = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


def feed_in_chunks(decoder: FrameDecoder, chunks: list[bytes]) -> list[Message]:
    out: list[Message] = []
    for chunk in chunks:
        if chunk:
            decoder.feed(chunk)
        out.extend(drain(decoder))
    return out


class Outcome:
    """What a stream of arbitrary bytes did to a decoder."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.errors: list[RemoteProtocolError] = []


def pump(decoder: FrameDecoder, chunks: list[bytes]) -> Outcome:
    """Feed chunks then EOF, taking messages and protocol errors as they come.

    Anything but a ``RemoteProtocolError`` propagates and fails the test; so
    does a decoder that neither progresses nor settles.
    """
    outcome = Outcome()

    def take_all() -> None:
        for _ in range(100_000):
            try:
                message = decoder.next_message()
            except RemoteProtocolError as exc:
                outcome.errors.append(exc)
                continue
            if message is None:
                return
            outcome.messages.append(message)
        raise AssertionError("decoder did not settle")

    for chunk in chunks:
        if chunk:
            decoder.feed(chunk)
        take_all()
    decoder.feed(b"")
    take_all()
    assert decoder.at_eof
    assert decoder.buffered_bytes == 0
    for message in outcome.messages:
        assert isinstance(message, MESSAGE_TYPES)
        # Whatever the decoder accepted, this side can send on unchanged.
        assert encode(message) is not None
    return outcome


# ---------------------------------------------------------------- feeding patterns


@WIRE_SETTINGS
@given(items=message_lists)
def test_whole_stream_in_one_feed(items: list[Message]) -> None:
    decoder = FrameDecoder()
    assert decoder.feed_all(encode_all(items)) == items
    assert decoder.buffered_bytes == 0


@WIRE_SETTINGS
@given(items=message_lists)
def test_byte_at_a_time(items: list[Message]) -> None:
    data = encode_all(items)
    boundaries = list(itertools.accumulate(len(encode(m)) for m in items))
    decoder = FrameDecoder()
    out: list[Message] = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        out.extend(drain(decoder))
        complete = sum(1 for b in boundaries if b <= i + 1)
        assert len(out) == complete
        assert decoder.buffered_bytes == i + 1 - (boundaries[complete - 1] if complete else 0)
    assert out == items


@WIRE_SETTINGS
@given(items=message_lists, cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_random_chunk_splits(items: list[Message], cuts: list[int]) -> None:
    decoder = FrameDecoder()
    assert feed_in_chunks(decoder, split(encode_all(items), cuts)) == items
    decoder.feed(b"")
    assert decoder.at_eof


@WIRE_SETTINGS
@given(items=message_lists, last=messages, data=st.data())
def test_back_to_back_frames_with_trailing_partial(
    items: list[Message], last: Message, data: st.DataObject
) -> None:
    tail = encode(last)
    cut = data.draw(st.integers(min_value=1, max_value=len(tail) - 1))
    decoder = FrameDecoder()
    assert decoder.feed_all(encode_all(items) + tail[:cut]) == items
    assert decoder.buffered_bytes == cut
    assert decoder.next_message() is None
    assert decoder.feed_all(tail[cut:]) == [last]
    assert decoder.buffered_bytes == 0


def test_every_pair_of_messages_back_to_back() -> None:
    for first, second in itertools.product(SAMPLE_MESSAGES, repeat=2):
        a, b = encode(first), encode(second)
        stream = a + b
        # Cut inside the first header, at the seam, inside the second header,
        # and one byte before the end.
        for cut in (2, len(a), len(a) + 3, len(stream) - 1):
            decoder = FrameDecoder()
            got = decoder.feed_all(stream[:cut]) + decoder.feed_all(stream[cut:])
            assert got == [first, second], (first, second, cut)


@pytest.mark.parametrize("message", SAMPLE_MESSAGES, ids=lambda m: type(m).__name__)
def test_each_sample_byte_at_a_time(message: Message) -> None:
    wire = encode(message)
    decoder = FrameDecoder()
    for i in range(len(wire) - 1):
        decoder.feed(wire[i : i + 1])
        assert decoder.next_message() is None
    decoder.feed(wire[-1:])
    assert decoder.next_message() == message
    assert decoder.next_message() is None


def test_feed_accepts_bytearray_and_memoryview() -> None:
    decoder = FrameDecoder()
    decoder.feed(bytearray(PING_FRAME[:3]))
    decoder.feed(memoryview(PING_FRAME)[3:])
    assert decoder.next_message() == PING


# ---------------------------------------------------------------- EOF and truncation


def test_eof_on_an_empty_stream() -> None:
    decoder = FrameDecoder()
    assert not decoder.at_eof
    assert decoder.next_message() is None
    decoder.feed(b"")
    assert decoder.at_eof
    assert decoder.next_message() is None


def test_clean_eof_after_whole_frames() -> None:
    decoder = FrameDecoder()
    decoder.feed(PING_FRAME * 2)
    assert not decoder.at_eof
    decoder.feed(b"")
    assert not decoder.at_eof  # two frames are still waiting
    assert drain(decoder) == [PING, PING]
    assert decoder.at_eof
    assert decoder.next_message() is None


@WIRE_SETTINGS
@given(message=messages, data=st.data())
def test_partial_frame_then_eof_is_an_error(message: Message, data: st.DataObject) -> None:
    wire = encode(message)
    cut = data.draw(st.integers(min_value=1, max_value=len(wire) - 1))
    decoder = FrameDecoder()
    decoder.feed(PING_FRAME + wire[:cut])
    assert decoder.next_message() == PING
    assert decoder.next_message() is None
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError, match="closed in the middle of a frame") as info:
        decoder.next_message()
    assert not isinstance(info.value, FrameTooLarge)
    assert decoder.at_eof
    assert decoder.buffered_bytes == 0
    assert decoder.next_message() is None


def test_data_after_eof_is_an_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(PING_FRAME)
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError, match="after EOF"):
        decoder.feed(PING_FRAME)
    decoder.feed(b"")  # a repeated EOF is harmless
    # The frame that arrived before EOF is still delivered, once.
    assert drain(decoder) == [PING]
    assert decoder.at_eof


# ---------------------------------------------------------------- oversized frames


def test_oversized_header_is_rejected_before_any_body() -> None:
    decoder = FrameDecoder(max_frame_bytes=SMALL_LIMIT)
    decoder.feed(HEADER.pack(SMALL_LIMIT + 1)[:2])
    assert decoder.next_message() is None
    decoder.feed(HEADER.pack(SMALL_LIMIT + 1)[2:])
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_message()
    assert isinstance(info.value, RemoteProtocolError)
    assert (info.value.size, info.value.limit) == (SMALL_LIMIT + 1, SMALL_LIMIT)
    assert decoder.buffered_bytes == 0
    # The body streams in and is dropped as it comes, never buffered.
    body = bytes(range(256)) + b"\x01"
    for i in range(0, len(body), 10):
        decoder.feed(body[i : i + 10])
        assert decoder.next_message() is None
        assert decoder.buffered_bytes == 0
    # The decoder is usable again for the next frame.
    decoder.feed(PING_FRAME)
    assert decoder.next_message() == PING
    decoder.feed(b"")
    assert decoder.at_eof


def test_huge_announced_length_with_the_default_limit() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"\xff\xff\xff\xff")
    with pytest.raises(FrameTooLarge, match="4294967295 bytes"):
        decoder.next_message()
    assert decoder.buffered_bytes == 0


def test_oversized_body_and_next_frame_in_one_feed() -> None:
    decoder = FrameDecoder(max_frame_bytes=SMALL_LIMIT)
    decoder.feed(frame(bytes(SMALL_LIMIT + 50)) + PING_FRAME)
    with pytest.raises(FrameTooLarge):
        decoder.next_message()
    assert decoder.next_message() == PING


def test_oversized_body_split_across_the_next_frame() -> None:
    decoder = FrameDecoder(max_frame_bytes=SMALL_LIMIT)
    stream = frame(bytes(SMALL_LIMIT + 50)) + PING_FRAME
    decoder.feed(stream[:100])
    with pytest.raises(FrameTooLarge):
        decoder.next_message()
    decoder.feed(stream[100 : len(stream) - 3])
    assert decoder.next_message() is None
    assert decoder.buffered_bytes == len(PING_FRAME) - 3
    decoder.feed(stream[-3:])
    assert decoder.next_message() == PING


def test_frame_exactly_at_the_limit_is_accepted() -> None:
    body_size = len(PING_FRAME) - HEADER.size
    decoder = FrameDecoder(max_frame_bytes=body_size)
    decoder.feed(PING_FRAME)
    assert decoder.next_message() == PING


def test_eof_while_skipping_an_oversized_body() -> None:
    decoder = FrameDecoder(max_frame_bytes=SMALL_LIMIT)
    decoder.feed(frame(bytes(SMALL_LIMIT + 1))[:20])
    with pytest.raises(FrameTooLarge):
        decoder.next_message()
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError, match="closed in the middle of a frame"):
        decoder.next_message()
    assert decoder.at_eof


@WIRE_SETTINGS
@given(
    before=st.lists(messages, max_size=2),
    oversize=st.integers(min_value=SMALL_LIMIT + 1, max_value=4 * SMALL_LIMIT),
    after=message_lists,
    cuts=st.lists(st.integers(min_value=0), max_size=10),
)
def test_oversized_frame_in_a_stream_is_skipped(
    before: list[Message], oversize: int, after: list[Message], cuts: list[int]
) -> None:
    # A big limit for the honest frames would hide nothing: keep them under it.
    small = [m for m in before + after if len(encode(m)) <= SMALL_LIMIT]
    before = [m for m in before if m in small]
    after = [m for m in after if m in small]
    stream = encode_all(before) + frame(bytes(oversize)) + encode_all(after)
    chunks = split(stream, cuts)
    decoder = FrameDecoder(max_frame_bytes=SMALL_LIMIT)
    outcome = pump(decoder, chunks)
    assert outcome.messages == before + after
    assert len(outcome.errors) == 1
    assert isinstance(outcome.errors[0], FrameTooLarge)


# ---------------------------------------------------------------- fuzzing

chunk_cuts = st.lists(st.integers(min_value=0), max_size=8)


@FUZZ_SETTINGS
@given(data=st.binary(max_size=600), cuts=chunk_cuts)
def test_fuzz_random_bytes(data: bytes, cuts: list[int]) -> None:
    pump(FrameDecoder(max_frame_bytes=SMALL_LIMIT), split(data, cuts))


@FUZZ_SETTINGS
@given(bodies=st.lists(st.binary(max_size=80), min_size=1, max_size=6), cuts=chunk_cuts)
def test_fuzz_valid_headers_random_bodies(bodies: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(b) for b in bodies) + PING_FRAME
    outcome = pump(FrameDecoder(), split(stream, cuts))
    # Every frame was whole, so each one was a message or exactly one error.
    assert len(outcome.messages) + len(outcome.errors) == len(bodies) + 1
    assert outcome.messages[-1] == PING


# Random maps that look like messages: a real tag, real and made-up field names,
# any msgpack-native values.
_FIELD_NAMES = sorted(
    {name for cls in MESSAGE_TYPES for name in cls.__dataclass_fields__} | {"type", "x"}
)
looks_like_messages = st.builds(
    lambda tag, fields: {**fields, "type": tag},
    st.sampled_from([cls.TAG for cls in MESSAGE_TYPES]),
    st.dictionaries(st.sampled_from(_FIELD_NAMES) | texts, opaque_values, max_size=5),
)


@FUZZ_SETTINGS
@given(bodies=st.lists(looks_like_messages, min_size=1, max_size=4), cuts=chunk_cuts)
def test_fuzz_message_shaped_maps(bodies: list[dict[str, object]], cuts: list[int]) -> None:
    stream = b"".join(frame(msgpack.packb(b, use_bin_type=True)) for b in bodies)
    outcome = pump(FrameDecoder(), split(stream, cuts))
    assert len(outcome.messages) + len(outcome.errors) == len(bodies)


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete"]),
        st.integers(min_value=0),
        st.integers(min_value=0, max_value=255),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        i = where % (len(out) + 1)
        if kind == "insert":
            out.insert(i, value)
        elif i == len(out):
            continue
        elif kind == "flip":
            out[i] ^= 1 << (value % 8)
        elif kind == "set":
            out[i] = value
        else:
            del out[i]
    return bytes(out)


@FUZZ_SETTINGS
@given(items=message_lists, edits=mutations, cuts=chunk_cuts)
def test_fuzz_mutated_valid_frames(
    items: list[Message], edits: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    stream = mutate(encode_all(items), edits)
    pump(FrameDecoder(max_frame_bytes=4096), split(stream, cuts))


@FUZZ_SETTINGS
@given(items=message_lists, edits=mutations)
def test_fuzz_mutated_bodies_keep_framing(
    items: list[Message], edits: list[tuple[str, int, int]]
) -> None:
    # Mutate only the bodies and fix the headers: framing stays in step, so
    # every frame yields a message or exactly one error, and the next decodes.
    bodies = [mutate(encode(m)[HEADER.size :], edits) for m in items]
    stream = b"".join(frame(b) for b in bodies) + PING_FRAME
    outcome = pump(FrameDecoder(), [stream])
    assert len(outcome.messages) + len(outcome.errors) == len(items) + 1
    assert outcome.messages[-1] == PING


# ---------------------------------------------------------------- docs/protocol.md

PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def annotated_hex(block: str) -> bytes:
    """The bytes of an annotated dump: the leading hex pairs of each line."""
    out = bytearray()
    for line in block.splitlines():
        for token in line.split():
            if len(token) != 2 or any(c not in "0123456789abcdef" for c in token):
                break
            out.append(int(token, 16))
    return bytes(out)


def test_the_documented_ping_frame_is_what_the_encoder_writes() -> None:
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    section = text.split("### 9.1", 1)[1]
    dump = section.split("```", 2)[1]
    assert annotated_hex(dump) == encode(Ping(nonce=1))
    minimal = bytes.fromhex("82a474797065a470696e67a56e6f6e636501")
    assert minimal.hex(" ") in text
    decoder = FrameDecoder()
    assert decoder.feed_all(bytes.fromhex("00000012") + minimal) == [Ping(nonce=1)]
