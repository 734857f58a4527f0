"""The closed set of native wire messages.

Theory of operation: the router (client) opens a stream to a worker and sends
:class:`Hello`; the worker answers :class:`Welcome` (or an :class:`ErrorReply`
with code ``unauthorized``/``unsupported_version`` and closes).  After that, one
connection multiplexes many requests, each message naming its ``request_id``.
Connection-scoped messages (handshake, heartbeat, drain, goodbye) carry
``request_id == ""``.

Per request the worker sends zero or more :class:`Delta` frames and then exactly
one *terminal* message: a :class:`Delta` with ``finish_reason`` set (generate),
a :class:`StageResult` (encode, prefill), an :class:`ErrorReply`, or
:class:`Aborted` (after an :class:`Abort`).  Nothing follows a terminal message
for that id.  :class:`Release` is answered by :class:`Released`; :class:`Ping` by
:class:`Pong`, out of band of any request data.

Every class is a frozen, slotted dataclass (:class:`Delta`, built once per
token, a :func:`~epd_actors.records.token_record`: frozen to the type
checker, plain slots at run time); the ``TAG`` class attribute is the
value of the ``type`` key on the wire.  ``docs/protocol.md`` is the normative
description of these fields for implementers in other languages.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from ..errors import LocalProtocolError
from ..records import token_record
from .schema import Struct, compile_struct, require

PROTOCOL_VERSION = 2
"""The version this package speaks.  Version 2 added the request ``options``,
``ChatMessage.fields``, the optional sampling fields, the ``Delta`` fields
``tokens``, ``top_logprobs`` and ``fields``, and ``ErrorReply.param``; later
in version 2, the optional ``lora_adapter`` of prefill and generate requests
(sent only for a request naming an adapter, so a worker that predates it
serves every other request as before), and the optional ``options`` of
encode requests (sent only for a request with processing options, likewise);
later still, the optional ``traceparent`` of every stage request (sent only
to a worker announcing :data:`TRACEPARENT_CAPABILITY`)."""

TRACEPARENT_CAPABILITY: Final = "traceparent"
"""The ``Welcome`` capability saying the worker takes a stage request's
``traceparent``.  A router sends the field only to a worker announcing it: a
worker that predates the field refuses unknown fields."""

SUPPORTED_PROTOCOL_VERSIONS: tuple[int, ...] = (1, 2)
"""Versions a worker accepts.  A version-1 client sends a subset of version 2
(its messages never carry the fields version 2 added), so a worker of this
package serves it, answering with the client's version."""


class Role(enum.StrEnum):
    """What a worker does: encode, prefill, decode, or merged prefill+decode."""

    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    PD = "pd"


@dataclass(frozen=True, slots=True)
class RoleTraits:
    """What a worker of one role does: the one table every check of a role reads.

    Attributes:
        operations: the stage requests it serves, by their wire ``TAG``
            (``encode``, ``prefill``, ``generate``).
        streams: it answers with a stream of deltas (``generate``), not one result.
        hands_off_kv: it prefills and hands its KV cache on (vLLM ``kv_producer``).
        takes_kv: it generates from a KV cache another worker handed on
            (vLLM ``kv_consumer``).
    """

    operations: frozenset[str]
    streams: bool = False
    hands_off_kv: bool = False
    takes_kv: bool = False

    def serves(self, operation: str) -> bool:
        """Whether a worker of this role serves ``operation`` (a stage request's ``TAG``)."""
        return operation in self.operations


ROLE_TRAITS: Final[dict[Role, RoleTraits]] = {
    Role.ENCODE: RoleTraits(frozenset({"encode"})),
    Role.PREFILL: RoleTraits(frozenset({"prefill"}), hands_off_kv=True),
    Role.DECODE: RoleTraits(frozenset({"generate"}), streams=True, takes_kv=True),
    Role.PD: RoleTraits(frozenset({"generate"}), streams=True),
}
"""Role -> :class:`RoleTraits`; the workers' engines and servers decide by it, never by name."""


class ErrorCode(enum.StrEnum):
    """Wire error codes carried by :class:`ErrorReply`."""

    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNSUPPORTED_STAGE = "unsupported_stage"
    PROTOCOL_ERROR = "protocol_error"
    MISSING_ENCODER_CACHE = "missing_encoder_cache"
    UNKNOWN_KV_HANDLE = "unknown_kv_handle"
    DUPLICATE_REQUEST = "duplicate_request"
    OVERLOADED = "overloaded"
    DRAINING = "draining"
    ENGINE_ERROR = "engine_error"
    INTERNAL = "internal"


