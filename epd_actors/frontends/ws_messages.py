"""The WebSocket front end's messages: parsing client messages, building server ones.

Sans-IO: no sockets, no Trio.  ``ws.py`` does the I/O; docs/websocket.md is the
normative description of every message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

from ..openai.body_checks import (
    LoneSurrogate,
    find_lone_surrogate,
    lone_surrogate_error,
    may_hold_lone_surrogate,
)
from ..openai.errors import HttpError, error_response
from ..openai.format import compact_json, error_body, usage_body
from ..protocol import merge_delta_fields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..openai.schema import RequestKind
    from ..request import DeltaEvent, DoneEvent, RequestTimings

_T = TypeVar("_T")

MAX_ID_CHARS: Final = 256
"""Longest client generation id (characters)."""

PONG: Final = '{"type":"pong"}'


# ---------------------------------------------------------------- client messages


@dataclass(frozen=True, slots=True)
class GenerateMessage:
    """``{"type": "generate", "id", "kind", "request", "traceparent"?}``.

    ``request`` is checked later.  ``traceparent`` is the client's W3C trace
    context (HTTP's ``traceparent`` header; there are no per-request headers
    on a WebSocket): the request's trace continues the client's.
    """

    id: str
    kind: RequestKind
    request: object
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class CancelMessage:
    """``{"type": "cancel", "id"}``."""

    id: str


@dataclass(frozen=True, slots=True)
class PingMessage:
    """``{"type": "ping"}``."""


ClientMessage = GenerateMessage | CancelMessage | PingMessage


class WsMessageError(HttpError):
    """A client message the server refuses; ``client_id`` is its id when it had a usable one."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None,
        param: str | None = None,
        client_id: str | None = None,
    ) -> None:
        super().__init__(400, message, code=code, param=param)
        self.client_id = client_id


