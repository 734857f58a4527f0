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
Fields it does not know are ignored: OpenAI clients send many.  Fields whose
silent omission would change the answer (``n > 1``, ``tools``, ``echo``,
``suffix``, ``best_of > 1``, a structured ``response_format``) are refused.

Chat content becomes :class:`~epd_actors.protocol.ChatMessage` parts: a ``str``
for text, an ``int`` index into the request's media for each media part, so
the template can put each item where the client put it.  Inline media
(``data:`` URLs, ``input_audio``) is decoded here; remote and local references
that :class:`~.media.MediaPolicy` allows stay :class:`~.media.PendingMedia`
until the front end awaits :func:`~.media.resolve_media`.

The result is a :class:`ParsedRequest`: the generation request plus what the
response needs (``stream``, ``include_usage``, ``model``, ``kind``,
``logprobs``, ``n``).  The response side -- bodies, SSE chunks, error bodies --
lives in :mod:`.openai_format` and is re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Literal, TypeVar

from ..errors import InvalidRequest
from ..protocol import ChatMessage, MediaItem, Prompt, SamplingParams
from ..request import GenerationRequest
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
from .openai_format import (
    SseFormatter,
    error_body,
    response_body,
    response_id,
    unix_time,
    usage_body,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_TOKENS_CEILING",
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

RequestKind = Literal["chat", "completion"]

DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
"""``max_tokens`` of a completion that names none (OpenAI's documented default)."""

DEFAULT_CHAT_MAX_TOKENS: Final = 1024
"""``max_tokens`` of a chat request that names none.  OpenAI lets the model's
context decide; a router cannot know it, so it picks a bounded default."""

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
        top_logprobs: alternatives per token asked for (served as empty lists).
        n: choices asked for (always 1: other values are refused).
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

    @property
    def pending(self) -> tuple[PendingMedia, ...]:
        """Media references still to load with :func:`~.media.resolve_media`."""
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
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body.

    Args:
        body: the decoded JSON body.
        request_id: the id the router will use.
        limits: media bounds and the URL/path allow-list.
        session_key: the ``x-session-id`` header, if any (wins over ``user``).
        default_max_tokens: used when the body names no token limit.

    Raises:
        InvalidRequest: the first problem found; ``param`` names the field.
    """
    fields = _object(body)
    budget = MediaBudget(limits)
    media: list[MediaSlot] = []
    messages = _messages(fields.get("messages"), media, budget)
    _refuse_unsupported(fields, ("tools", "functions"))
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
        default_max_tokens=default_max_tokens,
        logprobs=(top or 0) if logprobs else None,
    )


def parse_completion(
    body: object,
    *,
    request_id: str,
    limits: MediaLimits,
    session_key: str | None = None,
    default_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS,
) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (``prompt``: text or token ids, not a batch).

    Args:
        body: the decoded JSON body.
        request_id: the id the router will use.
        limits: accepted for symmetry with chat (completions carry no media).
        session_key: the ``x-session-id`` header, if any (wins over ``user``).
        default_max_tokens: used when the body names no ``max_tokens``.

    Raises:
        InvalidRequest: the first problem found; ``param`` names the field.
    """
    del limits
    fields = _object(body)
    prompt = _completion_prompt(fields.get("prompt"))
    if _optional(fields, "echo", _boolean):
        raise InvalidRequest("echo is not supported", param="echo")
    if fields.get("suffix") is not None:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if (_optional(fields, "best_of", _int_in(1, MAX_TOKENS_CEILING)) or 1) > 1:
        raise InvalidRequest("best_of > 1 is not supported", param="best_of")
    return _finish(
        fields,
        kind="completion",
        prompt=prompt,
        media=(),
        request_id=request_id,
        session_key=session_key,
        max_tokens=_optional(fields, "max_tokens", _int_in(1, MAX_TOKENS_CEILING)),
        default_max_tokens=default_max_tokens,
        logprobs=_optional(fields, "logprobs", _int_in(0, MAX_TOP_LOGPROBS)),
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
    default_max_tokens: int,
    logprobs: int | None,
) -> ParsedRequest:
    model = _required(fields, "model", _string(MAX_KEY_CHARS))
    n = _optional(fields, "n", _int_in(1, MAX_TOKENS_CEILING)) or 1
    if n != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    stream = _optional(fields, "stream", _boolean) or False
    include_usage = _stream_options(fields.get("stream_options"), stream=stream)
    user = _optional(fields, "user", _string(MAX_KEY_CHARS))
    _refuse_structured_output(fields.get("response_format"))
    sampling = _sampling(fields, max_tokens or default_max_tokens, logprobs)
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
    )


def _sampling(fields: dict[str, object], max_tokens: int, logprobs: int | None) -> SamplingParams:
    min_tokens = _optional(fields, "min_tokens", _int_in(0, MAX_TOKENS_CEILING)) or 0
    if min_tokens > max_tokens:
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
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=_optional(fields, "top_k", _int_in(-1, MAX_TOKENS_CEILING)) or 0,
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
    return _optional(options, "include_usage", _boolean, prefix="stream_options.") or False


def _refuse_structured_output(value: object) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "text":
        raise InvalidRequest(
            "only response_format type 'text' is supported", param="response_format"
        )


def _refuse_unsupported(fields: dict[str, object], names: Sequence[str]) -> None:
    for name in names:
        if fields.get(name):
            raise InvalidRequest(f"{name} is not supported by this server", param=name)


# ---------------------------------------------------------------- chat messages


def _messages(
    value: object, media: list[MediaSlot], budget: MediaBudget
) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages are allowed", param="messages")
    return tuple(
        _message(message, f"messages[{index}]", media, budget)
        for index, message in enumerate(value)
    )


def _message(value: object, param: str, media: list[MediaSlot], budget: MediaBudget) -> ChatMessage:
    message = _object(value, param)
    raw_role = message.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise InvalidRequest(
            "role must be one of system, developer, user, assistant, tool", param=f"{param}.role"
        )
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        return ChatMessage(role, ())
    if isinstance(content, str):
        return ChatMessage(role, (content,))
    if not isinstance(content, list):
        raise InvalidRequest(
            "content must be a string or an array of parts", param=f"{param}.content"
        )
    parts = [
        _part(part, f"{param}.content[{index}]", role, media, budget)
        for index, part in enumerate(content)
    ]
    return ChatMessage(role, tuple(parts))


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
