"""SIGINT/SIGTERM for the long-running commands: the first drains, the second forces.

``serve`` and ``local`` stop gracefully on the first signal (``stop`` is set:
the router drains, see :mod:`.serve`).  A drain can take up to
``drain_timeout_s``; an operator who presses Ctrl-C again, or a supervisor
that sends a second SIGTERM, wants out now: the second signal calls
``force``, which cancels the serving scope (every request is cancelled at
once, workers are still told to abort, shielded and bounded) and, for
``local``, kills the worker processes.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    import trio

logger = logging.getLogger(__name__)


async def stop_on_signals(
    signals: AsyncIterator[int],
    stop: trio.Event,
    force: Callable[[], None],
    *,
    prog: str = "epd_actors",
) -> None:
    """Set ``stop`` on the first signal, call ``force`` on the second, then return.

    Each step is said on stderr, so the operator at a terminal sees it.
    Cancellation: returns when cancelled (the caller stops watching once the
    router has stopped by itself).
    """
    async for signum in signals:
        name = signal.Signals(signum).name
        if not stop.is_set():
            print(
                f"{prog}: {name}: stopping, draining in-flight requests "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            stop.set()
            continue
        print(f"{prog}: {name} again: stopping at once", file=sys.stderr, flush=True)
        logger.warning("second %s: cancelling what is left of the drain", name)
        force()
        return
