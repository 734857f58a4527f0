"""vLLM's disaggregated-serving HTTP contract, sans-IO: request bodies out, replies and SSE in.

Theory of operation
-------------------
The router's stage requests carry a request as the router understood it -- a
:class:`~epd_actors.protocol.Prompt`, media items and sampling parameters --
not the client's JSON.  :func:`openai_request` rebuilds an OpenAI body from
them; it is the only place that conversion happens.  The stage rules of vLLM's
disaggregated contract (docs/deployment.md, DESIGN.md "The vLLM HTTP
contract") are then small transforms of that body:

* **E** (:func:`encode_call`): a chat request with exactly one media item and
  no text, ``max_tokens: 1``, ``stream: false``; header ``x-request-id:
  <request id>:<item>:<suffix>``.
* **P** (:func:`prefill_body`): the original body with the six-field
  remote-decode ``kv_transfer_params``, ``stream: false``, ``max_tokens: 1``
  (and ``max_completion_tokens: 1`` when present), no ``stream_options``, no
  ``min_tokens``; encoder transfer params merged in.
* **D / PD** (:func:`stream_body`): the original body streamed with
  ``stream_options.include_usage``, plus P's ``kv_transfer_params`` for D.
* **Release by consumption** (:func:`consume_body`): the D body, made
  one-token and non-streaming, so a decoder pulls (and thereby frees) blocks
  that no real decode will ever claim.

Replies: :func:`encode_result` and :func:`prefill_result` read E's and P's JSON
bodies; :class:`~epd_actors.http.sse.SseDecoder` splits a response byte stream into server-sent
events (bounded), and :class:`DeltaParser` turns vLLM's stream chunks into
protocol :class:`~epd_actors.protocol.Delta`s.  vLLM sends the finish reason in
one chunk and the usage in a later one, so the parser holds the finish reason
back until the usage chunk or ``[DONE]`` arrives and emits one terminal delta
with both.  Every event parsed from one network read is merged into a single
delta, so a burst of tokens costs the router one hand-off, not one per token.
A chunk of only text and token ids -- nearly every event -- need not be
parsed: with ``relay`` the parser recognises it with
:class:`~epd_actors.backends.openai_http.relay.ChunkScanner` and keeps vLLM's
JSON literal of the text with it, for the SSE front end to reuse.

Nothing here does I/O: :mod:`epd_actors.backends.openai_http.backend` sends the calls, through
:mod:`epd_actors.http.client`.
"""

from __future__ import annotations

import base64
import json
import json.scanner
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ...errors import InvalidRequest
from ...http.sse import DONE_DATA, SseError, SseEvent
from ...openai.engine_text import EngineText, joined_literal
from ...protocol import Delta, StageResult, TokenLogprob, Usage, merge_delta_fields
from .relay import ChunkScanner

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ...protocol import (
        ChatMessage,
        EncodeRequest,
        GenerateRequest,
        MediaItem,
        PrefillRequest,
        Prompt,
        SamplingParams,
    )

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"

_DATA_URL_PARTS: Final = {"image": "image_url", "audio": "audio_url", "video": "video_url"}
_INPUT_AUDIO_FORMATS: Final = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3"}
_JSON_WHITESPACE: Final = " \t\n\r"
# typeshed names the scanner class as make_scanner's argument; it takes a decoder.
_SCAN_JSON: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
"""The JSON decoder's own scanner: one value from a position, without ``loads``' wrapping."""

JsonObject = dict[str, object]


def remote_decode_params() -> JsonObject:
    """P's ``kv_transfer_params``: prefill here, decode elsewhere (vLLM's six fields)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One POST of the contract.

    Attributes:
        path: ``/v1/chat/completions`` or ``/v1/completions``.
        body: the JSON body.
        request_id: the ``x-request-id`` header.
    """

    path: str
    body: JsonObject
    request_id: str

    @property
    def chat(self) -> bool:
        return self.path == CHAT_PATH


# ---------------------------------------------------------------- the conversion