# Codes that mean "this request is wrong"; they are never retried elsewhere and
# never count against a worker's health.
CLIENT_ERROR_CODES = frozenset(
    {ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_STAGE, ErrorCode.DUPLICATE_REQUEST}
)

# Codes that mean "not now, not here": the worker is full or leaving.  The job
# may go to another worker at once, and the refusal never counts against the
# worker's health.
BACKPRESSURE_CODES = frozenset({ErrorCode.OVERLOADED, ErrorCode.DRAINING})


# ---------------------------------------------------------------- nested structs


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item as the client sent it: original compressed bytes.

    ``content_hash`` is the hex SHA-256 of ``data``; encoder-cache entries are
    keyed by it, and consistent-hash routing of encoders uses it.
    """

    mime_type: str
    data: bytes
    content_hash: str

    def __post_init__(self) -> None:
        require("/" in self.mime_type, f"mime_type {self.mime_type!r} is not type/subtype")
        require(self.content_hash != "", "content_hash must not be empty")

    @classmethod
    def from_bytes(cls, data: bytes, mime_type: str) -> MediaItem:
        """An item whose ``content_hash`` is computed from ``data``."""
        return cls(mime_type, data, hashlib.sha256(data).hexdigest())

    @property
    def modality(self) -> str:
        """``image``, ``audio`` or ``video``: the mime type's top-level type."""
        return self.mime_type.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn.  ``parts`` mixes text (str) and media references (int).

    An int part is an index into the request's ``media`` tuple, so the chat
    template can place each item where the client put it.  ``fields`` holds
    the message's other OpenAI keys, as the client sent them: ``name``,
    ``tool_calls`` of an assistant turn, ``tool_call_id`` of a tool result,
    ``reasoning_content``.
    """

    role: str
    parts: tuple[str | int, ...]
    fields: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of plain text, token ids, or chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.token_ids, self.messages))
        require(given == 1, "prompt needs exactly one of text, token_ids, messages")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters the router reads; ``None`` leaves the choice to the engine.

    A field the client did not set stays ``None`` and is not sent on: the
    engine applies its own default (vLLM: the model's generation config, and
    for ``max_tokens`` the rest of the context window).  ``top_k`` 0 or -1
    disables top-k, as in vLLM.  Every other vLLM sampling field travels in
    the stage request's ``options``.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1")
        require(self.temperature is None or self.temperature >= 0.0, "temperature must be >= 0")
        require(self.top_p is None or 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        require(self.top_k is None or self.top_k >= -1, "top_k must be >= -1")
        require(
            0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            "min_tokens must be in [0, max_tokens]",
        )
        require(self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One candidate token and its log-probability (``top_logprobs`` entries)."""

    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's load and readiness, carried on every :class:`Pong`.

    ``aborts`` counts the ``Abort`` messages the worker received since it
    started (all connections), so a router can see that aborts arrive.
    """

    running: int
    queued: int
    draining: bool
    engine_ready: bool
    aborts: int = 0


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Hello:
    """Client -> worker, first frame: protocol version and auth token."""

    TAG: ClassVar[str] = "hello"
    protocol_version: int
    auth_token: str
    client_id: str
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Welcome:
    """Worker -> client, answer to :class:`Hello`: who the worker is."""

    TAG: ClassVar[str] = "welcome"
    protocol_version: int
    worker_id: str
    role: str
    model: str
    capabilities: tuple[str, ...] = ()
    max_concurrency: int = 0
    request_id: str = ""

    def __post_init__(self) -> None:
        require(self.role in Role.__members__.values(), f"unknown role {self.role!r}")


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """Run the encoder on media items and store the results in the encoder cache.

    ``options`` carries the request's processing options that change what
    the encoder makes of an item (``mm_processor_kwargs``,
    ``media_io_kwargs``), named as in vLLM's OpenAI API; None, and left off
    the wire, when the request has none, so a worker that predates the field
    serves every other request as before.  An engine that cannot honour one
    refuses the request (``invalid_request``, ``param`` naming it).

    ``traceparent`` (on every stage request) is the W3C trace context of the
    router's attempt span, so the engine's own spans join the request's
    trace; None, and left off the wire, for an untraced attempt or a worker
    that does not announce :data:`TRACEPARENT_CAPABILITY`.
    """

    TAG: ClassVar[str] = "encode"
    request_id: str
    media: tuple[MediaItem, ...]
    ec_transfer_params: dict[str, object] | None = None
    options: dict[str, object] | None = None
    traceparent: str | None = None

    def __post_init__(self) -> None:
        require(len(self.media) >= 1, "encode needs at least one media item")


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """Prefill the prompt and hand the KV cache to a decoder (``kv_transfer_params``)."""

    TAG: ClassVar[str] = "prefill"
    request_id: str
    prompt: Prompt
    media: tuple[MediaItem, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: dict[str, object] | None = None
    options: dict[str, object] | None = None
    lora_adapter: str | None = None
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Stream output tokens.  D passes P's ``kv_transfer_params``; PD passes none.

    ``options`` (also on :class:`PrefillRequest`) carries the client's other
    vLLM request fields, checked by the router and named as in vLLM's OpenAI
    API (``frequency_penalty``, ``logit_bias``, ``response_format``,
    ``tools``, ``chat_template_kwargs``...; docs/http.md lists them).  An
    engine that cannot honour one refuses the request with
    ``invalid_request`` and ``param`` naming it; it never ignores one.

    ``lora_adapter`` (also on :class:`PrefillRequest`) names the LoRA adapter
    to apply, one the worker announced (``lora:NAME`` in its ``Welcome``
    capabilities); None, and left off the wire, for the base model.  A
    worker refuses an adapter it does not serve (``invalid_request``,
    ``param`` ``model``).
    """

    TAG: ClassVar[str] = "generate"
    request_id: str
    prompt: Prompt
    media: tuple[MediaItem, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: dict[str, object] | None = None
    options: dict[str, object] | None = None
    lora_adapter: str | None = None
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class StageResult:
    """Terminal answer of an encode or prefill request."""

    TAG: ClassVar[str] = "result"
    request_id: str
    kv_transfer_params: dict[str, object] | None = None
    ec_transfer_params: dict[str, object] | None = None
    prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@token_record
class Delta:
    """Some output tokens of a generate request; terminal when ``finish_reason`` is set.

    A worker may put several tokens in one delta (it should, under load).
    ``logprobs``, when requested, has one entry per token id; so do
    ``tokens`` (each sampled token's text) and ``top_logprobs`` (its
    alternatives), when the engine has them.  ``fields`` holds the other keys
    of an OpenAI chat delta the engine produced, such as ``tool_calls`` (the
    streamed tool-call pieces) or ``reasoning_content``.
    """

    TAG: ClassVar[str] = "delta"
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = None
    tokens: tuple[str, ...] | None = None
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None
    fields: dict[str, object] | None = None

    def __post_init__(self) -> None:
        # Tested inline rather than through ``require``: one is built per token.
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise LocalProtocolError("logprobs needs one entry per token id")
        if self.tokens is not None and len(self.tokens) != len(self.token_ids):
            raise LocalProtocolError("tokens needs one entry per token id")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise LocalProtocolError("top_logprobs needs one entry per token id")


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A typed failure: terminal for ``request_id``, or for the connection when ``""``."""

    TAG: ClassVar[str] = "error"
    request_id: str
    code: str
    message: str
    retryable: bool = False
    param: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop ``request_id``; the worker answers :class:`Aborted` once the engine has."""

    TAG: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True, slots=True)
