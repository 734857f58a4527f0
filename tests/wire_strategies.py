"""Hypothesis strategies for every native wire message and nested struct.

``MESSAGE_STRATEGIES`` maps each class of ``MESSAGE_TYPES`` to a strategy that
builds valid instances (``__post_init__`` invariants respected), and
``NESTED_STRATEGIES`` does the same for the nested structs.  The codec tests
check that both tables cover every dataclass the schema knows, so a new message
without a strategy fails loudly instead of going untested.

Values stay inside what msgpack can carry: ints in [-2**63, 2**64 - 1], floats
without NaN (NaN != NaN would break equality, not the codec), text without lone
surrogates, and opaque maps built from lists and str-keyed maps (msgpack has no
tuple, so a tuple would come back as a list).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from epd_actors.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Aborted,
    ChatMessage,
    Delta,
    Drain,
    EncodeRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Goodbye,
    Hello,
    MediaItem,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    Prompt,
    Release,
    Released,
    Role,
    SamplingParams,
    StageResult,
    TokenLogprob,
    Usage,
    Welcome,
    WorkerStats,
)

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

# Every test in the wire suite uses this: the same examples on every run, no
# example database on disk, no per-example deadline (CI machines stall).
WIRE_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Fuzz tests are cheap per example and worth more of them.
FUZZ_SETTINGS = settings(WIRE_SETTINGS, max_examples=100)

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1

wire_ints = st.integers(min_value=INT64_MIN, max_value=UINT64_MAX)
small_ints = st.integers(min_value=0, max_value=1_000_000)
counts = st.integers(min_value=0, max_value=2**31)
texts = st.text(max_size=24)
ids = st.text(min_size=1, max_size=16)
wire_floats = st.floats(allow_nan=False)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)

# msgpack-native values as an opaque transfer-params map may hold them.
opaque_scalars = (
    st.none() | st.booleans() | wire_ints | wire_floats | texts | st.binary(max_size=16)
)
opaque_values = st.recursive(
    opaque_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
opaque_maps = st.dictionaries(texts, opaque_values, max_size=6)
optional_opaque_maps = st.none() | opaque_maps
timings = st.dictionaries(texts, wire_floats, max_size=5)


@st.composite
def media_items(draw: DrawFn) -> MediaItem:
    top = draw(st.sampled_from(["image", "audio", "video"]))
    sub = draw(st.text(max_size=10))
    data = draw(st.binary(max_size=64))
    return MediaItem(
        mime_type=f"{top}/{sub}", data=data, content_hash=hashlib.sha256(data).hexdigest()
    )


chat_messages = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]) | texts,
    parts=st.lists(texts | wire_ints, max_size=5).map(tuple),
    fields=optional_opaque_maps,
)

token_id_tuples = st.lists(st.integers(min_value=0, max_value=2**32), max_size=16).map(tuple)

prompts = st.one_of(
    st.builds(Prompt, text=texts),
    st.builds(Prompt, token_ids=token_id_tuples),
    st.builds(Prompt, messages=st.lists(chat_messages, max_size=4).map(tuple)),
)


@st.composite
def sampling_params(draw: DrawFn) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(min_value=1, max_value=2**31))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(st.none() | st.floats(min_value=0.0, allow_nan=False)),
        top_p=draw(st.none() | st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
        top_k=draw(st.none() | st.integers(min_value=-1, max_value=2**31)),
        stop=tuple(draw(st.lists(texts, max_size=4))),
        seed=draw(st.none() | wire_ints),
        min_tokens=draw(st.integers(min_value=0, max_value=max_tokens or 2**31)),
        logprobs=draw(st.none() | st.integers(min_value=0, max_value=20)),
    )


usages = st.builds(Usage, prompt_tokens=counts, completion_tokens=counts)
worker_stats = st.builds(
    WorkerStats, running=counts, queued=counts, draining=st.booleans(), engine_ready=st.booleans()
)
media_tuples = st.lists(media_items(), max_size=3).map(tuple)


T = TypeVar("T")

token_logprobs = st.builds(TokenLogprob, token=texts, logprob=wire_floats)


@st.composite
def deltas(draw: DrawFn) -> Delta:
    token_ids = draw(token_id_tuples)
    n = len(token_ids)

    def per_token(item: SearchStrategy[T]) -> tuple[T, ...] | None:
        if not draw(st.booleans()):
            return None
        return tuple(draw(st.lists(item, min_size=n, max_size=n)))

    logprobs = per_token(wire_floats)
    return Delta(
        request_id=draw(ids),
        token_ids=token_ids,
        text=draw(texts),
        logprobs=logprobs,
        finish_reason=draw(st.none() | st.sampled_from(["stop", "length", "abort"]) | texts),
        usage=draw(st.none() | usages),
        timings=draw(st.none() | timings),
        tokens=per_token(texts),
        top_logprobs=per_token(st.lists(token_logprobs, max_size=3).map(tuple)),
        fields=draw(optional_opaque_maps),
    )


def _stage_request(
    cls: type[PrefillRequest] | type[GenerateRequest],
) -> SearchStrategy[Message]:
    return st.builds(
        cls,
        request_id=ids,
        prompt=prompts,
        media=media_tuples,
        sampling=sampling_params(),
        kv_transfer_params=optional_opaque_maps,
        ec_transfer_params=optional_opaque_maps,
        options=optional_opaque_maps,
    )


NESTED_STRATEGIES: dict[type, SearchStrategy[object]] = {
    MediaItem: media_items(),
    ChatMessage: chat_messages,
    Prompt: prompts,
    SamplingParams: sampling_params(),
    TokenLogprob: token_logprobs,
    Usage: usages,
    WorkerStats: worker_stats,
}

MESSAGE_STRATEGIES: dict[type[Message], SearchStrategy[Message]] = {
    Hello: st.builds(
        Hello, protocol_version=wire_ints, auth_token=texts, client_id=texts, request_id=texts
    ),
    Welcome: st.builds(
        Welcome,
        protocol_version=wire_ints,
        worker_id=texts,
        role=st.sampled_from([r.value for r in Role]),
        model=texts,
        capabilities=st.lists(texts, max_size=4).map(tuple),
        max_concurrency=counts,
        request_id=texts,
    ),
    EncodeRequest: st.builds(
        EncodeRequest,
        request_id=ids,
        media=st.lists(media_items(), min_size=1, max_size=3).map(tuple),
        ec_transfer_params=optional_opaque_maps,
    ),
    PrefillRequest: _stage_request(PrefillRequest),
    GenerateRequest: _stage_request(GenerateRequest),
    StageResult: st.builds(
        StageResult,
        request_id=ids,
        kv_transfer_params=optional_opaque_maps,
        ec_transfer_params=optional_opaque_maps,
        prompt_tokens=counts,
        timings=timings,
    ),
    Delta: deltas(),
    ErrorReply: st.builds(
        ErrorReply,
        request_id=texts,
        code=st.sampled_from([c.value for c in ErrorCode]) | texts,
        message=texts,
        retryable=st.booleans(),
        param=st.none() | texts,
    ),
    Abort: st.builds(Abort, request_id=ids),
    Aborted: st.builds(Aborted, request_id=ids),
    Release: st.builds(Release, request_id=ids, kv_transfer_params=opaque_maps),
    Released: st.builds(Released, request_id=ids, found=st.booleans()),
    Ping: st.builds(Ping, nonce=wire_ints, request_id=texts),
    Pong: st.builds(Pong, nonce=wire_ints, stats=worker_stats, request_id=texts),
    Drain: st.builds(Drain, request_id=texts),
    Goodbye: st.builds(Goodbye, reason=texts, request_id=texts),
}

# Any wire message, in MESSAGE_TYPES order so shrinking prefers the simple ones.
messages: SearchStrategy[Message] = st.one_of(
    *(MESSAGE_STRATEGIES[cls] for cls in MESSAGE_TYPES if cls in MESSAGE_STRATEGIES)
)


# ---------------------------------------------------------------- fixed samples

_PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(24))
_IMAGE = MediaItem("image/png", _PNG, hashlib.sha256(_PNG).hexdigest())

# One hand-written, fully populated instance of every message type (two deltas:
# a streaming one and a terminal one), for the table-driven framing tests.
SAMPLE_MESSAGES: tuple[Message, ...] = (
    Hello(protocol_version=PROTOCOL_VERSION, auth_token="s3cret", client_id="router-1"),
    Welcome(
        protocol_version=PROTOCOL_VERSION,
        worker_id="prefill-0",
        role="prefill",
        model="tiny-vlm",
        capabilities=("image", "audio"),
        max_concurrency=8,
    ),
    EncodeRequest("req-1", (_IMAGE,), ec_transfer_params={"connector": "shared-storage"}),
    PrefillRequest(
        "req-1",
        Prompt(messages=(ChatMessage("user", ("What is in ", 0, "?")),)),
        media=(_IMAGE,),
        sampling=SamplingParams(max_tokens=32, temperature=0.0, stop=("\n",), seed=7, logprobs=2),
        kv_transfer_params={"do_remote_decode": True, "remote_block_ids": None},
    ),
    GenerateRequest(
        "req-1",
        Prompt(token_ids=(101, 102, 103)),
        kv_transfer_params={"remote_block_ids": [4, 5], "remote_port": 5600, "blob": b"\x00"},
    ),
    StageResult(
        "req-1",
        kv_transfer_params={"remote_engine_id": "e-1", "remote_block_ids": [4, 5]},
        prompt_tokens=12,
        timings={"queue_s": 0.001, "prefill_s": 0.02},
    ),
    Delta("req-1", token_ids=(11, 12), text="A cat", logprobs=(-0.1, -0.5)),
    Delta(
        "req-1",
        token_ids=(13,),
        text=".",
        finish_reason="stop",
        usage=Usage(prompt_tokens=12, completion_tokens=3),
        timings={"decode_s": 0.1},
    ),
    ErrorReply("req-2", code="unknown_kv_handle", message="no KV handle kv-9", retryable=True),
    Abort("req-3"),
    Aborted("req-3"),
    Release("req-4", {"handle": "kv-4"}),
    Released("req-4", found=False),
    Ping(nonce=42),
    Pong(nonce=42, stats=WorkerStats(running=3, queued=1, draining=False, engine_ready=True)),
    Drain(),
    Goodbye(reason="shutting down"),
)
