"""Writing a streaming response's deltas from the router task that produced them.

Theory of operation
-------------------
A streaming response has one writer: its connection's task, which waits for
the request's events, renders each batch as SSE and writes it.  When a token
comes alone (an engine step every few milliseconds, one token per stream), that
is one wake-up of the connection's task per token.  A :class:`DirectSseWriter`
is the taker the connection attaches to the request's event channel (a
hand-off channel, :mod:`~epd_actors.handoff`): while the connection's task
waits on an empty event channel, the router's task that produced a delta
renders it and offers it to the socket without waiting
(:meth:`~epd_actors.transport.nowait.NowaitWriter.send_some_nowait`), so the connection's
task sleeps through the whole stream and wakes for its end.

Order and ownership: the channel hands the writer a delta only while the
connection's task waits on it with nothing queued, and after a refusal (a
short write, a failure) it queues every later delta until that task caught
up, so the connection's task writes them in order; both write through the
connection's one :class:`~epd_actors.transport.nowait.NowaitWriter`, which
refuses a write while another is in progress.  When the kernel takes only part of
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

from ..request import DeltaEvent
from .event_batches import next_batch

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..handoff import HandoffReceiver
    from ..openai.format import SseFormatter
    from ..request import GenerationEvent
    from ..transport.nowait import NowaitWriter


class SentCounter(Protocol):
    """Where a response's byte count is kept (the exchange's log record)."""

    sent: int


class DirectSseWriter:
    """A streaming response's direct writer (see the module docstring).

    Args:
        frame: frames a piece of the response's body (:func:`~epd_actors.http.body.body_framer`).
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
        self.written: DeltaEvent | None = None  # refused, but its chunk is in the backlog

    def __call__(self, event: GenerationEvent) -> bool:
        """Write ``event`` now (the channel calls it); False to have it queued.

        False also when the chunk was only partly written: the event is then
        queued just to wake the connection's task (:meth:`next_batch` drops it).
        """
        if self.backlog or self.failed or type(event) is not DeltaEvent:
            return False  # usage, done and error events go to the connection's task
        # ``worth_a_chunk`` inline (once per token): nothing to render, as in a batch.
        if not (event.text or event.fields or (self._logprobs and event.token_ids)):
            return True
        text = self._formatter.event(event)
        data = self._frame(text.encode("utf-8", "replace"))
        try:
            written = self._writer.send_some_nowait(data)
        except trio.BusyResourceError:  # never while the connection's task waits
            return False
        except trio.BrokenResourceError:
            self.failed = True
            return False
        if self._exchange is not None:
            self._exchange.sent += written
        if written < len(data):
            self.backlog = data[written:]
            self.written = event
            return False
        return True

    async def next_batch(self, events: HandoffReceiver[GenerationEvent]) -> list[GenerationEvent]:
        """:func:`~.event_batches.next_batch`, less the event whose chunk is in the backlog.

        Attach this writer to ``events`` first to have it take deltas meanwhile.

        Cancellation and backpressure: as :func:`~.event_batches.next_batch`.
        """
        batch = await next_batch(events)
        written, self.written = self.written, None
        if written is not None and batch and batch[0] is written:
            del batch[0]
        return batch

    def take_backlog(self) -> bytes:
        """What a direct write left unwritten; the caller writes it before anything else."""
        backlog, self.backlog = self.backlog, b""
        return backlog
