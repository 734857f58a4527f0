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
The result is byte-for-byte the compact JSON of the equivalent dict.

Log-probabilities take the slower dict path (they are rare and per-token
structured).  The router's events carry the sampled token's id and logprob but
neither its text nor alternatives, so tokens are reported as ``token_id:<id>``
(vLLM's ``return_tokens_as_token_ids`` form) and ``top_logprobs`` lists are empty.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..protocol import Usage

Kind = Literal["chat", "completion"]


DONE_EVENT: Final = "data: [DONE]\n\n"
"""The terminator OpenAI clients wait for after a successful stream."""


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


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
    kind: Kind, token_ids: Sequence[int], logprobs: Sequence[float] | None
) -> dict[str, object] | None:
    """The ``logprobs`` object of a choice (None when there are none)."""
    if logprobs is None:
        return None
    tokens = [f"token_id:{token}" for token in token_ids]
    if kind == "chat":
        return {
            "content": [
                {"token": token, "logprob": value, "bytes": None, "top_logprobs": []}
                for token, value in zip(tokens, logprobs, strict=True)
            ]
        }
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None}


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
) -> dict[str, object]:
    """A non-streaming ``chat.completion`` or ``text_completion`` object."""
    choice: dict[str, object] = {"index": 0}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
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
            f'data: {{"id":{_dumps(response_id(kind, request_id))},"object":"{obj}",'
            f'"created":{int(created)},"model":{_dumps(model)},'
        )
        opener = '"delta":{"content":' if kind == "chat" else '"text":'
        closer = "}" if kind == "chat" else ""
        self._prefix = f'{self._head}"choices":[{{"index":0,{opener}'
        self._suffix = f'{closer},"logprobs":null,"finish_reason":null}}]}}\n\n'

    def start(self) -> str:
        """The first event: the chat ``assistant`` role chunk (nothing for completions)."""
        if self._kind != "chat":
            return ""
        return f'{self._head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'  # noqa: E501

    def delta(
        self,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[float] | None = None,
    ) -> str:
        """One chunk of new output (the fast path unless log-probabilities are wanted)."""
        if not self._logprobs or logprobs is None:
            return self._prefix + _dumps(text) + self._suffix
        body = logprobs_body(self._kind, token_ids, logprobs)
        return self._choice(
            {"delta": {"content": text}} if self._kind == "chat" else {"text": text},
            logprobs=body,
            finish_reason=None,
        )

    def finish(self, finish_reason: str) -> str:
        """The chunk that carries the finish reason (empty delta / text)."""
        content: dict[str, object] = {"delta": {}} if self._kind == "chat" else {"text": ""}
        return self._choice(content, logprobs=None, finish_reason=finish_reason)

    def usage(self, usage: Usage) -> str:
        """The ``include_usage`` chunk: no choices, only ``usage``."""
        return f'{self._head}"choices":[],"usage":{_dumps(usage_body(usage))}}}\n\n'

    @staticmethod
    def comment(text: str) -> str:
        """An SSE comment line (ignored by clients); newlines are flattened."""
        return ": " + text.replace("\r", " ").replace("\n", " ") + "\n\n"

    @staticmethod
    def error(body: dict[str, dict[str, str | None]]) -> str:
        """An ``error`` event carrying an OpenAI error body; ends a failed stream."""
        return f"event: error\ndata: {_dumps(body)}\n\n"

    @staticmethod
    def done() -> str:
        """``data: [DONE]``: the stream ended normally."""
        return DONE_EVENT

    def _choice(
        self, content: dict[str, object], *, logprobs: object, finish_reason: str | None
    ) -> str:
        choice = {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        return f'{self._head}"choices":[{_dumps(choice)}]}}\n\n'