def openai_request(
    prompt: Prompt,
    media: tuple[MediaItem, ...],
    sampling: SamplingParams,
    *,
    model: str,
    return_token_ids: bool = True,
    options: Mapping[str, object] | None = None,
) -> tuple[str, JsonObject]:
    """Rebuild the OpenAI request of a stage request: ``(path, body)``.

    Chat prompts become ``/v1/chat/completions`` with every media item inline
    (``data:`` URLs, or ``input_audio`` for wav and mp3) where its index sits
    among the message's parts; text and token-id prompts become
    ``/v1/completions``.  A sampling field is written only when the client
    set it, so vLLM applies its own defaults (the model's generation config,
    the rest of the context for ``max_tokens``) to the others; the client's
    other fields (``options``) go in as they came.

    Args:
        prompt: text, token ids or chat messages.
        media: the items chat parts refer to by index.
        sampling: the request's sampling parameters.
        model: the served model name.
        return_token_ids: ask vLLM for the sampled token ids (``return_token_ids``;
            an older vLLM ignores the field).
        options: the client's engine fields, by name.

    Raises:
        InvalidRequest: media with a non-chat prompt, a part naming a missing
            item, or a media type vLLM cannot be sent.
    """
    body: JsonObject = {"model": model}
    if prompt.messages is not None:
        path = CHAT_PATH
        body["messages"] = [_message(message, media) for message in prompt.messages]
    else:
        if media:
            raise InvalidRequest(
                "media need a chat prompt when the worker is a vLLM server", param="media"
            )
        path = COMPLETIONS_PATH
        body["prompt"] = prompt.text if prompt.text is not None else list(prompt.token_ids or ())
    body.update(_sampling(sampling, chat=path == CHAT_PATH))
    echo = bool(options and options.get("echo"))
    if echo and sampling.logprobs is not None:
        # The stream below carries no token ids, and the relay takes logprobs only with them.
        raise InvalidRequest(
            "echo cannot be combined with logprobs when the worker is a vLLM server",
            param="echo",
        )
    if options:
        body.update(options)
    if return_token_ids and not echo:
        # vLLM 0.32 streams an echoed prompt only as prompt_token_ids when token ids are
        # asked for, its text left out of the chunks; without them the text comes whole.
        body["return_token_ids"] = True
    return path, body


def _message(message: ChatMessage, media: tuple[MediaItem, ...]) -> JsonObject:
    parts = message.parts
    if len(parts) == 1 and isinstance(parts[0], str):
        return {"role": message.role, "content": parts[0], **(message.fields or {})}
    if not parts and message.role in ("assistant", "tool"):
        return {"role": message.role, "content": None, **(message.fields or {})}
    content: list[object] = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif 0 <= part < len(media):
            content.append(media_part(media[part]))
        else:
            raise InvalidRequest(f"a chat part names media item {part}, which does not exist")
    return {"role": message.role, "content": content, **(message.fields or {})}


def media_part(item: MediaItem) -> JsonObject:
    """The chat content part that carries ``item`` inline.

    Raises:
        InvalidRequest: a modality vLLM's chat API has no part for.
    """
    payload = base64.b64encode(item.data).decode("ascii")
    audio_format = _INPUT_AUDIO_FORMATS.get(item.mime_type)
    if audio_format is not None:
        return {"type": "input_audio", "input_audio": {"data": payload, "format": audio_format}}
    kind = _DATA_URL_PARTS.get(item.modality)
    if kind is None:
        raise InvalidRequest(f"media type {item.mime_type!r} cannot be sent to a vLLM server")
    return {"type": kind, kind: {"url": f"data:{item.mime_type};base64,{payload}"}}


