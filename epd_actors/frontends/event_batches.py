"""Taking a request's events in batches: one awaited, every one queued behind it taken as well."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ..request import DoneEvent, ErrorEvent

if TYPE_CHECKING:
    from ..handoff import HandoffReceiver
    from ..request import GenerationEvent


async def next_batch(
    events: HandoffReceiver[GenerationEvent],
) -> list[GenerationEvent]:
    """One event (waiting for it) plus every event already queued behind it.

    An empty list means the channel ended without a final event.

    Cancellation: safe; nothing is lost that was not already taken.
    Backpressure: waits only for the first event.
    """
    try:
        batch = [await events.receive()]
    except trio.EndOfChannel:
        return []
    while not isinstance(batch[-1], DoneEvent | ErrorEvent):
        try:
            batch.append(events.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch
