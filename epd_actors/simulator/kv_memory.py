"""KV events of an in-process simulated engine, without sockets: :class:`MemoryKVEventPublisher`.

Theory of operation
-------------------
The same frames as :class:`~.kv_events.SimKVEventPublisher` (vLLM's
``ZmqEventPublisher``), handed over in memory: :meth:`publish` (the prefix
cache's sink) numbers each batch from 0, encodes it with
:func:`~.kv_events.encode_batch`, keeps the last ``buffer_steps`` for replay
and queues ``[topic, seq, payload]`` for the one subscriber.  The object is
also that subscriber's :class:`~epd_actors.kv_events.subscriber.KVEventSource`
(``receive``, ``replay``), so an in-process fleet (tests, benchmarks) runs
the router's real subscriber, decoder and index.  It decodes with the
subscriber's decoders on the calling (Trio) thread: it has no receiving
thread, and tests stay deterministic.

Backpressure: the queue holds ``max_queue`` messages; a batch that does not
fit is dropped and counted (``dropped``), leaving a gap the subscriber
replays, as PUB's high-water mark would.  :meth:`publish` never blocks.
Call it from the Trio thread (the engine's).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio

from ..kv_events.subscriber import ReplayAnswer
from .kv_events import encode_batch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..kv_events.decode import KVEvent
    from ..kv_events.subscriber import LiveDecoder, Received, ReplayDecoder

__all__ = ["MemoryKVEventPublisher"]


class MemoryKVEventPublisher:
    """An in-memory KV event publisher and the source its one subscriber reads.

    Args:
        topic: the topic frame.
        encoding: ``map`` or ``array`` (see :func:`~.kv_events.encode_batch`).
        buffer_steps: batches kept for replay (vLLM: 10,000).
        max_queue: messages queued for the subscriber before new ones drop.
    """

    def __init__(
        self,
        *,
        topic: bytes = b"kv",
        encoding: str = "map",
        buffer_steps: int = 10_000,
        max_queue: int = 10_000,
    ) -> None:
        self.topic = topic
        self.encoding = encoding
        self.seq = 0
        self.dropped = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._send, self._receive = trio.open_memory_channel[list[bytes]](max(1, max_queue))

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Number, encode, keep and queue one batch (dropped when the queue is full)."""
        payload = encode_batch(events, ts=0.0, encoding=self.encoding)
        seq, self.seq = self.seq, self.seq + 1
        self._buffer.append((seq, payload))
        try:
            self._send.send_nowait([self.topic, seq.to_bytes(8, "big"), payload])
        except trio.WouldBlock:
            self.dropped += 1

    async def receive(self, decode: LiveDecoder) -> list[Received]:
        """Wait for the next message; returns it with every one queued behind it, decoded."""
        out: list[Received] = [decode(await self._receive.receive())]
        while True:
            try:
                out.append(decode(self._receive.receive_nowait()))
            except trio.WouldBlock:
                return out

    async def replay(self, start_seq: int, decode: ReplayDecoder) -> ReplayAnswer | None:
        """The kept batches from ``start_seq`` on, as a ROUTER socket answers them, decoded."""
        await trio.lowlevel.checkpoint()
        decoded = (
            decode([b"", seq.to_bytes(8, "big"), payload])
            for seq, payload in self._buffer
            if seq >= start_seq
        )
        return ReplayAnswer(tuple(d for d in decoded if d is not None), complete=True)
