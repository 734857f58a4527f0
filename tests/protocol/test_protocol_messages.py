"""The closed message set: round trips, wire form, validation, invariants, encode errors."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epd_actors.errors import FrameTooLarge, LocalProtocolError, RemoteProtocolError
from epd_actors.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    ChatMessage,
    Delta,
    EncodeRequest,
    FrameDecoder,
    GenerateRequest,
    MediaItem,
    Message,
    Ping,
    PrefillRequest,
    Prompt,
    Release,
    SamplingParams,
    Welcome,
    decode_body,
    encode,
)
from epd_actors.protocol.codec import HEADER
from epd_actors.protocol.messages import STRUCTS_BY_TAG, merge_deltas
from tests.wire_strategies import (
    MESSAGE_STRATEGIES,
    NESTED_STRATEGIES,
    SAMPLE_MESSAGES,
    WIRE_SETTINGS,
)

PING = Ping(nonce=7)


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_frame(data: bytes) -> Message | None:
    """Decode exactly one message from ``data`` (one whole frame, then EOF)."""
    decoder = FrameDecoder()
    decoder.feed(data)
    decoder.feed(b"")
    message = decoder.next_message()
    assert decoder.next_message() is None
    assert decoder.at_eof
    return message


def nested_structs(cls: type, found: set[type]) -> set[type]:
    """Every dataclass reachable from the fields of ``cls``."""

    def visit(annotation: object) -> None:
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            if annotation not in found:
                found.add(annotation)
                nested_structs(annotation, found)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        visit(hints[f.name])
    return found


# ---------------------------------------------------------------- coverage of the tables


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_TYPES)


def test_every_nested_struct_has_a_strategy() -> None:
    found: set[type] = set()
    for cls in MESSAGE_TYPES:
        nested_structs(cls, found)
    assert found == set(NESTED_STRATEGIES)


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLE_MESSAGES} == set(MESSAGE_TYPES)


def test_tags_are_unique_and_registered() -> None:
    tags = [cls.TAG for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags)
    assert {tag: s.cls for tag, s in STRUCTS_BY_TAG.items()} == {c.TAG: c for c in MESSAGE_TYPES}


def test_every_message_carries_a_request_id() -> None:
    for cls in MESSAGE_TYPES:
        assert "request_id" in {f.name for f in dataclasses.fields(cls)}, cls.__name__


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.TAG)
@WIRE_SETTINGS
@given(data=st.data())
def test_round_trip(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    wire = encode(message)
    decoded = decode_frame(wire)
    assert type(decoded) is cls
    assert decoded == message
    # Re-encoding what was decoded gives the same bytes: a relay is lossless.
    assert encode(decoded) == wire
    assert decode_body(wire[HEADER.size :]) == message
    # The wire form: a length header, then a map of the tag and every field,
    # except those that hold nil where nil is their default.
    (size,) = HEADER.unpack_from(wire)
    assert size == len(wire) - HEADER.size
    body = msgpack.unpackb(wire[HEADER.size :], raw=False, strict_map_key=True)
    assert body["type"] == cls.TAG
    assert set(body) == {"type"} | written_fields(message)


def written_fields(message: object) -> set[str]:
    """The fields the encoder writes: all but those holding nil where nil is the default."""
    return {
        f.name
        for f in dataclasses.fields(message)  # type: ignore[arg-type]
        if not (getattr(message, f.name) is None and f.default is None)
    }


def test_nested_structs_carry_no_type_tag() -> None:
    prefill = next(m for m in SAMPLE_MESSAGES if isinstance(m, PrefillRequest))
    body = msgpack.unpackb(encode(prefill)[HEADER.size :], raw=False)
    assert set(body["sampling"]) == written_fields(prefill.sampling)
    assert set(body["prompt"]) == written_fields(prefill.prompt) == {"messages"}
    assert set(body["media"][0]) == {"mime_type", "data", "content_hash"}
    assert body["prompt"]["messages"][0] == {"role": "user", "parts": ["What is in ", 0, "?"]}


def test_minimal_maps_take_the_documented_defaults() -> None:
    prefill = decode_body(pack({"type": "prefill", "request_id": "r", "prompt": {"text": "hi"}}))
    assert prefill == PrefillRequest("r", Prompt(text="hi"))
    assert prefill.sampling == SamplingParams(
        max_tokens=None, temperature=None, top_p=None, top_k=None, stop=(), seed=None, min_tokens=0
    )
    assert prefill.media == ()
    assert prefill.kv_transfer_params is None
    assert decode_body(pack({"type": "ping", "nonce": 3})) == Ping(nonce=3, request_id="")
    delta = decode_body(pack({"type": "delta", "request_id": "r"}))
    assert delta == Delta("r")
    assert delta.finish_reason is None


def test_explicit_nil_for_optional_fields() -> None:
    body = {
        "type": "generate",
        "request_id": "r",
        "prompt": {"text": None, "token_ids": [1], "messages": None},
        "kv_transfer_params": None,
        "sampling": {"seed": None, "logprobs": None},
    }
    assert decode_body(pack(body)) == GenerateRequest("r", Prompt(token_ids=(1,)))


def test_int_is_accepted_for_float_fields() -> None:
    body = {
        "type": "delta",
        "request_id": "r",
        "token_ids": [1, 2],
        "logprobs": [-1, 0],
        "timings": {"decode_s": 2},
    }
    delta = decode_body(pack(body))
    assert isinstance(delta, Delta)
    assert delta.logprobs == (-1.0, 0.0)
    assert all(type(x) is float for x in delta.logprobs)
    assert delta.timings is not None
    assert type(delta.timings["decode_s"]) is float


def test_chat_parts_keep_str_and_int_apart() -> None:
    message = PrefillRequest(
        "r", Prompt(messages=(ChatMessage("user", ("1", 1, "", 0)),)), media=()
    )
    decoded = decode_frame(encode(message))
    assert isinstance(decoded, PrefillRequest)
    assert decoded.prompt.messages is not None
    assert [type(p) for p in decoded.prompt.messages[0].parts] == [str, int, str, int]


def test_media_item_modality() -> None:
    assert MediaItem("audio/wav", b"", "h").modality == "audio"


# ---------------------------------------------------------------- malformed bodies

GOOD_PREFILL: dict[str, object] = {
    "type": "prefill",
    "request_id": "r",
    "prompt": {"text": "hi"},
    "sampling": {"max_tokens": 4},
}
GOOD_MEDIA: dict[str, object] = {"mime_type": "image/png", "data": b"x", "content_hash": "h"}


def prefill_with(**changes: object) -> bytes:
    return pack({**GOOD_PREFILL, **changes})


def sampling_with(**changes: object) -> bytes:
    return prefill_with(sampling={"max_tokens": 4, **changes})


def nested(depth: int) -> bytes:
    """A release whose transfer params hold ``depth`` nested one-element arrays."""
    head = pack({"type": "release", "request_id": "r"})
    # fixmap of 3 instead of 2, then the extra key and the nested arrays.
    return (
        b"\x83"
        + head[1:]
        + pack("kv_transfer_params")
        + b"\x81"
        + pack("k")
        + b"\x91" * depth
        + b"\xc0"
    )


MALFORMED: list[tuple[str, bytes, str]] = [
    # Not msgpack at all, or not exactly one msgpack object.
    ("reserved-byte", b"\xc1", "invalid msgpack"),
    ("empty-body", b"", "invalid msgpack"),
    ("truncated-object", pack({"type": "ping", "nonce": 1})[:-1], "invalid msgpack"),
    ("trailing-bytes", pack({"type": "ping", "nonce": 1}) + b"\xc0", "invalid msgpack"),
    ("invalid-utf8", b"\x82\xa4type\xa4ping\xa5nonce\xa2\xff\xfe", "invalid msgpack"),
    (
        "array32-huge-header",
        b"\x82\xa4type\xa4ping\xa5nonce\xdd\x7f\xff\xff\xff",
        "invalid msgpack",
    ),
    ("map32-huge-header", b"\xdf\x00\x10\x00\x00", "invalid msgpack"),
    ("str32-past-end", b"\x81\xa4type\xdb\x00\x00\x10\x00ping", "invalid msgpack"),
    ("nested-too-deep", nested(5000), "invalid msgpack"),
    ("int-map-key", pack({"type": "ping", "nonce": 1, 5: 1}), "invalid msgpack"),
    ("ext-field", pack({"type": "ping", "nonce": msgpack.ExtType(1, b"x")}), "invalid msgpack"),
    (
        "ext-in-opaque-map",
        prefill_with(kv_transfer_params={"k": msgpack.ExtType(5, b"abcd")}),
        "invalid msgpack",
    ),
    ("empty-ext", b"\x82\xa4type\xa4ping\xa5nonce\xc7\x00\x05", "ext type 5 is not allowed"),
    ("timestamp-ext", pack({"type": "ping", "nonce": msgpack.Timestamp(1, 0)}), "invalid msgpack"),
    # A msgpack object that is not a message.
    ("array-body", pack(["ping", 1]), "frame body must be a map, got list"),
    ("int-body", pack(3), "frame body must be a map, got int"),
    ("no-type", pack({"nonce": 1}), "no str 'type' field"),
    ("int-type", pack({"type": 1, "nonce": 1}), "no str 'type' field"),
    ("bin-type", pack({"type": b"ping", "nonce": 1}), "no str 'type' field"),
    ("bin-type-key", pack({b"type": "ping", "nonce": 1}), "no str 'type' field"),
    ("unknown-type", pack({"type": "pingg", "nonce": 1}), "unknown message type 'pingg'"),
    ("nested-tag-as-type", pack({"type": "sampling"}), "unknown message type 'sampling'"),
    # Fields: unknown, missing, wrong type (the message names the field path).
    ("unknown-field", pack({"type": "ping", "nonce": 1, "x": 2}), "^ping: unknown field 'x'"),
    ("bin-field-name", pack({"type": "ping", "nonce": 1, b"x": 2}), "^ping: unknown field b'x'"),
    ("missing-field", pack({"type": "ping"}), "^ping: missing field 'nonce'"),
    ("missing-nested", prefill_with(prompt=None), r"^prefill\.prompt: expected map, got NoneType"),
    ("str-for-int", pack({"type": "ping", "nonce": "1"}), r"^ping\.nonce: expected int, got str"),
    (
        "bool-for-int",
        pack({"type": "ping", "nonce": True}),
        r"^ping\.nonce: expected int, got bool",
    ),
    (
        "float-for-int",
        pack({"type": "ping", "nonce": 1.0}),
        r"^ping\.nonce: expected int, got float",
    ),
    (
        "int-for-bool",
        pack({"type": "released", "request_id": "r", "found": 1}),
        r"^released\.found: expected bool, got int",
    ),
    (
        "nil-for-str",
        pack({"type": "error", "request_id": "r", "code": None, "message": ""}),
        r"^error\.code: expected str, got NoneType",
    ),
    (
        "int-request-id",
        pack({"type": "abort", "request_id": 5}),
        r"^abort\.request_id: expected str, got int",
    ),
    (
        "nested-bool-for-int",
        sampling_with(max_tokens=True),
        r"^prefill\.sampling\.max_tokens: expected int, got bool",
    ),
    (
        "nested-str-for-float",
        sampling_with(temperature="hot"),
        r"^prefill\.sampling\.temperature: expected float, got str",
    ),
    (
        "nested-bool-for-float",
        sampling_with(top_p=True),
        r"^prefill\.sampling\.top_p: expected float, got bool",
    ),
    ("nested-not-map", prefill_with(sampling=[4]), r"^prefill\.sampling: expected map, got list"),
    (
        "int-for-optional-str",
        pack({"type": "delta", "request_id": "r", "finish_reason": 5}),
        r"^delta\.finish_reason: expected str, got int",
    ),
    (
        "str-in-token-ids",
        pack({"type": "delta", "request_id": "r", "token_ids": [1, "2"]}),
        r"^delta\.token_ids\[1\]: expected int, got str",
    ),
    ("nested-unknown-field", sampling_with(beam=2), r"^prefill\.sampling: unknown field 'beam'"),
    (
        "nested-type-key",
        sampling_with(type="sampling"),
        r"^prefill\.sampling: unknown field 'type'",
    ),
    (
        "nested-array-item",
        sampling_with(stop=["a", 1]),
        r"^prefill\.sampling\.stop\[1\]: expected str, got int",
    ),
    (
        "array-not-array",
        prefill_with(prompt={"token_ids": 5}),
        r"^prefill\.prompt\.token_ids: expected array, got int",
    ),
    (
        "token-id-str",
        prefill_with(prompt={"token_ids": [1, "2"]}),
        r"^prefill\.prompt\.token_ids\[1\]: expected int, got str",
    ),
    (
        "chat-part-float",
        prefill_with(prompt={"messages": [{"role": "user", "parts": ["a", 1.5]}]}),
        r"^prefill\.prompt\.messages\[0\]\.parts\[1\]: expected str \| int, got float",
    ),
    (
        "chat-part-bool",
        prefill_with(prompt={"messages": [{"role": "user", "parts": [True]}]}),
        r"^prefill\.prompt\.messages\[0\]\.parts\[0\]: expected str \| int, got bool",
    ),
    (
        "chat-missing-role",
        prefill_with(prompt={"messages": [{"parts": []}]}),
        r"^prefill\.prompt\.messages\[0\]: missing field 'role'",
    ),
    (
        "media-str-for-bytes",
        pack({"type": "encode", "request_id": "r", "media": [{**GOOD_MEDIA, "data": "x"}]}),
        r"^encode\.media\[0\]\.data: expected bytes, got str",
    ),
    (
        "media-bytes-for-str",
        pack({"type": "encode", "request_id": "r", "media": [{**GOOD_MEDIA, "mime_type": b"a/b"}]}),
        r"^encode\.media\[0\]\.mime_type: expected str, got bytes",
    ),
    (
        "media-not-array",
        pack({"type": "encode", "request_id": "r", "media": GOOD_MEDIA}),
        r"^encode\.media: expected array, got dict",
    ),
    (
        "stats-not-map",
        pack({"type": "pong", "nonce": 1, "stats": 1}),
        r"^pong\.stats: expected map, got int",
    ),
    (
        "stats-int-for-bool",
        pack(
            {
                "type": "pong",
                "nonce": 1,
                "stats": {"running": 0, "queued": 0, "draining": 0, "engine_ready": True},
            }
        ),
        r"^pong\.stats\.draining: expected bool, got int",
    ),
    (
        "usage-str-for-int",
        pack({"type": "delta", "request_id": "r", "usage": {"prompt_tokens": "1"}}),
        r"^delta\.usage\.prompt_tokens: expected int, got str",
    ),
    (
        "logprob-str",
        pack({"type": "delta", "request_id": "r", "token_ids": [1], "logprobs": ["x"]}),
        r"^delta\.logprobs\[0\]: expected float, got str",
    ),
    (
        "timings-str-value",
        pack({"type": "result", "request_id": "r", "timings": {"ttft": "1"}}),
        r"^result\.timings\.ttft: expected float, got str",
    ),
    (
        "timings-bin-key",
        pack({"type": "result", "request_id": "r", "timings": {b"ttft": 1.0}}),
        r"^result\.timings: map keys must be str, got bytes",
    ),
    (
        "opaque-not-map",
        pack({"type": "release", "request_id": "r", "kv_transfer_params": [1]}),
        r"^release\.kv_transfer_params: expected map, got list",
    ),
    (
        "opaque-bin-key",
        prefill_with(kv_transfer_params={b"k": 1}),
        r"^prefill\.kv_transfer_params: map keys must be str, got bytes",
    ),
    (
        "opaque-nested-bin-key",
        prefill_with(ec_transfer_params={"a": [0, {"b": {b"k": 1}}]}),
        r"^prefill\.ec_transfer_params\.a\[1\]\.b: map keys must be str, got bytes",
    ),
]


@pytest.mark.parametrize(
    ("body", "match"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_body_is_rejected_and_named(body: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match) as info:
        decode_body(body)
    assert not isinstance(info.value, FrameTooLarge)


@pytest.mark.parametrize(
    ("body", "match"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_decoder_survives_a_malformed_frame(body: bytes, match: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(frame(body) + encode(PING))
    with pytest.raises(RemoteProtocolError, match=match):
        decoder.next_message()
    assert decoder.next_message() == PING
    assert decoder.next_message() is None
    assert decoder.buffered_bytes == 0
    decoder.feed(b"")
    assert decoder.at_eof


def test_deep_nesting_within_msgpack_limits_is_accepted_and_relayed() -> None:
    release = decode_body(nested(1000))
    assert isinstance(release, Release)
    wire = encode(release)
    # Compare bytes: == on 1000 nested lists would hit Python's recursion limit.
    assert wire == frame(nested(1000))
    relayed = decode_frame(wire)
    assert relayed is not None
    assert encode(relayed) == wire


# ---------------------------------------------------------------- invariants

LOCAL_INVARIANTS: list[tuple[str, typing.Callable[[], object], str]] = [
    ("prompt-none", lambda: Prompt(), "exactly one of"),
    ("prompt-two", lambda: Prompt(text="a", token_ids=(1,)), "exactly one of"),
    ("prompt-three", lambda: Prompt(text="a", token_ids=(), messages=()), "exactly one of"),
    ("max-tokens-0", lambda: SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
    ("temperature-neg", lambda: SamplingParams(temperature=-0.1), "temperature must be >= 0"),
    ("temperature-nan", lambda: SamplingParams(temperature=math.nan), "temperature must be >= 0"),
    ("top-p-0", lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("top-p-above-1", lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ("top-k-below-minus-1", lambda: SamplingParams(top_k=-2), "top_k must be >= -1"),
    ("min-tokens-above-max", lambda: SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
    ("min-tokens-neg", lambda: SamplingParams(min_tokens=-1), "min_tokens"),
    ("logprobs-neg", lambda: SamplingParams(logprobs=-1), "logprobs must be >= 0"),
    (
        "delta-logprobs-short",
        lambda: Delta("r", token_ids=(1, 2), logprobs=(0.0,)),
        "one entry per token id",
    ),
    ("delta-logprobs-no-ids", lambda: Delta("r", logprobs=(0.0,)), "one entry per token id"),
    ("media-mime", lambda: MediaItem("png", b"", "h"), "is not type/subtype"),
    ("media-hash", lambda: MediaItem("image/png", b"", ""), "content_hash must not be empty"),
    ("encode-no-media", lambda: EncodeRequest("r", ()), "at least one media item"),
    (
        "welcome-role",
        lambda: Welcome(protocol_version=1, worker_id="w", role="gpu", model="m"),
        "unknown role 'gpu'",
    ),
]


@pytest.mark.parametrize(
    ("build", "match"), [c[1:] for c in LOCAL_INVARIANTS], ids=[c[0] for c in LOCAL_INVARIANTS]
)
def test_invariants_are_local_errors_when_built(
    build: typing.Callable[[], object], match: str
) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        build()


REMOTE_INVARIANTS: list[tuple[str, bytes, str]] = [
    ("prompt-none", prefill_with(prompt={}), r"^prefill\.prompt: .*exactly one of"),
    (
        "prompt-two",
        prefill_with(prompt={"text": "a", "token_ids": [1]}),
        r"^prefill\.prompt: .*exactly one of",
    ),
    ("max-tokens-0", sampling_with(max_tokens=0), r"^prefill\.sampling: max_tokens must be >= 1"),
    ("temperature-neg", sampling_with(temperature=-1), r"^prefill\.sampling: temperature"),
    ("top-p-0", sampling_with(top_p=0), r"^prefill\.sampling: top_p"),
    ("top-k", sampling_with(top_k=-5), r"^prefill\.sampling: top_k"),
    ("min-tokens", sampling_with(min_tokens=5), r"^prefill\.sampling: min_tokens"),
    ("logprobs-neg", sampling_with(logprobs=-1), r"^prefill\.sampling: logprobs"),
    (
        "delta-logprobs",
        pack({"type": "delta", "request_id": "r", "token_ids": [1, 2], "logprobs": [0.0]}),
        r"^delta: logprobs needs one entry per token id",
    ),
    (
        "media-mime",
        pack({"type": "encode", "request_id": "r", "media": [{**GOOD_MEDIA, "mime_type": "x"}]}),
        r"^encode\.media\[0\]: mime_type 'x' is not type/subtype",
    ),
    (
        "encode-no-media",
        pack({"type": "encode", "request_id": "r", "media": []}),
        r"^encode: encode needs at least one media item",
    ),
    (
        "welcome-role",
        pack(
            {"type": "welcome", "protocol_version": 1, "worker_id": "w", "role": "x", "model": ""}
        ),
        r"^welcome: unknown role 'x'",
    ),
]


@pytest.mark.parametrize(
    ("body", "match"), [c[1:] for c in REMOTE_INVARIANTS], ids=[c[0] for c in REMOTE_INVARIANTS]
)
def test_invariants_are_remote_errors_when_received(body: bytes, match: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(frame(body) + encode(PING))
    with pytest.raises(RemoteProtocolError, match=match) as info:
        decoder.next_message()
    assert not isinstance(info.value, LocalProtocolError)
    assert decoder.next_message() == PING


# ---------------------------------------------------------------- encode errors


def test_encode_rejects_a_frame_over_the_limit() -> None:
    wire = encode(PING)
    body_size = len(wire) - HEADER.size
    assert encode(PING, max_frame_bytes=body_size) == wire
    with pytest.raises(LocalProtocolError, match=f"ping frame of {body_size} bytes exceeds"):
        encode(PING, max_frame_bytes=body_size - 1)
    decoder = FrameDecoder(max_frame_bytes=body_size)
    decoder.feed(wire)
    assert decoder.next_message() == PING


def test_encode_rejects_media_over_the_default_limit() -> None:
    data = bytes(DEFAULT_MAX_FRAME_BYTES)
    request = EncodeRequest("r", (MediaItem("image/png", data, "h"),))
    with pytest.raises(LocalProtocolError, match="exceeds the limit"):
        encode(request)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "ping",
        b"\x00\x00\x00\x00",
        {"type": "ping", "nonce": 1},
        SamplingParams(),
        MediaItem("image/png", b"", "h"),
        Prompt(text="hi"),
        object(),
    ],
    ids=["none", "str", "bytes", "dict", "sampling", "media", "prompt", "object"],
)
def test_encode_rejects_what_is_not_a_message(value: object) -> None:
    with pytest.raises(LocalProtocolError, match="not a wire message"):
        encode(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message",
    [
        Ping(nonce=2**64),
        Ping(nonce=-(2**63) - 1),
        Release("r", {"k": {1, 2}}),
        Release("r", {"k": object()}),
        Welcome(protocol_version=1, worker_id="\ud800", role="pd", model="m"),
    ],
    ids=["int-too-big", "int-too-small", "set", "object", "lone-surrogate"],
)
def test_encode_rejects_values_msgpack_cannot_carry(message: Message) -> None:
    with pytest.raises(LocalProtocolError, match="cannot be encoded"):
        encode(message)


# ---------------------------------------------------------------- merging deltas


@st.composite
def delta_runs(draw: st.DrawFn) -> list[Delta]:
    """Consecutive deltas of one request; only the last may be terminal."""
    run = draw(st.lists(MESSAGE_STRATEGIES[Delta], min_size=1, max_size=5))
    body = [replace(d, request_id="r", finish_reason=None, usage=None, timings=None) for d in run]
    return [*body[:-1], replace(run[-1], request_id="r")]


@WIRE_SETTINGS
@given(run=delta_runs())
def test_merge_deltas_concatenates_in_order(run: list[Delta]) -> None:
    merged = merge_deltas(run)
    last = run[-1]
    assert merged.request_id == "r"
    assert merged.token_ids == tuple(t for d in run for t in d.token_ids)
    assert merged.text == "".join(d.text for d in run)
    assert (merged.finish_reason, merged.usage, merged.timings) == (
        last.finish_reason,
        last.usage,
        last.timings,
    )
    with_tokens = [d for d in run if d.token_ids]
    if len(run) > 1 and with_tokens and all(d.logprobs is not None for d in with_tokens):
        assert merged.logprobs == tuple(lp for d in with_tokens for lp in d.logprobs or ())
    elif len(run) > 1:
        assert merged.logprobs is None
    # The merged delta is itself valid and survives the wire.
    assert decode_frame(encode(merged)) == merged
