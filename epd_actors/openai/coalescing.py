"""Stream coalescing: whether a response merges the deltas already queued for it.

Theory of operation
-------------------
A streamed response is a sequence of deltas.  When its writer wakes and finds
several deltas queued (the client's socket was full, the writer was busy),
merging them into one SSE event costs no latency: they are all there already,
and one event is cheaper to render, write and parse than several.  Merging
*across time* (holding a delta back to wait for the next) would cost latency,
and nothing here does it.  Two modes, ``[server] stream_coalescing``:

* ``ready`` (the default): merge only what is already queued -- the deltas a
  worker's read brought together, the deltas queued behind the one the writer
  waited for.  Nothing waits for a later delta.
* ``off``: one SSE event (one WebSocket message) per delta the router
  received from its worker: per native frame's delta, per ``vllm serve`` SSE
  chunk.  The router merges nothing itself; a native worker still puts the
  tokens its engine produced while the previous frame was being written into
  one frame, as vLLM's own server puts one engine step's tokens into one chunk.

A merge keeps everything: text and token ids concatenate, per-token arrays
(``logprobs``, ``tokens``, ``top_logprobs``) concatenate one entry per token
id, and a run is cut where a delta with tokens carries other arrays than the
ones before it (as :func:`~epd_actors.protocol.deltas_mergeable` rules for
frames); chat ``fields`` merge as a client accumulates them
(:func:`~epd_actors.protocol.merge_delta_fields`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, TypeVar

from ..errors import ConfigError
from ..protocol import merge_delta_fields
from ..request import DeltaEvent

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..request import GenerationEvent

STREAM_COALESCING_MODES: Final = ("ready", "off")
"""The values of ``[server] stream_coalescing`` (the first is the default)."""

_T = TypeVar("_T")


def check_stream_coalescing(value: str, *, key: str) -> str:
    """``value`` if it names a mode; else a ``ConfigError`` naming ``key``."""
    if value not in STREAM_COALESCING_MODES:
        raise ConfigError(
            f"{key}: must be one of {', '.join(STREAM_COALESCING_MODES)}, not {value!r}"
        )
    return value


def coalesced(batch: list[GenerationEvent]) -> list[GenerationEvent]:
    """``batch`` with each run of consecutive deltas merged, wherever a merge keeps everything.

    Other events (usage, done, error) stay where they are and end a run.
    """
    out: list[GenerationEvent] = []
    run: list[DeltaEvent] = []
    for event in batch:
        if type(event) is DeltaEvent:
            if run and not _fits(run, event):
                out.append(merge_delta_events(run))
                run = []
            run.append(event)
            continue
        if run:
            out.append(merge_delta_events(run))
            run = []
        out.append(event)
    if run:
        out.append(merge_delta_events(run))
    return out


def merge_delta_events(run: Sequence[DeltaEvent]) -> DeltaEvent:
    """One delta event carrying ``run`` merged, in order (see the module docstring)."""
    if len(run) == 1:
        return run[0]
    with_tokens = [delta for delta in run if delta.token_ids]
    fields: dict[str, object] | None = None
    for delta in run:
        if delta.fields:
            fields = merge_delta_fields(fields or {}, delta.fields)
    return DeltaEvent(
        "".join(delta.text for delta in run),
        tuple(token for delta in run for token in delta.token_ids),
        _joined([delta.logprobs for delta in with_tokens]),
        _joined([delta.tokens for delta in with_tokens]),
        _joined([delta.top_logprobs for delta in with_tokens]),
        fields,
    )


def _shape(delta: DeltaEvent) -> tuple[bool, bool, bool]:
    return (delta.logprobs is None, delta.tokens is None, delta.top_logprobs is None)


def _fits(run: list[DeltaEvent], delta: DeltaEvent) -> bool:
    """Whether ``delta`` merges into ``run`` without dropping a per-token array."""
    if not delta.token_ids:
        return True
    shape = _shape(delta)
    return all(_shape(before) == shape for before in run if before.token_ids)


def _joined(parts: list[tuple[_T, ...] | None]) -> tuple[_T, ...] | None:
    """Per-token tuples concatenated, or None unless every part has one."""
    if not parts or any(part is None for part in parts):
        return None
    return tuple(item for part in parts if part is not None for item in part)
