"""OpenAI request bodies -> :class:`~epd_actors.request.GenerationRequest`; pure and synchronous.

Theory of operation
-------------------
A front end decodes the JSON body itself and hands the resulting object to
:func:`parse_chat_completion` or :func:`parse_completion`, together with the
request id it chose and the session key it read from ``x-session-id``.  The
parser checks every field it understands -- type, range, and the combinations
OpenAI forbids -- and raises :class:`~epd_actors.errors.InvalidRequest` with
``param`` naming the first offending field as a dotted path
(``messages[0].content[1].image_url``, ``stream_options.include_usage``).
Every other field goes through the table of :mod:`epd_actors.openai.fields`: carried to
the engine in the request's ``options``, or refused naming it; none is
dropped.  What the client leaves unset stays unset (``None``), so the engine
applies its own defaults: the router adds no sampling default, no
``max_tokens`` and no stop condition of its own.

Chat content becomes :class:`~epd_actors.protocol.ChatMessage` parts: a ``str``
for text, an ``int`` index into the request's media for each media part, so
the template can put each item where the client put it.  Inline media
(``data:`` URLs, ``input_audio``) is decoded here; remote and local references
that :class:`~.media.MediaPolicy` allows stay :class:`~.media.PendingMedia`
until the front end awaits :func:`~epd_actors.frontends.media_fetch.resolve_media`.

The result is a :class:`ParsedRequest`: the generation request plus what the
response needs (``stream``, ``include_usage``, ``model``, ``kind``,
``logprobs``, ``n``).  Chat messages keep their other keys (``tool_calls``,
``tool_call_id``, ``name``) in :attr:`ChatMessage.fields`.  The response
side -- bodies, SSE chunks, error bodies -- lives in :mod:`epd_actors.openai.format`
and is re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, TypeVar

from ..errors import InvalidRequest
from ..protocol import ChatMessage, MediaItem, Prompt, SamplingParams
from ..request import GenerationRequest
from .fields import (
    STRICT_FIELDS,
    FieldPolicy,
    RequestKind,
    engine_options,
    list_of,
    string,
)
from .format import (
    SseFormatter,
    error_body,
    response_body,
    response_id,
    unix_time,
    usage_body,
)
from .media import (
    MediaBudget,
    MediaLimits,
    MediaPolicy,
    MediaSlot,
    PendingMedia,
    classify_reference,
    decode_base64,
    pending_items,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "MAX_TOKENS_CEILING",
    "FieldPolicy",
    "MediaLimits",
    "MediaPolicy",
    "ParsedRequest",
    "PendingMedia",
    "RequestKind",
    "SseFormatter",
    "error_body",
    "parse_chat_completion",
    "parse_completion",
    "response_body",
    "response_id",
    "unix_time",
    "usage_body",
]

MAX_TOKENS_CEILING: Final = 1 << 20
"""Largest accepted ``max_tokens`` (tokens); anything above is a client bug."""

MAX_MESSAGES: Final = 4096
"""Chat messages per request."""

MAX_STOP_SEQUENCES: Final = 16
"""Entries of ``stop``."""

MAX_TOP_LOGPROBS: Final = 20
"""Largest ``top_logprobs`` (chat) or ``logprobs`` (completions)."""

MAX_KEY_CHARS: Final = 256
"""Characters of ``model`` and of the session key."""

_ROLES: Final[dict[str, str]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MEDIA_PARTS: Final = {"image_url": "image", "audio_url": "audio", "video_url": "video"}
_AUDIO_FORMATS: Final = {"wav": "audio/wav", "mp3": "audio/mpeg"}
_INT64: Final = 1 << 63
_T = TypeVar("_T")
_TOKEN_ID_LIMIT: Final = 1 << 31


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request: what to generate and how to answer.

    Attributes:
        kind: ``chat`` (``/v1/chat/completions``) or ``completion`` (``/v1/completions``).
        model: the model the client named.
        prompt: chat messages, text, or token ids.
        media: media items in prompt order; :class:`PendingMedia` until resolved.
        sampling: sampling parameters.
        request_id: the router request id.
        session_key: affinity key (``x-session-id`` header, else the ``user`` field).
        priority: admission priority (``x-epd-priority`` header): high, normal, low.
        stream: answer with server-sent events.
        include_usage: streaming: send a usage chunk before ``[DONE]``.
        logprobs: the client asked for log-probabilities.
        top_logprobs: alternatives per token asked for.
        n: choices asked for (always 1: other values are refused).
        options: the body's engine fields (:mod:`epd_actors.openai.fields`), checked.
        traceparent: the client's W3C ``traceparent`` header (tracing).
    """

    kind: RequestKind
    model: str
    prompt: Prompt
    media: tuple[MediaSlot, ...]
    sampling: SamplingParams
    request_id: str
    session_key: str | None = None
    priority: str = "normal"
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    options: dict[str, object] | None = None
    traceparent: str | None = None

    @property
    def pending(self) -> tuple[PendingMedia, ...]:
        """Media references the front end must still load (``resolve_media``)."""
        return pending_items(self.media)

    @property
    def request(self) -> GenerationRequest:
        """The request to hand the router.

        Raises:
            RuntimeError: media are still pending (a front-end bug: resolve first).
        """
        items = tuple(slot for slot in self.media if isinstance(slot, MediaItem))
        if len(items) != len(self.media):
            raise RuntimeError("resolve_media() must load pending media before the request runs")
        return GenerationRequest(
            self.prompt,
            media=items,
            sampling=self.sampling,
            request_id=self.request_id,
            session_key=self.session_key,
            priority=self.priority,
            options=self.options,
            model=self.model,
            traceparent=self.traceparent,
        )

    def with_media(self, items: tuple[MediaItem, ...]) -> ParsedRequest:
        """This request with its media slots replaced by loaded ``items`` (same order)."""
        if len(items) != len(self.media):
            raise ValueError(f"expected {len(self.media)} media items, got {len(items)}")
        return replace(self, media=items)


