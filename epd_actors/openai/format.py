"""OpenAI response shapes: completion bodies, SSE chunks, error bodies.

Theory of operation
-------------------
Non-streaming answers are built as dicts and encoded once per response.
Streaming is per token, so its cost decides the front end's: building a chunk
dict and ``json.dumps``-ing it for every delta was measured as the dominant
cost of a streamed request.  :class:`SseFormatter` therefore renders, once per
request, the JSON *around* the delta text -- ``data: {"id":...,"choices":[{
"index":0,"delta":{"content":`` and ``},"logprobs":null,"finish_reason":null}]}``
plus the blank line -- and each delta is ``prefix + json.dumps(text) + suffix``.
The result is byte-for-byte the compact JSON of the equivalent dict, framed
as :func:`epd_actors.http.sse.encode_event` frames one line of data (the
templates are built from its ``DATA_PREFIX`` and ``EVENT_END``; comments,
``error`` events and ``[DONE]`` come from that module as they are).

Text that came from ``vllm serve`` with its JSON string literal
(:class:`~.engine_text.EngineText`) is written as that literal, not encoded
again.

Log-probabilities and chat-delta ``fields`` (``tool_calls`` pieces,
``reasoning_content``) take the slower dict path: they are rare and
structured.  Each logprob entry is rendered in vLLM's shape: the token's text
and its UTF-8 ``bytes`` when the engine gave the text (``tokens``), else
``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids`` form) and no bytes;
the alternatives (``top_logprobs``) as the engine listed them, as a list of
``{token, logprob, bytes}`` (chat) or a ``{token: logprob}`` map per token
(completions).  A non-streamed answer (:class:`AnswerBuilder`) is what a
client accumulating the stream would have: the text, every logprob entry, and
the chat ``fields`` merged as :func:`~epd_actors.protocol.merge_delta_fields`
merges them (``tool_calls`` pieces per ``index``).
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Final, Literal, Protocol

from ..http.sse import DATA_PREFIX, DONE_EVENT, EVENT_END, encode_comment, encode_event
from ..protocol import merge_delta_fields
from .engine_text import EngineText

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ..protocol import TokenLogprob, Usage
    from ..request import DeltaEvent

Kind = Literal["chat", "completion"]


class OutputPiece(Protocol):
    """What an answer is built from: a router ``DeltaEvent`` or a wire ``Delta`` alike."""

    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float] | None: ...
    @property
    def tokens(self) -> Sequence[str] | None: ...
    @property
    def top_logprobs(self) -> Sequence[tuple[TokenLogprob, ...]] | None: ...
    @property
    def fields(self) -> dict[str, object] | None: ...


MIN_LOGPROB: Final = -9999.0
"""The lowest logprob written (vLLM's floor: JSON has no ``-Infinity``)."""


compact_json: Final[Callable[[object], str]] = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False
).encode
"""JSON without spaces, non-ASCII as it is: an SSE chunk's body, a WebSocket text message,
a JSON answer.  One encoder serves every call (``json.dumps`` with arguments builds one
per call)."""

_json_string: Final[Callable[[str], str]] = json.encoder.encode_basestring
"""A ``str`` as a JSON string literal, as ``compact_json`` writes it (the standard library's C
function, called directly: a token's text is rendered this way once per event)."""


def _text_json(text: str) -> str:
    """``text`` as a JSON string: the engine's own literal when it came with one."""
    return text.json if type(text) is EngineText else _json_string(text)


def unix_time() -> int:
    """Seconds since the epoch, for the ``created`` field.

    This is the only wall-clock read of the front ends, on purpose: ``created``
    is a calendar timestamp shown to clients; nothing is timed with it (all
    durations use ``trio.current_time()``).
    """
    return int(datetime.datetime.now(datetime.UTC).timestamp())


