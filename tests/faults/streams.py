"""What one client of the router saw: a consumer shared by the fault tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from epd_actors import DeltaEvent, DoneEvent, ErrorEvent

if TYPE_CHECKING:
    from epd_actors import GenerationRequest, Router


@dataclass
class Seen:
    """Tokens received, the final event, and when the stream ended."""

    tokens: int = 0
    final: DoneEvent | ErrorEvent | None = None
    first_token: trio.Event | None = None
    ended_at: float = 0.0

    @property
    def error(self) -> BaseException | None:
        return self.final.error if isinstance(self.final, ErrorEvent) else None


async def consume(router: Router, request: GenerationRequest, seen: Seen) -> None:
    """Read a request's events to the end into ``seen``."""
    async with router.generate(request) as events:
        async for event in events:
            if isinstance(event, DeltaEvent):
                seen.tokens += len(event.token_ids)
                if seen.first_token is not None:
                    seen.first_token.set()
            elif isinstance(event, DoneEvent | ErrorEvent):
                seen.final = event
    seen.ended_at = trio.current_time()


async def run_one(router: Router, request: GenerationRequest) -> Seen:
    seen = Seen()
    await consume(router, request, seen)
    return seen