def parse_chat_completion(
    body: object,
    *,
    request_id: str,
    limits: MediaLimits,
    session_key: str | None = None,
    policy: FieldPolicy = STRICT_FIELDS,
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body.

    Args:
        body: the decoded JSON body.
        request_id: the id the router will use.
        limits: media bounds and the URL/path allow-list.
        session_key: the ``x-session-id`` header, if any (wins over ``user``).
        policy: what to do with unknown fields (:class:`FieldPolicy`).

    Raises:
        InvalidRequest: the first problem found; ``param`` names the field.
    """
    fields = _object(body)
    budget = MediaBudget(limits)
    media: list[MediaSlot] = []
    messages = _messages(fields.get("messages"), media, budget, policy)
    logprobs = _optional(fields, "logprobs", _boolean) or False
    top = _optional(fields, "top_logprobs", _int_in(0, MAX_TOP_LOGPROBS))
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    limit_key = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    return _finish(
        fields,
        kind="chat",
        prompt=Prompt(messages=messages),
        media=tuple(media),
        request_id=request_id,
        session_key=session_key,
        max_tokens=_optional(fields, limit_key, _int_in(1, MAX_TOKENS_CEILING)),
        logprobs=(top or 0) if logprobs else None,
        policy=policy,
    )


def parse_completion(
    body: object,
    *,
    request_id: str,
    limits: MediaLimits,
    session_key: str | None = None,
    policy: FieldPolicy = STRICT_FIELDS,
) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (``prompt``: text or token ids, not a batch).

    Args:
        body: the decoded JSON body.
        request_id: the id the router will use.
        limits: accepted for symmetry with chat (completions carry no media).
        session_key: the ``x-session-id`` header, if any (wins over ``user``).
        policy: what to do with unknown fields (:class:`FieldPolicy`).

    Raises:
        InvalidRequest: the first problem found; ``param`` names the field.
    """
    del limits
    fields = _object(body)
    prompt = _completion_prompt(fields.get("prompt"))
    return _finish(
        fields,
        kind="completion",
        prompt=prompt,
        media=(),
        request_id=request_id,
        session_key=session_key,
        max_tokens=_optional(fields, "max_tokens", _int_in(1, MAX_TOKENS_CEILING)),
        logprobs=_optional(fields, "logprobs", _int_in(0, MAX_TOP_LOGPROBS)),
        policy=policy,
    )


# ---------------------------------------------------------------- shared fields


def _finish(
    fields: dict[str, object],
    *,
    kind: RequestKind,
    prompt: Prompt,
    media: tuple[MediaSlot, ...],
    request_id: str,
    session_key: str | None,
    max_tokens: int | None,
    logprobs: int | None,
    policy: FieldPolicy,
) -> ParsedRequest:
    model = _required(fields, "model", _string(MAX_KEY_CHARS))
    n = _optional(fields, "n", _int_in(1, MAX_TOKENS_CEILING)) or 1
    if n != 1:
        raise InvalidRequest("n > 1 is not supported: send one request per choice", param="n")
    stream = _optional(fields, "stream", _boolean) or False
    include_usage = _stream_options(fields.get("stream_options"), stream=stream)
    user = _optional(fields, "user", _string(MAX_KEY_CHARS))
    sampling = _sampling(fields, max_tokens, logprobs)
    options = engine_options(fields, kind, policy)
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        media=media,
        sampling=sampling,
        request_id=request_id,
        session_key=session_key or user or None,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        n=n,
        options=options or None,
    )