def parse_client_message(data: str | bytes) -> ClientMessage:
    """One client frame -> a typed message.

    Raises:
        WsMessageError: not JSON, not an object, an unknown ``type``, a bad
            ``id`` (``client_id`` is None), a bad ``kind`` or a ``traceparent``
            that is not a string (``client_id`` set),
            or a lone surrogate in any string (see :func:`_surrogate_refusal`).
    """
    if not isinstance(data, str):
        raise WsMessageError("messages must be text frames holding JSON", code="invalid_message")
    try:
        fields = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise WsMessageError(f"message is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(fields, dict):
        raise WsMessageError("a message must be a JSON object", code="invalid_message")
    if may_hold_lone_surrogate(data):
        found = find_lone_surrogate(fields)
        if found is not None:
            raise _surrogate_refusal(found, fields)
    kind = fields.get("type")
    if kind == "ping":
        return PingMessage()
    if kind not in ("generate", "cancel"):
        raise WsMessageError(
            "type must be one of generate, cancel, ping", code="unknown_type", param="type"
        )
    client_id = _usable_id(fields)
    if client_id is None:
        raise WsMessageError(
            f"id must be a string of 1 to {MAX_ID_CHARS} characters",
            code="invalid_message",
            param="id",
        )
    if kind == "cancel":
        return CancelMessage(client_id)
    request_kind = fields.get("kind")
    if request_kind != "chat" and request_kind != "completion":
        raise WsMessageError(
            "kind must be 'chat' or 'completion'",
            code="invalid_message",
            param="kind",
            client_id=client_id,
        )
    traceparent = fields.get("traceparent")
    if traceparent is None or isinstance(traceparent, str):
        return GenerateMessage(client_id, request_kind, fields.get("request"), traceparent)
    raise WsMessageError(
        "traceparent must be a string (a W3C trace context)",
        code="invalid_message",
        param="traceparent",
        client_id=client_id,
    )


def _usable_id(fields: dict[str, object]) -> str | None:
    client_id = fields.get("id")
    if isinstance(client_id, str) and 0 < len(client_id) <= MAX_ID_CHARS:
        return client_id
    return None


def _surrogate_refusal(found: LoneSurrogate, fields: dict[str, object]) -> WsMessageError:
    """The error for a lone surrogate in a frame, as HTTP gives it for the same body.

    Inside ``request`` the path is the body's own (``messages[0].content``) and
    the error carries the generation's id; elsewhere it names the frame's field.
    """
    in_request = found.path[:1] == ("request",)
    refusal = lone_surrogate_error(found, within=1 if in_request else 0)
    client_id = _usable_id(fields)
    if client_id is not None and find_lone_surrogate(client_id) is not None:
        client_id = None  # the id itself cannot be echoed
    return WsMessageError(str(refusal), code=None, param=refusal.param, client_id=client_id)


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


# ---------------------------------------------------------------- server messages


def error_payload(exc: BaseException) -> dict[str, str | None]:
    """The ``error`` object of an error message (``message``, ``type``, ``code``, ``param``)."""
    answer = error_response(exc)
    if answer is None:  # RequestCancelled by the router itself (e.g. shutdown)
        return error_body(str(exc), type="cancelled", code="cancelled")["error"]
    return answer.body["error"]


def error_message(client_id: str | None, exc: BaseException) -> str:
    """``{"type": "error", "id", "error"}``; ``id`` null for connection-level errors."""
    return compact_json({"type": "error", "id": client_id, "error": error_payload(exc)})


def delta_messages(client_id: str, deltas: Sequence[DeltaEvent], *, logprobs: bool) -> list[str]:
    """The ``delta`` messages of ``deltas``, in order: merged wherever merging keeps everything.

    With logprobs asked, deltas whose per-token arrays (``logprobs``,
    ``tokens``, ``top_logprobs``) some carry and others do not go in
    separate messages, so every array stays one entry per token id.
    """
    runs = _mergeable_runs(deltas) if logprobs else [deltas]
    return [delta_message(client_id, run, logprobs=logprobs) for run in runs if _has_output(run)]


def batch_messages(
    client_id: str, deltas: Sequence[DeltaEvent], *, logprobs: bool, coalesce: bool
) -> list[str]:
    """The ``delta`` messages of a batch of queued deltas, in order.

    ``coalesce`` (``[server] stream_coalescing = "ready"``): merged as in
    :func:`delta_messages`; False (``off``): one message per delta.
    """
    if coalesce:
        return delta_messages(client_id, deltas, logprobs=logprobs)
    return [
        text for delta in deltas for text in delta_messages(client_id, [delta], logprobs=logprobs)
    ]


def delta_message(client_id: str, deltas: Sequence[DeltaEvent], *, logprobs: bool) -> str:
    """One ``delta`` message carrying ``deltas`` merged, in order.

    ``tokens`` and ``top_logprobs`` come with ``logprobs`` when the engine
    gave them; ``fields`` (the chat delta's other keys, such as
    ``tool_calls`` pieces) come merged as an OpenAI client merges them.
    """
    body: dict[str, object] = {
        "type": "delta",
        "id": client_id,
        "text": "".join(delta.text for delta in deltas),
        "token_ids": [token for delta in deltas for token in delta.token_ids],
    }
    if logprobs:
        with_tokens = [delta for delta in deltas if delta.token_ids]
        body["logprobs"] = _joined([delta.logprobs for delta in with_tokens]) or []
        tokens = _joined([delta.tokens for delta in with_tokens])
        if tokens:
            body["tokens"] = tokens
        tops = _joined([delta.top_logprobs for delta in with_tokens])
        if tops:
            body["top_logprobs"] = [
                [{"token": alt.token, "logprob": alt.logprob} for alt in top] for top in tops
            ]
    fields: dict[str, object] | None = None
    for delta in deltas:
        if delta.fields:
            fields = merge_delta_fields(fields or {}, delta.fields)
    if fields:
        body["fields"] = fields
    return compact_json(body)


def _has_output(deltas: Sequence[DeltaEvent]) -> bool:
    return any(delta.text or delta.token_ids or delta.fields for delta in deltas)


def _shape(delta: DeltaEvent) -> tuple[bool, bool, bool]:
    return (delta.logprobs is None, delta.tokens is None, delta.top_logprobs is None)


def _mergeable_runs(deltas: Sequence[DeltaEvent]) -> list[Sequence[DeltaEvent]]:
    """``deltas`` cut where a delta with tokens has other per-token arrays than those before."""
    runs: list[Sequence[DeltaEvent]] = []
    start, shape = 0, None
    for at, delta in enumerate(deltas):
        if not delta.token_ids:
            continue
        if shape is not None and _shape(delta) != shape:
            runs.append(deltas[start:at])
            start = at
        shape = _shape(delta)
    runs.append(deltas[start:])
    return runs


def _joined(parts: list[tuple[_T, ...] | None]) -> list[_T] | None:
    """Per-token tuples concatenated, or None unless every part has one."""
    if any(part is None for part in parts):
        return None
    return [item for part in parts if part is not None for item in part]


def done_message(client_id: str, done: DoneEvent, *, request_id: str) -> str:
    """``{"type": "done", "id", "request_id", "finish_reason", "usage", "timings"}``."""
    return compact_json(
        {
            "type": "done",
            "id": client_id,
            "request_id": request_id,
            "finish_reason": done.finish_reason,
            "usage": usage_body(done.usage),
            "timings": timings_body(done.timings),
        }
    )


def cancelled_message(client_id: str) -> str:
    """``{"type": "cancelled", "id"}``."""
    return compact_json({"type": "cancelled", "id": client_id})


def timings_body(timings: RequestTimings) -> dict[str, object]:
    """Where the time went, in seconds, and which workers served each stage."""
    return {
        "queue_wait_s": timings.queue_wait_s,
        "stages": dict(timings.stages),
        "ttft_s": timings.ttft_s,
        "total_s": timings.total_s,
        "workers": {stage: list(ids) for stage, ids in timings.workers.items()},
    }
