"""Waiting on state that nothing signals (counters, other processes' connections)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable


async def wait_until(predicate: Callable[[], bool], *, poll_s: float = 0.001) -> None:
    """Return once ``predicate()`` holds, checking every ``poll_s`` seconds.

    For statistics and remote state only; the caller bounds the wait with
    ``trio.fail_after``.
    """
    # Polling on purpose: counters and worker processes offer no event to wait on.
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(poll_s)
