"""Writing a streaming response's deltas from the router task that produced them.

Theory of operation
-------------------
A streaming response has one writer: its connection's task, which waits for
the request's events, renders each batch as SSE and writes it.  When a token
comes alone (an engine step every few milliseconds, one token per stream), that
is one wake-up of the connection's task per token.  A :class:`DirectSseWriter`
is the response's :data:`~epd_actors.request.DirectDeltas`: while the
connection's task waits on an empty event channel (``idle``), the router's
task that produced a delta renders it and offers it to the socket without
waiting (:meth:`~epd_actors.transport.nowait.NowaitWriter.send_some_nowait`), so the connection's
task sleeps through the whole stream and wakes for its end.

Order and ownership: the writer takes a delta only while ``idle``, which the
connection's task sets just before it waits on an empty channel and clears as
soon as it runs again; a refusal, a short write or a failure clears it too, so
once one delta is queued every later one is queued behind it, and the
connection's task writes them in order.  When the kernel takes only part of
a direct write (or nothing, as from any stream but a socket), the rest is kept
(``backlog``) and the delta is refused all the same, so it is queued and wakes
the connection's task, which writes the backlog -- under its write timeout --
and skips that event instead of rendering it twice.  A broken socket is
recorded (``failed``) and becomes ``ClientGone`` in the connection's task.
Nothing here blocks or raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import trio

from ..openai.sse import worth_a_chunk
from .event_batches import next_batch

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..openai.format import SseFormatter
    from ..request import DeltaEvent, GenerationEvent
    from ..transport.nowait import NowaitWriter


class SentCounter(Protocol):
    """Where a response's byte count is kept (the exchange's log record)."""

    sent: int


class DirectSseWriter:
    """A streaming response's direct writer (see the module docstring).

    Args:
        frame: frames a piece of the response's body (:func:`~.http_body.body_framer`).
        writer: the client's stream's writer.
        formatter: renders one delta as SSE text.
        logprobs: the request asked for log-probabilities (a delta without
            text is rendered when it has tokens).
        exchange: the byte count to add what is written to, if any.
    """

    __slots__ = (
        "_exchange",
        "_formatter",
        "_frame",
        "_logprobs",
        "_writer",
        "backlog",
        "failed",
        "idle",
        "written",
    )

    def __init__(
        self,
        frame: Callable[[bytes], bytes],
        writer: NowaitWriter,
        formatter: SseFormatter,
        *,
        logprobs: bool,
        exchange: SentCounter | None,
    ) -> None:
        self._frame = frame
        self._writer = writer
        self._formatter = formatter
        self._logprobs = logprobs
        self._exchange = exchange
        self.backlog = b""
        self.failed = False
        self.idle = False
        self.written: DeltaEvent | None = None  # refused, but its chunk is in the backlog

    def __call__(self, event: DeltaEvent) -> bool:
        """Write ``event`` now if the connection's task is idle; False to have it queued.

        False also when the chunk was only partly written: the event is then
        queued just to wake the connection's task (:meth:`next_batch` drops it).
        """
        if not self.idle:
            return False
        if not worth_a_chunk(event, logprobs=self._logprobs):
            return True  # nothing to render (as in a batch)
        text = self._formatter.event(event)
        data = self._frame(text.encode("utf-8", "replace"))
        try:
            written = self._writer.send_some_nowait(data)
        except trio.BusyResourceError:  # never while the connection's task waits
            self.idle = False
            return False
        except trio.BrokenResourceError:
            self.failed = True
            self.idle = False
            return False
        if self._exchange is not None:
            self._exchange.sent += written
        if written < len(data):
            self.backlog = data[written:]
            self.written = event
            self.idle = False
            return False
        return True

    async def next_batch(
        self, events: trio.MemoryReceiveChannel[GenerationEvent]
    ) -> list[GenerationEvent]:
        """:func:`~.sse.next_batch`, taking deltas directly while it waits on an empty channel.

        The event whose chunk is already in the backlog is left out of the batch.

        Cancellation and backpressure: as :func:`~.sse.next_batch`.
        """
        self.idle = not (self.backlog or self.failed or events.statistics().current_buffer_used)
        try:
            batch = await next_batch(events)
        finally:
            self.idle = False
        written, self.written = self.written, None
        if written is not None and batch and batch[0] is written:
            del batch[0]
        return batch

    def take_backlog(self) -> bytes:
        """What a direct write left unwritten; the caller writes it before anything else."""
        backlog, self.backlog = self.backlog, b""
        return backlog
