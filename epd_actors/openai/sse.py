"""Server-sent events of one generation: rendering a batch of events as SSE text.

Per-token work decides a streaming front end's cost, so a response never
writes per event: the front end takes every event already queued
(:func:`epd_actors.frontends.event_batches.next_batch`), and
:func:`render_batch` turns the batch into SSE text by templating
(:class:`~.format.SseFormatter`), to be written with one ``send_all``.  A
batch ends at the final event: ``DoneEvent`` renders the finish chunk, the
usage chunk (when asked for), a ``: timings ...`` comment and ``data: [DONE]``;
``ErrorEvent`` renders the timings comment and an ``error`` event, and no
``[DONE]``.  With coalescing (``[server] stream_coalescing = "ready"``, see
:mod:`.coalescing`) the deltas of a batch render as one chunk wherever a merge
keeps everything; without it (``off``), one chunk per delta.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ..errors import ActorCrashed
from ..request import DeltaEvent, DoneEvent, ErrorEvent, RequestTimings
from .coalescing import coalesced
from .errors import ErrorBody, error_response
from .format import error_body

if TYPE_CHECKING:
    from ..errors import EpdError
    from ..request import GenerationEvent
    from .format import SseFormatter
    from .schema import ParsedRequest

_NO_TIMINGS: Final = RequestTimings(
    queue_wait_s=0.0, stages={}, ttft_s=None, total_s=0.0, workers={}
)


def render_batch(
    formatter: SseFormatter,
    batch: list[GenerationEvent],
    parsed: ParsedRequest,
    *,
    coalesce: bool = True,
) -> tuple[str, DoneEvent | ErrorEvent | None]:
    """The SSE text of a batch of events, and its final event if it has one.

    ``coalesce``: merge the batch's consecutive deltas into one chunk where a
    merge keeps everything (:func:`.coalescing.coalesced`); False: one chunk
    per delta.
    """
    if not batch:
        error = ActorCrashed("the request ended without a final event")
        return formatter.error(stream_error_body(error)), ErrorEvent(error, _NO_TIMINGS)
    if coalesce and len(batch) > 1:
        batch = coalesced(batch)
    parts: list[str] = []
    for event in batch:
        if isinstance(event, DeltaEvent):
            if worth_a_chunk(event, logprobs=parsed.logprobs):
                parts.append(formatter.event(event))
        elif isinstance(event, DoneEvent):
            parts.append(formatter.finish(event.finish_reason))
            if parsed.include_usage:
                parts.append(formatter.usage(event.usage))
            parts.append(formatter.comment("timings " + event.timings.header_value()))
            parts.append(formatter.done())
            return "".join(parts), event
        elif isinstance(event, ErrorEvent):
            parts.append(formatter.comment("timings " + event.timings.header_value()))
            parts.append(formatter.error(stream_error_body(event.error)))
            return "".join(parts), event
    return "".join(parts), None


def worth_a_chunk(event: DeltaEvent, *, logprobs: bool) -> bool:
    """Whether ``event`` renders a chunk: text, ``fields``, or tokens whose logprobs were asked."""
    return bool(event.text or event.fields or (logprobs and event.token_ids))


def stream_error_body(error: EpdError) -> ErrorBody:
    answer = error_response(error)
    if answer is None:
        return error_body(str(error), type="cancelled", code="cancelled")
    return answer.body
