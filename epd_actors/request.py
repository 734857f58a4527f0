"""What a caller asks the router for, and the typed events it gets back.

These are the public types of the embeddable API; the HTTP and WebSocket front
ends translate to and from them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from .errors import InvalidRequest
from .protocol import MediaItem, Prompt, SamplingParams, TokenLogprob, Usage
from .records import token_record

if TYPE_CHECKING:
    from .errors import EpdError


PRIORITIES = ("high", "normal", "low")


_RANDOM_POOL_BYTES: Final = 4096
_random_pool = bytearray()


def _random_hex(nbytes: int) -> str:
    """``nbytes`` bytes from the OS's CSPRNG, as hex (like ``secrets.token_hex``).

    The bytes come from a pool refilled ``_RANDOM_POOL_BYTES`` at a time, so a
    request's ids cost no ``getrandom`` syscall each.
    """
    if len(_random_pool) < nbytes:
        _random_pool.extend(secrets.token_bytes(_RANDOM_POOL_BYTES))
    taken = _random_pool[-nbytes:]
    del _random_pool[-nbytes:]
    return taken.hex()


def new_request_id() -> str:
    """A fresh, unguessable request id."""
    return "req-" + _random_hex(12)


def worker_request_id(request_id: str) -> str:
    """The id the workers see for a request.

    The request's own id (often the client's ``x-request-id``) stays
    recognisable in worker logs, and a unique suffix keeps two clients that
    reuse an id (by accident or on purpose) from colliding on a worker.
    """
    return f"{request_id}.{_random_hex(4)}"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, as the router sees it.

    Attributes:
        prompt: text, token ids, or chat messages (media referenced by index).
        media: the request's media items, in the order the prompt refers to them.
        sampling: sampling parameters for the output.
        request_id: unique id; the front ends honour a client's ``x-request-id``.
        session_key: optional affinity key (consistent-hash routing).
        priority: ``high``, ``normal`` or ``low``: which share of the router's
            in-flight limit the request may use (see ``config.AdmissionLimits``).
        timeout_s: whole-request deadline (seconds); ``None`` or ``0`` uses the
            configured one.
        options: the client's other vLLM request fields, by name, as JSON
            values (``frequency_penalty``, ``response_format``, ``tools``...);
            carried to the engine unchanged (see ``GenerateRequest.options``).
        model: the model the request is for, or a LoRA adapter of one; it
            runs on that model's pools (an adapter: on its base model's, on
            workers that have the adapter when there are some).  None: the
            router's default model.  A name the router does not serve ends
            the request with ``ModelNotFound``.
        traceparent: the client's W3C ``traceparent`` header, if it sent one:
            the request's trace continues the client's (when tracing is on;
            a malformed one starts a new trace).
    """

    prompt: Prompt
    media: tuple[MediaItem, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    session_key: str | None = None
    priority: str = "normal"
    timeout_s: float | None = None
    options: dict[str, object] | None = None
    model: str | None = None
    traceparent: str | None = None

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise InvalidRequest(
                f"priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}",
                param="priority",
            )


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a request's time went (seconds, on the router's clock).

    Attributes:
        queue_wait_s: time jobs waited in actor inboxes and for a worker slot
            (the longest wait of each stage, summed over stages).
        stages: stage name -> wall time of that stage (fan-out: first start to
            last finish).
        ttft_s: request received -> first output token (None if none came).
        total_s: request received -> final event.
        workers: stage name -> the worker ids that served it (a fan-out stage:
            one per job, in the order they finished).
    """

    queue_wait_s: float
    stages: dict[str, float]
    ttft_s: float | None
    total_s: float
    workers: dict[str, tuple[str, ...]]

    def header_value(self) -> str:
        """``stage=ms`` pairs for a response header (``x-epd-timings``).

        Then ``worker.STAGE=ID[,ID...]`` for each stage that finished: which
        workers served it.
        """
        parts = [f"{name}={seconds * 1000:.1f}" for name, seconds in self.stages.items()]
        parts.append(f"queue={self.queue_wait_s * 1000:.1f}")
        if self.ttft_s is not None:
            parts.append(f"ttft={self.ttft_s * 1000:.1f}")
        parts.append(f"total={self.total_s * 1000:.1f}")
        parts.extend(
            f"worker.{stage}={','.join(ids)}" for stage, ids in self.workers.items() if ids
        )
        return ";".join(parts)

    def served_by(self) -> str:
        """``stage=ID[,ID...]`` of each stage that finished, space-separated (``-``: none)."""
        pairs = [f"{stage}={','.join(ids)}" for stage, ids in self.workers.items() if ids]
        return " ".join(pairs) or "-"


@token_record
class DeltaEvent:
    """New output: text and its token ids, as the engine's ``Delta`` gave them.

    Attributes:
        text: the new text.
        token_ids: the sampled token ids.
        logprobs: each sampled token's log-probability, when asked for.
        tokens: each sampled token's text, when the engine gave it.
        top_logprobs: each token's alternatives (sampled first where the
            engine puts it first), when asked for and the engine gave them.
        fields: the other keys of an OpenAI chat delta (``tool_calls``
            pieces, ``reasoning_content``...), as the engine produced them.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    tokens: tuple[str, ...] | None = None
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None
    fields: dict[str, object] | None = None


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """Token counts; sent once, just before :class:`DoneEvent`."""

    usage: Usage


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The request finished normally; always the last event."""

    finish_reason: str
    usage: Usage
    timings: RequestTimings


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The request failed; always the last event.  ``error`` is a single typed error."""

    error: EpdError
    timings: RequestTimings


GenerationEvent = DeltaEvent | UsageEvent | DoneEvent | ErrorEvent