def _sampling(sampling: SamplingParams, *, chat: bool) -> JsonObject:
    fields: JsonObject = {}
    if sampling.max_tokens is not None:
        fields["max_tokens"] = sampling.max_tokens
    if sampling.temperature is not None:
        fields["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        fields["top_p"] = sampling.top_p
    if sampling.top_k is not None:
        fields["top_k"] = sampling.top_k
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    if sampling.min_tokens:
        fields["min_tokens"] = sampling.min_tokens
    if sampling.logprobs is not None:
        if chat:
            fields["logprobs"] = True
            if sampling.logprobs:
                fields["top_logprobs"] = sampling.logprobs
        else:
            fields["logprobs"] = sampling.logprobs
    return fields


# ---------------------------------------------------------------- stage rules


def _one_token(body: Mapping[str, object]) -> JsonObject:
    """``body`` answered in one non-streamed token: what P, E and a consume run."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def encode_call(request: EncodeRequest, index: int, *, model: str, suffix: str) -> HttpCall:
    """E's request for item ``index`` of ``request``: that item alone, no text.

    The header is ``<request_id>:<suffix>`` for a single-item request (the
    encode actor's request ids already end in ``:<item>``), else
    ``<request_id>:<index>:<suffix>``.  ``suffix`` differs per attempt, so a
    retry never reuses an id an encoder may still hold.  The request's
    processing options (``mm_processor_kwargs``, ``media_io_kwargs``) go in
    the body as the client sent them, as they go to P and D.
    """
    item = request.media[index]
    body: JsonObject = {
        "model": model,
        "messages": [{"role": "user", "content": [media_part(item)]}],
        "max_tokens": 1,
        "stream": False,
        **(request.options or {}),
    }
    if len(request.media) == 1:
        request_id = f"{request.request_id}:{suffix}"
    else:
        request_id = f"{request.request_id}:{index}:{suffix}"
    return HttpCall(CHAT_PATH, body, request_id)


def prefill_body(
    original: Mapping[str, object], ec_transfer_params: Mapping[str, object] | None = None
) -> JsonObject:
    """The P rules applied to any original body (see the module docstring)."""
    body = _one_token(original)
    body["kv_transfer_params"] = remote_decode_params()
    if ec_transfer_params:
        body["ec_transfer_params"] = dict(ec_transfer_params)
    return body


def stream_body(
    original: Mapping[str, object],
    *,
    kv_transfer_params: Mapping[str, object] | None = None,
    ec_transfer_params: Mapping[str, object] | None = None,
) -> JsonObject:
    """The D / PD rules: stream with usage, carrying P's KV and E's encoder params."""
    body = dict(original)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if ec_transfer_params:
        body["ec_transfer_params"] = dict(ec_transfer_params)
    return body


def consume_body(
    original: Mapping[str, object], kv_transfer_params: Mapping[str, object]
) -> JsonObject:
    """A decode request that only pulls P's KV blocks: one token, not streamed."""
    body = _one_token(original)
    body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def _original(
    request: PrefillRequest | GenerateRequest, model: str, return_token_ids: bool
) -> tuple[str, dict[str, object]]:
    """The client's request rebuilt from a stage request: (path, body)."""
    return openai_request(
        request.prompt,
        request.media,
        request.sampling,
        model=model,
        return_token_ids=return_token_ids,
        options=request.options,
    )


def prefill_call(request: PrefillRequest, *, model: str, return_token_ids: bool) -> HttpCall:
    """P's request: the rebuilt original body under :func:`prefill_body`."""
    path, body = _original(request, model, return_token_ids)
    return HttpCall(path, prefill_body(body, request.ec_transfer_params), request.request_id)


def generate_call(request: GenerateRequest, *, model: str, return_token_ids: bool) -> HttpCall:
    """D's or PD's request: the rebuilt original body under :func:`stream_body`."""
    path, body = _original(request, model, return_token_ids)
    streamed = stream_body(
        body,
        kv_transfer_params=request.kv_transfer_params,
        ec_transfer_params=request.ec_transfer_params,
    )
    return HttpCall(path, streamed, request.request_id)


# ---------------------------------------------------------------- replies


ReplyError = SseError
"""A reply that does not follow the contract (bad JSON, wrong types, a broken event
stream): the SSE decoder's own error, so that one ``except`` covers a reply and its events."""


def json_object(data: bytes | str) -> JsonObject:
    """Decode a JSON object.

    Raises:
        ReplyError: not JSON, or not an object.
    """
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReplyError(f"the reply is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ReplyError("the reply is not a JSON object")
    return value


def _event_object(text: str) -> JsonObject:
    """:func:`json_object` for one stream event, skipping ``json.loads``' layers.

    An event's data is a JSON object starting with ``{``; anything else, and
    every error, takes :func:`json_object`'s path, so the result and the
    error raised are the same.
    """
    if text[:1] == "{":
        try:
            value, end = _SCAN_JSON(text, 0)
        except (ValueError, StopIteration):
            pass
        else:
            if end == len(text) or not text[end:].strip(_JSON_WHITESPACE):
                return value  # type: ignore[no-any-return]
    return json_object(text)


def _optional_object(reply: Mapping[str, object], key: str) -> JsonObject | None:
    value = reply.get(key)
    if value is None or isinstance(value, dict):
        return value
    raise ReplyError(f"{key} must be an object or null")


def _usage(value: object) -> Usage | None:
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:
        raise ReplyError("usage needs integer prompt_tokens and completion_tokens")
    return Usage(prompt, completion)


def encode_result(request_id: str, reply: Mapping[str, object]) -> StageResult:
    """E's answer: its ``ec_transfer_params`` (may be absent)."""
    return StageResult(request_id, ec_transfer_params=_optional_object(reply, "ec_transfer_params"))


def prefill_result(request_id: str, reply: Mapping[str, object]) -> StageResult:
    """P's answer: its ``kv_transfer_params`` (null with shared-storage connectors)."""
    usage = _usage(reply.get("usage"))
    return StageResult(
        request_id,
        kv_transfer_params=_optional_object(reply, "kv_transfer_params"),
        prompt_tokens=0 if usage is None else usage.prompt_tokens,
    )


def error_message(data: bytes | str) -> str:
    """The message of a vLLM (or OpenAI) error body, or a short excerpt of the body."""
    try:
        reply = json_object(data)
    except ReplyError:
        text = data if isinstance(data, str) else data.decode("utf-8", "replace")
        return text[:200].strip()
    error = reply.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(reply.get("message"), str):
        return str(reply["message"])
    return json.dumps(reply)[:200]


def served_models(reply: Mapping[str, object]) -> tuple[str, ...]:
    """The model ids of a ``GET /v1/models`` answer (``{"data": [{"id": ...}, ...]}``).

    Raises:
        ReplyError: ``data`` is not a list of objects with a string ``id``.
    """
    cards = reply.get("data")
    if not isinstance(cards, list):
        raise ReplyError("a model list needs a data array")
    ids: list[str] = []
    for card in cards:
        ident = card.get("id") if isinstance(card, dict) else None
        if not isinstance(ident, str):
            raise ReplyError("every entry of a model list needs a string id")
        ids.append(ident)
    return tuple(ids)


def error_param(data: bytes | str) -> str | None:
    """The ``param`` a vLLM (or OpenAI) error body blames, if it names one."""
    return _error_field(data, "param")


def error_code(data: bytes | str) -> str | None:
    """The ``code`` a vLLM (or OpenAI) error body gives, if it gives a string one."""
    return _error_field(data, "code")


def _error_field(data: bytes | str, key: str) -> str | None:
    """A string field of an error body: ``{"error": {key: ...}}``, or the older flat body."""
    try:
        reply = json_object(data)
    except ReplyError:
        return None
    error = reply.get("error")
    found = error.get(key) if isinstance(error, dict) else reply.get(key)
    return found if isinstance(found, str) else None


# ---------------------------------------------------------------- server-sent events


class StreamFailed(Exception):
    """The worker reported an error inside the stream (``error`` data or event)."""


class DeltaParser:
    """vLLM stream chunks of one request -> protocol deltas (see the module docstring).

    Feed events with :meth:`feed`; :meth:`take` returns everything parsed so
    far as one delta (or None).  Once a finish reason has been seen, the
    terminal delta is released by the usage chunk, ``[DONE]`` or
    :meth:`end_of_stream`.

    What a chunk carries besides text and token ids: its ``logprobs`` entries
    (each token's text and logprob, and its alternatives), and the keys of a
    chat ``delta`` other than ``role`` and ``content`` (``tool_calls``,
    ``reasoning_content``, ``reasoning``) as ``fields``.  A per-token array
    is kept only while every chunk with token ids had it, one entry per id;
    ``fields`` of the chunks of one read merge as a client merges them
    (:func:`~epd_actors.protocol.merge_delta_fields`).  A chunk with only
    content and token ids -- nearly every chunk -- pays two dict look-ups
    for all of this.

    With ``relay``, such a chunk is not parsed at all: a
    :class:`~.relay.ChunkScanner` recognises it and the delta's text is an
    :class:`~epd_actors.openai.engine_text.EngineText` carrying the engine's
    string literal, for the SSE front end to write as it is (while every
    piece of the pending text came that way; one parsed piece makes it a
    plain ``str``).  The deltas are otherwise the same.

    Args:
        request_id: the request the deltas belong to.
        chat: chat chunks (``delta.content``) rather than completion chunks (``text``).
        relay: recognise text-only chunks without parsing them.
    """

    __slots__ = (
        "_chat",
        "_done",
        "_fields",
        "_finish",
        "_literals",
        "_logprobs",
        "_scanner",
        "_text",
        "_token_ids",
        "_tokens",
        "_tops",
        "_usage",
        "request_id",
        "terminal_sent",
    )

    def __init__(self, request_id: str, *, chat: bool, relay: bool = False) -> None:
        self.request_id = request_id
        self._chat = chat
        self._scanner = ChunkScanner(chat=chat) if relay else None
        self._text: list[str] = []
        # The engine's literals of the pending text; None once a piece was parsed.
        self._literals: list[str] | None = [] if relay else None
        self._token_ids: list[int] = []
        # Per-token arrays: None once a chunk with token ids came without them.
        self._logprobs: list[float] | None = []
        self._tokens: list[str] | None = []
        self._tops: list[tuple[TokenLogprob, ...]] | None = []
        self._fields: dict[str, object] | None = None
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._done = False
        self.terminal_sent = False

    def feed(self, events: list[SseEvent]) -> None:
        """Parse ``events`` into the pending delta.

        Raises:
            StreamFailed: the stream carried an error.
            ReplyError: a chunk that is not the shape vLLM sends.
        """
        scanner = self._scanner
        for event in events:
            data = event.data
            if data == DONE_DATA:
                self._done = True
                continue
            if self._done:
                continue
            # A text-only chunk is taken without parsing it (see ``relay``).
            found = None if scanner is None or event.event else scanner.scan(data)
            if found is not None:
                text, literal, ids = found
                if text:
                    self._text.append(text)
                    if self._literals is not None:
                        self._literals.append(literal)
                if ids is not None:
                    self._token_ids += map(int, ids.split(","))
                    self._logprobs = self._tokens = self._tops = None  # "logprobs":null
                continue
            # Another shape, or a bad escape in the text (the parse reports it).
            chunk = _event_object(data)
            if event.event == "error" or "error" in chunk or chunk.get("object") == "error":
                raise StreamFailed(error_message(data))
            self._chunk(chunk)

    def text_delta(self, data: str) -> Delta | None:
        """The delta of one text-only chunk's ``data``, built at once; None: :meth:`feed` it.

        For the common event (see ``relay``) while nothing is pending: the
        delta :meth:`feed` and :meth:`take` would make of it, without the
        pending lists in between.  None -- nothing done -- for any other
        event, while something is pending or the stream is past its finish
        reason, and for a chunk with neither text nor token ids.
        """
        scanner = self._scanner
        if (
            scanner is None
            or self._text
            or self._token_ids
            or self._fields is not None
            or self._finish is not None
            or self._done
            or self.terminal_sent
        ):
            return None
        found = scanner.scan(data)
        if found is None:
            return None
        text, literal, ids = found
        value: str
        if text:
            value = engine_text = EngineText(text)
            engine_text.json = literal
        elif ids is None:
            return None
        else:
            value = ""
        # With token ids, "logprobs":null leaves the per-token arrays out, as in ``_emit``.
        return Delta(self.request_id, () if ids is None else tuple(map(int, ids.split(","))), value)

    def _chunk(self, chunk: JsonObject) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            self._usage = _usage(usage) or self._usage
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise ReplyError("a stream chunk has no choices array")
        for choice in choices:
            if not isinstance(choice, dict):
                raise ReplyError("a stream choice is not an object")
            self._choice(choice)

    def _choice(self, choice: JsonObject) -> None:
        if self._chat:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if len(delta) > ("content" in delta) + ("role" in delta):
                    self._delta_fields(delta)
            else:
                text = None
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self._text.append(text)
            self._literals = None
        ids = choice.get("token_ids")
        new_ids = [t for t in ids if type(t) is int] if isinstance(ids, list) else []
        if new_ids:
            self._token_ids += new_ids
            self._per_token(choice.get("logprobs"), len(new_ids))
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self._finish = finish

    def _delta_fields(self, delta: JsonObject) -> None:
        """Keep a chat delta's keys other than ``role`` and ``content``."""
        extra = {key: value for key, value in delta.items() if key not in _OWN_DELTA_KEYS}
        if extra:
            self._fields = merge_delta_fields(self._fields or {}, extra)

    def _per_token(self, raw: object, count: int) -> None:
        """Add the ``logprobs`` entries of a chunk with ``count`` new token ids."""
        entries = None if raw is None else _chunk_entries(raw, chat=self._chat)
        if entries is None or len(entries[0]) != count:
            self._logprobs = self._tokens = self._tops = None
            return
        logprobs, tokens, tops = entries
        if self._logprobs is not None:
            self._logprobs += logprobs
        self._tokens = None if self._tokens is None or tokens is None else self._tokens + tokens
        self._tops = None if self._tops is None or tops is None else self._tops + tops

    def take(self) -> Delta | None:
        """The pending delta, if there is anything to hand on."""
        if self.terminal_sent:
            return None
        terminal = self._finish is not None and (self._usage is not None or self._done)
        if not terminal and not self._text and not self._token_ids and not self._fields:
            return None
        return self._emit(terminal)

    def end_of_stream(self) -> Delta | None:
        """The terminal delta at EOF, or None when the stream never finished."""
        if self.terminal_sent or self._finish is None:
            return None
        return self._emit(True)

    def _emit(self, terminal: bool) -> Delta:
        with_ids = bool(self._token_ids)
        text = "".join(self._text)
        literals = self._literals
        if literals:
            text = EngineText(text)
            text.json = literals[0] if len(literals) == 1 else joined_literal(literals)
        logprobs = tokens = tops = None  # per-token arrays: only with token ids
        if with_ids:
            if self._logprobs is not None:
                logprobs = tuple(self._logprobs)
            if self._tokens is not None:
                tokens = tuple(self._tokens)
            if self._tops is not None:
                tops = tuple(self._tops)
        delta = Delta(
            self.request_id,
            token_ids=tuple(self._token_ids),
            text=text,
            logprobs=logprobs,
            finish_reason=self._finish if terminal else None,
            usage=self._usage if terminal else None,
            tokens=tokens,
            top_logprobs=tops,
            fields=self._fields,
        )
        self._text, self._token_ids, self._fields = [], [], None
        self._literals = None if self._scanner is None else []
        self._logprobs, self._tokens, self._tops = [], [], []
        self.terminal_sent = terminal
        return delta


_OWN_DELTA_KEYS: Final = frozenset({"role", "content"})
"""Chat-delta keys the parser reads itself; every other key is a ``field``."""

_ChunkEntries = tuple[list[float], list[str] | None, list[tuple[TokenLogprob, ...]] | None]


def _chunk_entries(value: object, *, chat: bool) -> _ChunkEntries | None:
    """A chunk's ``logprobs``: (logprobs, tokens, alternatives); None if unreadable.

    Tokens or alternatives are None when an entry lacks them (or has the
    wrong types); the logprobs must all be numbers.
    """
    if not isinstance(value, dict):
        return None
    return _chat_entries(value) if chat else _completion_entries(value)


def _chat_entries(value: JsonObject) -> _ChunkEntries | None:
    """vLLM's chat shape: ``content: [{token, logprob, bytes, top_logprobs: [...]}]``."""
    content = value.get("content")
    if not isinstance(content, list):
        return None
    logprobs: list[float] = []
    tokens: list[str] = []
    tops: list[tuple[TokenLogprob, ...]] = []
    for entry in content:
        if not isinstance(entry, dict) or not _is_number(entry.get("logprob")):
            return None
        logprobs.append(float(entry["logprob"]))
        token = entry.get("token")
        if isinstance(token, str):
            tokens.append(token)
        top = _chat_alternatives(entry.get("top_logprobs"))
        if top is not None:
            tops.append(top)
    count = len(logprobs)
    return logprobs, tokens if len(tokens) == count else None, tops if len(tops) == count else None


def _chat_alternatives(value: object) -> tuple[TokenLogprob, ...] | None:
    if not isinstance(value, list):
        return None
    alternatives: list[TokenLogprob] = []
    for alt in value:
        if not isinstance(alt, dict):
            return None
        token, logprob = alt.get("token"), alt.get("logprob")
        if not isinstance(token, str) or not _is_number(logprob):
            return None
        alternatives.append(TokenLogprob(token, float(logprob)))  # type: ignore[arg-type]
    return tuple(alternatives)


def _completion_entries(value: JsonObject) -> _ChunkEntries | None:
    """vLLM's completion shape: ``tokens``, ``token_logprobs``, ``top_logprobs: [{token: lp}]``."""
    raw = value.get("token_logprobs")
    if not isinstance(raw, list) or not all(_is_number(x) for x in raw):
        return None
    logprobs = [float(x) for x in raw]
    tokens = value.get("tokens")
    known = (
        list(tokens)
        if isinstance(tokens, list)
        and len(tokens) == len(logprobs)
        and all(isinstance(t, str) for t in tokens)
        else None
    )
    return logprobs, known, _completion_alternatives(value.get("top_logprobs"), len(logprobs))


def _completion_alternatives(value: object, count: int) -> list[tuple[TokenLogprob, ...]] | None:
    if not isinstance(value, list) or len(value) != count:
        return None
    tops: list[tuple[TokenLogprob, ...]] = []
    for entry in value:
        if not isinstance(entry, dict) or not all(_is_number(lp) for lp in entry.values()):
            return None
        tops.append(tuple(TokenLogprob(str(t), float(lp)) for t, lp in entry.items()))
    return tops


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
