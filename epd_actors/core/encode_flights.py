"""Encodes in flight, per encode pool: a second request for an item waits for the first's.

With encoder-output reuse on, two requests that carry the same unseen item at
the same time would both miss the router's memory and both run E for it.
:class:`EncodeFlights` lets the first claim the item (by its memory key) for
the time its encode stage runs; a later request that finds the claim waits for
it to end, then reads the memory again: the first's answer is there when its
encode succeeded, and the waiter runs E itself when it failed, was cancelled,
or took longer than the waiter's bound.

Synchronous apart from :meth:`EncodeFlights.wait`; one instance per encode
actor, used from the requesters' tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

__all__ = ["EncodeFlights", "FlightStatistics"]


@dataclass(frozen=True, slots=True)
class FlightStatistics:
    """How often requests found an item's encode in flight.

    Attributes:
        claims: items a request claimed to encode (no encode of it was in flight).
        joins: items a request waited for another request's encode of.
        expired: waits that reached their bound (the waiter encoded the item itself).
    """

    claims: int
    joins: int
    expired: int


class EncodeFlights:
    """Memory key -> the event set when the encode that claimed it ends."""

    __slots__ = ("_claims", "_expired", "_in_flight", "_joins")

    def __init__(self) -> None:
        self._in_flight: dict[str, trio.Event] = {}
        self._claims = 0
        self._joins = 0
        self._expired = 0

    def __len__(self) -> int:
        return len(self._in_flight)

    def in_flight(self, key: str) -> trio.Event | None:
        """The event of the encode of ``key`` now in flight; None when there is none."""
        return self._in_flight.get(key)

    def claim(self, key: str) -> trio.Event | None:
        """Claim ``key`` for the caller's encode; None when another encode holds it.

        The caller must :meth:`release` the event it got, whatever happens.
        """
        if key in self._in_flight:
            return None
        event = self._in_flight[key] = trio.Event()
        self._claims += 1
        return event

    def release(self, key: str, event: trio.Event) -> None:
        """End the claim ``event`` holds on ``key``, waking its waiters."""
        if self._in_flight.get(key) is event:
            del self._in_flight[key]
        event.set()

    async def wait(self, events: list[trio.Event], deadline: float) -> bool:
        """Wait until every event is set or ``deadline`` passes; False at the deadline.

        Cancellation: cancellable at any point (a waiter holds no claim).
        Backpressure: none; the wait is bounded by ``deadline``.
        """
        self._joins += len(events)
        with trio.move_on_at(deadline):
            for event in events:
                await event.wait()
            return True
        self._expired += sum(not event.is_set() for event in events)
        return False

    def statistics(self) -> FlightStatistics:
        return FlightStatistics(self._claims, self._joins, self._expired)