def _sampling(
    fields: dict[str, object], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    min_tokens = _optional(fields, "min_tokens", _int_in(0, MAX_TOKENS_CEILING)) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    temperature = _optional(fields, "temperature", _number_in(0.0, 2.0))
    top_p = _optional(fields, "top_p", _number_in(0.0, 1.0))
    if top_p is not None and top_p <= 0.0:
        raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_optional(fields, "top_k", _int_in(-1, MAX_TOKENS_CEILING)),
        stop=_stop(fields.get("stop")),
        seed=_optional(fields, "seed", _int_in(-_INT64, _INT64 - 1)),
        min_tokens=min_tokens,
        logprobs=logprobs,
    )


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop must be a string or an array of at most {MAX_STOP_SEQUENCES} strings",
            param="stop",
        )
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise InvalidRequest("stop sequences must be non-empty strings", param=f"stop[{index}]")
    return tuple(value)


def _stream_options(value: object, *, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    options = _object(value, "stream_options")
    for key, item in options.items():
        if key == "include_usage" or item is None:
            continue
        if key == "continuous_usage_stats":
            if _boolean(item, "stream_options.continuous_usage_stats"):
                raise InvalidRequest(
                    "usage in every chunk is not relayed by the router: its streams carry "
                    "usage in the last chunk (include_usage)",
                    param="stream_options.continuous_usage_stats",
                )
            continue
        raise InvalidRequest(
            f"unknown stream option {key!r}",
            param=f"stream_options.{key}",
            code="unknown_parameter",
        )
    return _optional(options, "include_usage", _boolean, prefix="stream_options.") or False


# ---------------------------------------------------------------- chat messages


def _messages(
    value: object, media: list[MediaSlot], budget: MediaBudget, policy: FieldPolicy
) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages are allowed", param="messages")
    return tuple(
        _message(message, f"messages[{index}]", media, budget, policy)
        for index, message in enumerate(value)
    )


def _message(
    value: object, param: str, media: list[MediaSlot], budget: MediaBudget, policy: FieldPolicy
) -> ChatMessage:
    message = _object(value, param)
    raw_role = message.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise InvalidRequest(
            "role must be one of system, developer, user, assistant, tool", param=f"{param}.role"
        )
    fields = _message_fields(message, role, param, policy) or None
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        return ChatMessage(role, (), fields)
    if isinstance(content, str):
        return ChatMessage(role, (content,), fields)
    if not isinstance(content, list):
        raise InvalidRequest(
            "content must be a string or an array of parts", param=f"{param}.content"
        )
    parts = [
        _part(part, f"{param}.content[{index}]", role, media, budget)
        for index, part in enumerate(content)
    ]
    return ChatMessage(role, tuple(parts), fields)


def _message_fields(
    message: dict[str, object], role: str, param: str, policy: FieldPolicy
) -> dict[str, object]:
    """A message's keys besides ``role`` and ``content``, checked; unknown ones refused."""
    fields: dict[str, object] = {}
    for key, value in message.items():
        if value is None or key in ("role", "content"):
            continue
        where = f"{param}.{key}"
        check = _MESSAGE_FIELDS.get(key)
        if check is not None:
            roles, checker = check
            if role not in roles:
                raise InvalidRequest(
                    f"{key} is only allowed in {' or '.join(sorted(roles))} messages", param=where
                )
            fields[key] = checker(value, where)
        elif policy.unknown == "forward":
            fields[key] = value
        elif policy.unknown == "ignore":
            continue
        else:
            raise InvalidRequest(
                f"unknown message field {key!r}", param=where, code="unknown_parameter"
            )
    return fields


def _tool_call(value: object, param: str) -> object:
    call = _object(value, param)
    _required(call, "id", _string(None), prefix=f"{param}.")
    if call.get("type", "function") != "function":
        raise InvalidRequest("tool call type must be 'function'", param=f"{param}.type")
    function = _object(call.get("function"), f"{param}.function")
    _required(function, "name", _string(None), prefix=f"{param}.function.")
    _required(function, "arguments", _string(None), prefix=f"{param}.function.")
    return call


_ANY_ROLE: Final = frozenset(_ROLES.values())
_MESSAGE_FIELDS: Final[dict[str, tuple[frozenset[str], Callable[[object, str], object]]]] = {
    "name": (_ANY_ROLE, string),
    "tool_calls": (frozenset({"assistant"}), list_of(_tool_call, MAX_MESSAGES)),
    "tool_call_id": (frozenset({"tool"}), string),
    "reasoning_content": (frozenset({"assistant"}), string),
    "reasoning": (frozenset({"assistant"}), string),
}
"""Message keys forwarded in :attr:`ChatMessage.fields`: the roles that may carry them, a check."""


def _part(
    value: object, param: str, role: str, media: list[MediaSlot], budget: MediaBudget
) -> str | int:
    part = _object(value, param)
    raw_kind = part.get("type")
    kind = raw_kind if isinstance(raw_kind, str) else ""
    if kind == "text":
        return _required(part, "text", _string(None), prefix=f"{param}.")
    if kind in _MEDIA_PARTS or kind == "input_audio":
        if role != "user":
            raise InvalidRequest(
                f"{kind} parts are only allowed in user messages", param=f"{param}.type"
            )
        media.append(_media_part(part, kind, f"{param}.{kind}", budget))
        return len(media) - 1
    raise InvalidRequest(
        "part type must be text, image_url, audio_url, video_url or input_audio",
        param=f"{param}.type",
    )


def _media_part(part: dict[str, object], kind: str, param: str, budget: MediaBudget) -> MediaSlot:
    body = _object(part.get(kind), param)
    if kind == "input_audio":
        budget.take_item(param)
        data = _required(body, "data", _string(None), prefix=f"{param}.")
        fmt = body.get("format")
        mime = _AUDIO_FORMATS.get(fmt) if isinstance(fmt, str) else None
        if mime is None:
            raise InvalidRequest("format must be 'wav' or 'mp3'", param=f"{param}.format")
        return decode_base64(data, mime, budget=budget, param=f"{param}.data")
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest("url must be a non-empty string", param=f"{param}.url")
    return classify_reference(url, _MEDIA_PARTS[kind], budget=budget, param=param)


# ---------------------------------------------------------------- completions prompt


def _completion_prompt(value: object) -> Prompt:
    if isinstance(value, str):
        return Prompt(text=value)
    if not isinstance(value, list) or not value:
        raise InvalidRequest("prompt must be a string or an array of token ids", param="prompt")
    if all(isinstance(item, str) for item in value) or all(
        isinstance(item, list) for item in value
    ):
        if len(value) > 1:
            raise InvalidRequest(
                "batched prompts are not supported: send one request per prompt", param="prompt"
            )
        inner = value[0]
        return Prompt(text=inner) if isinstance(inner, str) else _completion_prompt_ids(inner)
    return _completion_prompt_ids(value)


def _completion_prompt_ids(value: list[object]) -> Prompt:
    for index, item in enumerate(value):
        if type(item) is not int or not 0 <= item < _TOKEN_ID_LIMIT:
            raise InvalidRequest(
                f"token ids must be integers in [0, {_TOKEN_ID_LIMIT})", param=f"prompt[{index}]"
            )
    if not value:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return Prompt(token_ids=tuple(value))  # type: ignore[arg-type]


# ---------------------------------------------------------------- field checkers


def _object(value: object, param: str | None = None) -> dict[str, object]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param or 'the request body'} must be a JSON object", param=param)
    return value


def _optional(
    fields: dict[str, object], key: str, check: Callable[[object, str], _T], *, prefix: str = ""
) -> _T | None:
    value = fields.get(key)
    return None if value is None else check(value, prefix + key)


def _required(
    fields: dict[str, object], key: str, check: Callable[[object, str], _T], *, prefix: str = ""
) -> _T:
    value = fields.get(key)
    if value is None:
        raise InvalidRequest(f"{prefix + key} is required", param=prefix + key)
    return check(value, prefix + key)


def _boolean(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{param} must be true or false", param=param)
    return value


def _int_in(low: int, high: int) -> Callable[[object, str], int]:
    def check(value: object, param: str) -> int:
        if type(value) is not int or not low <= value <= high:
            raise InvalidRequest(f"{param} must be an integer in [{low}, {high}]", param=param)
        return value

    return check


def _number_in(low: float, high: float) -> Callable[[object, str], float]:
    def check(value: object, param: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{param} must be a number", param=param)
        number = float(value)
        if not (math.isfinite(number) and low <= number <= high):
            raise InvalidRequest(f"{param} must be in [{low:g}, {high:g}]", param=param)
        return number

    return check


def _string(max_chars: int | None) -> Callable[[object, str], str]:
    def check(value: object, param: str) -> str:
        if not isinstance(value, str):
            raise InvalidRequest(f"{param} must be a string", param=param)
        if max_chars is not None and not 0 < len(value) <= max_chars:
            raise InvalidRequest(f"{param} must have 1 to {max_chars} characters", param=param)
        return value

    return check