class Aborted:
    """The engine no longer holds anything for ``request_id`` (idempotent)."""

    TAG: ClassVar[str] = "aborted"
    request_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """Free a prefilled KV handle that no decoder will consume."""

    TAG: ClassVar[str] = "release"
    request_id: str
    kv_transfer_params: dict[str, object]


@dataclass(frozen=True, slots=True)
class Released:
    """Answer to :class:`Release`; ``found`` is False when the handle was already gone."""

    TAG: ClassVar[str] = "released"
    request_id: str
    found: bool


@dataclass(frozen=True, slots=True)
class Ping:
    """Heartbeat probe; answered promptly even when the engine is saturated."""

    TAG: ClassVar[str] = "ping"
    nonce: int
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Pong:
    """Heartbeat answer with the worker's current load."""

    TAG: ClassVar[str] = "pong"
    nonce: int
    stats: WorkerStats
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """Client -> worker: no new requests will come on this connection."""

    TAG: ClassVar[str] = "drain"
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Worker -> client: draining; send nothing new, in-flight requests will finish."""

    TAG: ClassVar[str] = "goodbye"
    reason: str = ""
    request_id: str = ""


Message = (
    Hello
    | Welcome
    | EncodeRequest
    | PrefillRequest
    | GenerateRequest
    | StageResult
    | Delta
    | ErrorReply
    | Abort
    | Aborted
    | Release
    | Released
    | Ping
    | Pong
    | Drain
    | Goodbye
)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Welcome,
    EncodeRequest,
    PrefillRequest,
    GenerateRequest,
    StageResult,
    Delta,
    ErrorReply,
    Abort,
    Aborted,
    Release,
    Released,
    Ping,
    Pong,
    Drain,
    Goodbye,
)

StageRequest = EncodeRequest | PrefillRequest | GenerateRequest

STRUCTS_BY_TAG: dict[str, Struct] = {
    cls.TAG: compile_struct(cls, tag=cls.TAG) for cls in MESSAGE_TYPES
}
STRUCTS_BY_TYPE: dict[type, Struct] = {s.cls: s for s in STRUCTS_BY_TAG.values()}


def merge_deltas(deltas: list[Delta]) -> Delta:
    """Concatenate consecutive deltas of one request into a single delta.

    Token ids and text are concatenated in order; ``finish_reason``,
    ``usage`` and ``timings`` come from the last delta (only a terminal delta
    sets them, and it is always last).  A per-token array (``logprobs``,
    ``tokens``, ``top_logprobs``) survives only if every delta that carries
    tokens carries it.  ``fields`` are merged as a client would accumulate
    them (:func:`merge_delta_fields`).  Used to put every token already queued
    for a request into one frame.
    """
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    with_tokens = [delta for delta in deltas if delta.token_ids]
    fields: dict[str, object] | None = None
    for delta in deltas:
        if delta.fields:
            fields = merge_delta_fields(fields or {}, delta.fields)
    return Delta(
        request_id=last.request_id,
        token_ids=tuple(t for delta in deltas for t in delta.token_ids),
        text="".join(delta.text for delta in deltas),
        logprobs=_joined(with_tokens, "logprobs"),
        finish_reason=last.finish_reason,
        usage=last.usage,
        timings=last.timings,
        tokens=_joined(with_tokens, "tokens"),
        top_logprobs=_joined(with_tokens, "top_logprobs"),
        fields=fields,
    )


_PER_TOKEN: Final = ("logprobs", "tokens", "top_logprobs")


def deltas_mergeable(deltas: list[Delta]) -> bool:
    """Whether :func:`merge_deltas` keeps everything of ``deltas``.

    A per-token array that some of the deltas with tokens carry and others do
    not would be dropped by a merge; how a stream happens to be cut into reads
    must not change what its caller gets, so such deltas go on one by one.
    """
    with_tokens = [delta for delta in deltas if delta.token_ids]
    return all(
        len({getattr(delta, name) is None for delta in with_tokens}) < 2 for name in _PER_TOKEN
    )


def _joined(deltas: list[Delta], name: str) -> Any:
    """Delta attribute ``name`` (a per-token tuple) concatenated, or None unless all have it."""
    parts = [getattr(delta, name) for delta in deltas]
    if not parts or any(part is None for part in parts):
        return None
    return tuple(item for part in parts for item in part)


def merge_delta_fields(into: dict[str, object], new: dict[str, object]) -> dict[str, object]:
    """Add the chat-delta ``fields`` of a later delta to ``into`` (returned, not mutated).

    Strings are concatenated (``reasoning_content`` arrives in pieces);
    ``tool_calls`` pieces with the same ``index`` become one piece whose
    ``function.arguments`` strings are concatenated and whose first ``id``,
    ``type`` and ``function.name`` stand -- what an OpenAI client would have
    built from the two chunks; anything else takes the later value.
    """
    out = dict(into)
    for key, value in new.items():
        before = out.get(key)
        if isinstance(before, str) and isinstance(value, str):
            out[key] = before + value
        elif key == "tool_calls" and isinstance(before, list) and isinstance(value, list):
            out[key] = _merged_tool_calls(before, value)
        else:
            out[key] = value
    return out


def _merged_tool_calls(before: list[object], new: list[object]) -> list[object]:
    calls: list[object] = [dict(c) if isinstance(c, dict) else c for c in before]
    by_index = {c.get("index"): c for c in calls if isinstance(c, dict)}
    for piece in new:
        if not isinstance(piece, dict):
            calls.append(piece)
            continue
        known = by_index.get(piece.get("index"))
        if known is None:
            copy = dict(piece)
            by_index[piece.get("index")] = copy
            calls.append(copy)
            continue
        for key, value in piece.items():
            if key == "function" and isinstance(value, dict):
                known["function"] = _merged_function(known.get("function"), value)
            elif known.get(key) is None:
                known[key] = value
    return calls


def _merged_function(before: object, new: dict[str, object]) -> dict[str, object]:
    out = dict(before) if isinstance(before, dict) else {}
    for key, value in new.items():
        if key == "arguments" and isinstance(value, str):
            previous = out.get("arguments")
            out["arguments"] = (previous if isinstance(previous, str) else "") + value
        elif out.get(key) is None:
            out[key] = value
    return out
