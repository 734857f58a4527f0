"""The load generator's progress line: ``\\r``-redrawn counts, for a terminal only.

:class:`ProgressLine` holds the counters the runner bumps (done, failed, in
flight) and, in :meth:`ProgressLine.run`, redraws one line at most every
:data:`PROGRESS_INTERVAL_S` (four times a second).  :func:`progress_stream`
decides whether there is a line at all: only when asked for, or by default
when the stream is a terminal (a pipe or a file gets no ``\\r`` noise).
No dependency beyond the standard library and Trio.
"""

from __future__ import annotations

import sys
from typing import TextIO

import trio

PROGRESS_INTERVAL_S = 0.25
"""Redraws are at least this far apart: at most four a second."""


class ProgressLine:
    """Counters of a run and, when given a stream, a line that shows them.

    Args:
        out: where the line goes; None: counters only, nothing is written.
        total: requests the run will send (None: it runs for a duration).
        label: shown first (a sweep's point, ``concurrency=4``), or empty.
    """

    def __init__(self, out: TextIO | None, total: int | None, label: str = "") -> None:
        self.out = out
        self.total = total
        self.label = label
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self._width = 0

    def line(self, elapsed: float) -> str:
        """The text of one redraw, ``\\r`` first, ``elapsed`` seconds into the run."""
        total = "" if self.total is None else f"/{self.total}"
        rate = self.done / elapsed if elapsed > 0 else 0.0
        label = f"{self.label}: " if self.label else ""
        return (
            f"\r{label}{self.done}{total} done, {self.failed} failed, {self.in_flight} in flight, "
            f"{elapsed:5.1f} s, {rate:7.1f} req/s "
        )

    def draw(self, elapsed: float) -> None:
        """Write one redraw (nothing without a stream)."""
        if self.out is None:
            return
        text = self.line(elapsed)
        self._width = max(self._width, len(text) - 1)
        self.out.write(text)
        self.out.flush()

    async def run(self, started: float) -> None:
        """Redraw every :data:`PROGRESS_INTERVAL_S` until cancelled.

        ``started`` is the run's start on Trio's clock.  Returns at once
        without a stream.  Cancellation: the caller cancels it when the run
        ends, then calls :meth:`clear`.  Backpressure: a slow terminal blocks
        the write, and so the redraws (not the requests, which run in other tasks).
        """
        if self.out is None:
            return
        while True:
            await trio.sleep(PROGRESS_INTERVAL_S)
            self.draw(trio.current_time() - started)

    def clear(self) -> None:
        """Blank the line so the summary prints over a clean row (nothing without a stream)."""
        if self.out is not None and self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()


def progress_stream(enabled: bool | None, stream: TextIO | None = None) -> TextIO | None:
    """``stream`` (default stdout) when ``enabled``; None: when it is a terminal."""
    out = sys.stdout if stream is None else stream
    if enabled is None:
        enabled = out.isatty()
    return out if enabled else None
