"""The one SSE encoder and decoder (``epd_actors/http/sse.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_actors.http.sse import (
    DONE_DATA,
    DONE_EVENT,
    SseDecoder,
    SseError,
    SseEvent,
    encode_comment,
    encode_event,
)

_NAMES = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]))
_DATA = st.text(st.characters(blacklist_categories=["Cs"]))


def test_one_line_events_and_the_terminator() -> None:
    assert encode_event('{"a":1}') == 'data: {"a":1}\n\n'
    assert encode_event("{}", "error") == "event: error\ndata: {}\n\n"
    assert DONE_EVENT == "data: [DONE]\n\n"
    assert encode_comment("timings a\nb\rc") == ": timings a b c\n\n"


def test_multi_line_data_is_one_data_line_per_line() -> None:
    assert encode_event("a\nb\r\nc\rd") == "data: a\ndata: b\ndata: c\ndata: d\n\n"
    assert SseDecoder(64).feed(encode_event("a\nb").encode()) == [SseEvent("", "a\nb")]


def test_an_event_name_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        encode_event("x", "a\nb")


@given(st.lists(st.tuples(_DATA, _NAMES), max_size=5), st.integers(1, 7))
def test_what_is_encoded_decodes_the_same_in_any_split(
    events: list[tuple[str, str]], step: int
) -> None:
    wire = "".join(encode_event(data, name) for data, name in events)
    wire += encode_comment("ignored") + DONE_EVENT
    raw = wire.encode()
    decoder = SseDecoder(1 << 16)
    decoded: list[SseEvent] = []
    for start in range(0, len(raw), step):
        decoded += decoder.feed(raw[start : start + step])
    expected = [
        SseEvent(name, data.replace("\r\n", "\n").replace("\r", "\n")) for data, name in events
    ]
    assert decoded == [*expected, SseEvent("", DONE_DATA)]


def test_limits_and_bad_bytes_raise_sse_error() -> None:
    with pytest.raises(SseError, match="line exceeds"):
        SseDecoder(16).feed(b"data: " + b"x" * 64)
    with pytest.raises(SseError, match="event exceeds"):
        SseDecoder(16).feed(b"data: 0123456789\ndata: 0123456789\n")
    with pytest.raises(SseError, match="UTF-8"):
        SseDecoder(64).feed(b"data: \xff\n\n")


@given(st.lists(st.tuples(_DATA, _NAMES), max_size=5))
def test_one_event_per_read_decodes_as_any_split_does(events: list[tuple[str, str]]) -> None:
    """A read that is one whole event (a paced stream's) takes the decoder's short way."""
    whole, bytewise = SseDecoder(1 << 16), SseDecoder(1 << 16)
    for data, name in events:
        raw = encode_event(data, name).encode()
        pieces = [raw[byte : byte + 1] for byte in range(len(raw))]
        expected = [event for piece in pieces for event in bytewise.feed(piece)]
        assert whole.feed(raw) == expected


@pytest.mark.parametrize(
    ("reads", "expected"),
    [
        ([b"data: a\r\n\n"], [SseEvent("", "a")]),
        ([b"event: x\n", b"data: y\n\n"], [SseEvent("x", "y")]),
        ([b"data: a\n", b"data: b\n\n"], [SseEvent("", "a\nb")]),
        ([b"data: a", b"data: b\n\n"], [SseEvent("", "adata: b")]),
        ([b"data: " + b"x" * 16 + b"\n\n"], [SseEvent("", "x" * 16)]),
    ],
)
def test_a_whole_event_after_pending_lines_or_with_a_cr_is_decoded_in_full(
    reads: list[bytes], expected: list[SseEvent]
) -> None:
    decoder = SseDecoder(16)
    assert [event for read in reads for event in decoder.feed(read)] == expected


def test_a_whole_event_read_keeps_the_limits() -> None:
    with pytest.raises(SseError, match="event exceeds"):
        SseDecoder(16).feed(b"data: " + b"x" * 17 + b"\n\n")
    with pytest.raises(SseError, match="UTF-8"):
        SseDecoder(64).feed(b"data: \xff\xfe\n\n")