def response_id(kind: Kind, request_id: str) -> str:
    """The OpenAI ``id`` of a response: ``chatcmpl-<request id>`` or ``cmpl-<request id>``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def usage_body(usage: Usage) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def logprobs_body(
    kind: Kind,
    token_ids: Sequence[int],
    logprobs: Sequence[float] | None,
    tokens: Sequence[str | None] | None = None,
    top_logprobs: Sequence[Sequence[TokenLogprob] | None] | None = None,
) -> dict[str, object] | None:
    """The ``logprobs`` object of a choice (None when there are none).

    Args:
        kind: ``chat`` or ``completion`` (vLLM's two shapes).
        token_ids: the sampled tokens.
        logprobs: their log-probabilities, one per token id.
        tokens: their texts (an entry or the whole may be unknown: None).
        top_logprobs: their alternatives (likewise).
    """
    if logprobs is None:
        return None
    texts = [_token_text(token_ids, tokens, i) for i in range(len(token_ids))]
    tops = [None if top_logprobs is None else top_logprobs[i] for i in range(len(token_ids))]
    if kind == "chat":
        return {
            "content": [
                _chat_entry(token, known, value, top)
                for token, known, value, top in zip(
                    texts, _known(tokens, len(token_ids)), logprobs, tops, strict=True
                )
            ]
        }
    return {
        "tokens": texts,
        "token_logprobs": [max(value, MIN_LOGPROB) for value in logprobs],
        "top_logprobs": _completion_tops(tops),
    }


def _token_text(token_ids: Sequence[int], tokens: Sequence[str | None] | None, i: int) -> str:
    known = None if tokens is None else tokens[i]
    return f"token_id:{token_ids[i]}" if known is None else known


def _known(tokens: Sequence[str | None] | None, count: int) -> list[bool]:
    if tokens is None:
        return [False] * count
    return [token is not None for token in tokens]


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def _chat_entry(
    token: str, known: bool, value: float, top: Sequence[TokenLogprob] | None
) -> dict[str, object]:
    return {
        "token": token,
        "logprob": max(value, MIN_LOGPROB),
        "bytes": _utf8(token) if known else None,
        "top_logprobs": [
            {
                "token": alt.token,
                "logprob": max(alt.logprob, MIN_LOGPROB),
                "bytes": _utf8(alt.token),
            }
            for alt in top or ()
        ],
    }


def _completion_tops(
    tops: Sequence[Sequence[TokenLogprob] | None],
) -> list[dict[str, float] | None] | None:
    if all(top is None for top in tops):
        return None
    return [
        None if top is None else {alt.token: max(alt.logprob, MIN_LOGPROB) for alt in top}
        for top in tops
    ]


ToolForcing = Literal["named", "required"]
"""How a request's ``tool_choice`` forces tool calls: one named function, or ``required``."""


def tool_forcing(options: Mapping[str, object] | None) -> ToolForcing | None:
    """How a request's ``tool_choice`` forces tool calls, or None when it does not."""
    choice = (options or {}).get("tool_choice")
    if choice == "required":
        return "required"
    return "named" if isinstance(choice, dict) else None


def chat_message(
    text: str, fields: dict[str, object] | None, *, forced_tools: ToolForcing | None = None
) -> dict[str, object]:
    """A non-streamed chat ``message``: the text and the accumulated delta ``fields``.

    ``tool_calls`` lose the stream's ``index`` (a message lists them in
    order).  When the answer is only tool calls, ``content`` is null, as
    OpenAI and vLLM give it for calls the model chose, and ``""`` when the
    request forced them (``forced_tools``: :func:`tool_forcing`), as vLLM
    0.32 answers a named or ``required`` tool_choice.

    For ``required``, vLLM's non-streamed answer parses the generated list
    of calls and writes each call's arguments again with Python's
    ``json.dumps`` (``", "`` and ``": "`` between items, non-ASCII kept),
    while its stream carries the arguments as generated.  So a call's
    arguments that are whole JSON are written the same way here; arguments
    that do not parse stay as they came (and :func:`response_body` drops the
    calls of a ``required`` answer cut short, as vLLM answers it).
    """
    message: dict[str, object] = {"role": "assistant", "content": text}
    if not fields:
        return message
    for key, value in fields.items():
        if key == "tool_calls" and isinstance(value, list):
            rewrite = forced_tools == "required"
            message[key] = [_message_call(call, rewrite_arguments=rewrite) for call in value]
        elif key not in message:
            message[key] = value
    if not text and message.get("tool_calls"):
        message["content"] = "" if forced_tools else None
    return message


def _message_call(call: object, *, rewrite_arguments: bool) -> object:
    if not isinstance(call, dict):
        return call
    listed = {key: value for key, value in call.items() if key != "index"}
    function = listed.get("function")
    if rewrite_arguments and isinstance(function, dict):
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            listed["function"] = {**function, "arguments": _as_vllm_writes(arguments)}
    return listed


def _as_vllm_writes(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return json.dumps(parsed, ensure_ascii=False)


def response_body(
    kind: Kind,
    *,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage: Usage,
    logprobs: dict[str, object] | None = None,
    fields: dict[str, object] | None = None,
    forced_tools: ToolForcing | None = None,
) -> dict[str, object]:
    """A non-streaming ``chat.completion`` or ``text_completion`` object.

    ``fields`` are the chat deltas' other keys, accumulated (see
    :func:`chat_message`, which also takes ``forced_tools``); a completion has none.
    """
    choice: dict[str, object] = {"index": 0}
    if kind == "chat":
        if forced_tools == "required" and finish_reason == "length" and fields:
            # vLLM parses a required list of calls whole: cut short, it lists none.
            fields = {key: value for key, value in fields.items() if key != "tool_calls"}
        choice["message"] = chat_message(text, fields, forced_tools=forced_tools)
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    return {
        "id": response_id(kind, request_id),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(usage),
    }


class SseFormatter:
    """Renders one request's server-sent events by templating around delta text.

    Args:
        kind: ``chat`` or ``completion``.
        request_id: the router request id (``id`` becomes ``chatcmpl-<id>``).
        model: echoed in every chunk.
        created: the ``created`` timestamp of every chunk.
        logprobs: whether chunks carry log-probabilities.
    """

    __slots__ = ("_head", "_kind", "_logprobs", "_prefix", "_suffix")

    def __init__(
        self, kind: Kind, *, request_id: str, model: str, created: int, logprobs: bool = False
    ) -> None:
        self._kind: Kind = kind
        self._logprobs = logprobs
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            f'{DATA_PREFIX}{{"id":{compact_json(response_id(kind, request_id))},"object":"{obj}",'
            f'"created":{int(created)},"model":{compact_json(model)},'
        )
        opener = '"delta":{"content":' if kind == "chat" else '"text":'
        closer = "}" if kind == "chat" else ""
        self._prefix = f'{self._head}"choices":[{{"index":0,{opener}'
        self._suffix = f'{closer},"logprobs":null,"finish_reason":null}}]}}{EVENT_END}'

    def start(self) -> str:
        """The first event: the chat ``assistant`` role chunk (nothing for completions)."""
        if self._kind != "chat":
            return ""
        return f'{self._head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}{EVENT_END}'  # noqa: E501

    def delta(
        self,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[float] | None = None,
        *,
        tokens: Sequence[str] | None = None,
        top_logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
        fields: dict[str, object] | None = None,
    ) -> str:
        """One chunk of new output (the fast path unless logprobs or ``fields`` come).

        ``fields`` (chat only) go into the chunk's ``delta`` beside the text,
        which is left out when empty, as vLLM writes a tool-call or
        reasoning delta.
        """
        with_logprobs = self._logprobs and logprobs is not None
        if not with_logprobs and not fields:
            return self._prefix + _text_json(text) + self._suffix
        body = (
            logprobs_body(self._kind, token_ids, logprobs, tokens, top_logprobs)
            if with_logprobs
            else None
        )
        return self._choice(self._content(text, fields), logprobs=body, finish_reason=None)

    def event(self, event: DeltaEvent) -> str:
        """:meth:`delta` for a router ``DeltaEvent`` (the template inline, for the hot path)."""
        if event.fields is None and (not self._logprobs or event.logprobs is None):
            text = event.text
            if type(text) is EngineText:
                return self._prefix + text.json + self._suffix
            return self._prefix + _json_string(text) + self._suffix
        return self.delta(
            event.text,
            event.token_ids,
            event.logprobs,
            tokens=event.tokens,
            top_logprobs=event.top_logprobs,
            fields=event.fields,
        )

    def _content(self, text: str, fields: dict[str, object] | None) -> dict[str, object]:
        if self._kind != "chat":
            return {"text": text}
        if not fields:
            return {"delta": {"content": text}}
        delta: dict[str, object] = {"content": text} if text else {}
        delta.update(fields)
        return {"delta": delta}

    def finish(self, finish_reason: str) -> str:
        """The chunk that carries the finish reason (empty delta / text)."""
        content: dict[str, object] = {"delta": {}} if self._kind == "chat" else {"text": ""}
        return self._choice(content, logprobs=None, finish_reason=finish_reason)

    def usage(self, usage: Usage) -> str:
        """The ``include_usage`` chunk: no choices, only ``usage``."""
        return f'{self._head}"choices":[],"usage":{compact_json(usage_body(usage))}}}{EVENT_END}'

    @staticmethod
    def comment(text: str) -> str:
        """An SSE comment line (ignored by clients); newlines are flattened."""
        return encode_comment(text)

    @staticmethod
    def error(body: dict[str, dict[str, str | None]]) -> str:
        """An ``error`` event carrying an OpenAI error body; ends a failed stream."""
        return encode_event(compact_json(body), "error")

    @staticmethod
    def done() -> str:
        """``data: [DONE]``: the stream ended normally."""
        return DONE_EVENT

    def _choice(
        self, content: dict[str, object], *, logprobs: object, finish_reason: str | None
    ) -> str:
        choice = {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        return f'{self._head}"choices":[{compact_json(choice)}]}}{EVENT_END}'


class AnswerBuilder:
    """Accumulates one request's deltas into its non-streamed answer.

    What a client that read the stream would hold: the text, each token's
    logprob entry (when asked for), and the chat ``fields`` merged as
    :func:`~epd_actors.protocol.merge_delta_fields` merges them.

    Args:
        kind: ``chat`` or ``completion``.
        logprobs: whether the request asked for log-probabilities.
        forced_tools: how the request's ``tool_choice`` forced tool calls, if
            it did (see :func:`chat_message`).
    """

    __slots__ = (
        "_fields",
        "_forced_tools",
        "_kind",
        "_logprobs",
        "_texts",
        "_token_ids",
        "_tokens",
        "_tops",
        "_wanted",
    )

    def __init__(
        self, kind: Kind, *, logprobs: bool, forced_tools: ToolForcing | None = None
    ) -> None:
        self._kind: Kind = kind
        self._wanted = logprobs
        self._forced_tools = forced_tools
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._tokens: list[str | None] = []
        self._tops: list[tuple[TokenLogprob, ...] | None] = []
        self._fields: dict[str, object] | None = None

    def add(self, event: OutputPiece) -> None:
        """Take one delta's output."""
        self._texts.append(event.text)
        if event.fields:
            self._fields = merge_delta_fields(self._fields or {}, event.fields)
        if not self._wanted or event.logprobs is None:
            return
        count = len(event.token_ids)
        self._token_ids.extend(event.token_ids)
        self._logprobs.extend(event.logprobs)
        self._tokens.extend(event.tokens if event.tokens is not None else (None,) * count)
        self._tops.extend(event.top_logprobs if event.top_logprobs is not None else (None,) * count)

    def body(
        self, *, request_id: str, model: str, created: int, finish_reason: str, usage: Usage
    ) -> dict[str, object]:
        """The ``chat.completion`` / ``text_completion`` object of what was added."""
        logprobs = (
            logprobs_body(self._kind, self._token_ids, self._logprobs, self._tokens, self._tops)
            if self._wanted
            else None
        )
        return response_body(
            self._kind,
            request_id=request_id,
            model=model,
            created=created,
            text="".join(self._texts),
            finish_reason=finish_reason,
            usage=usage,
            logprobs=logprobs,
            fields=self._fields,
            forced_tools=self._forced_tools,
        )
