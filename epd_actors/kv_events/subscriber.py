"""One KV event subscriber per (router, worker): ZMQ SUB in a thread -> bounded channel -> index.

Theory of operation
-------------------
:class:`KVEventSubscriber` runs two tasks:

- the **pump** asks its :class:`KVEventSource` for whatever arrived and
  sends each item into a bounded Trio memory channel (``buffer`` items).
  The source decodes each multipart message (:mod:`.decode`) with the
  decoder the subscriber hands it, where it received the frames: the ZMQ
  source in its receiving thread, so a burst's msgpack never runs on the
  event loop.  An item is a :class:`~.decode.KVEventMessage`, an
  :class:`Undecodable` (counted as a decode error, never fatal), or
  ``DISCONNECTED``.  Replay answers are decoded the same way, in the replay
  thread.
- the **applier** takes the items in order and feeds them to the worker's
  :class:`~.feed.FeedTracker` and, when it asks for one, runs the replay
  through the source before taking the next item.  The tracker's index
  updates are queued and applied in pieces of at most ``apply_blocks``
  blocks (:mod:`.chunks`), with a checkpoint after each piece: a batch of
  thousands of blocks, or a replay of thousands of batches, hands the loop
  back every ``apply_blocks`` blocks instead of holding it throughout.
  Purges are not queued: they drop the updates queued before them and take
  effect at once.  The tracker's counters (``batches``) count a batch when
  it is taken; its blocks reach the index over the pieces that follow.

:class:`ZmqEventSource` is the real source: a pyzmq SUB socket (subscribed to
the topic, ``MAXMSGSIZE`` bounding what libzmq accepts at all), its monitor
socket for disconnects (a restarted engine drops the TCP connection, so the
next batch is treated as a first one even if its sequence number happens to
fit), and a fresh DEALER per replay request (vLLM's ROUTER answers
``[b"", seq, payload]`` frames, then seq -1).  Every blocking zmq call runs in
``trio.to_thread.run_sync`` and waits at most ``poll_interval_s`` (receive) or
``replay_timeout_s`` (replay), one call per socket at a time.

Cancellation: cancelling :meth:`KVEventSubscriber.run` takes effect when the
thread call in progress returns -- within ``poll_interval_s`` for the pump,
``replay_timeout_s`` for a replay -- and the worker's entries are purged (its
state becomes ``fallback``).  Nothing is abandoned in a thread: the sockets are
closed only after their last call returned.

Backpressure: when the applier falls behind, the channel fills, the pump stops
asking, and libzmq queues up to ``rcvhwm`` messages; past that the publisher
drops them for this subscriber, which shows up as a gap and is replayed (or
purged, if the replay buffer no longer holds it).  Memory stays bounded by
``buffer`` decoded batches (plus the ``max_messages`` one receive call
decodes before the pump sends them on) + ``rcvhwm`` raw messages, each of at
most ``max_payload_bytes``; a replay holds at most ``max_replay`` decoded
batches while it is applied.

pyzmq is the optional ``kv-events`` extra; :class:`ZmqEventSource` imports it
when built and says how to install it when it is missing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ..errors import ConfigError
from .chunks import split_events
from .decode import (
    END_OF_REPLAY,
    MAX_PAYLOAD_BYTES,
    KVEventDecodeError,
    KVEventMessage,
    decode_message,
    decode_replay_frames,
    decode_seq,
)
from .feed import RECOVERY_BATCHES, FeedTracker
from .zmq_import import import_zmq

if TYPE_CHECKING:
    from .decode import EventBatch, KVEvent
    from .feed import FeedState, FeedStatistics
    from .index import KVBlockIndex

__all__ = [
    "APPLY_BLOCKS",
    "DISCONNECTED",
    "KVEventSource",
    "KVEventSubscriber",
    "LiveDecoder",
    "Received",
    "ReplayAnswer",
    "ReplayDecoder",
    "Undecodable",
    "ZmqEventSource",
]

logger = logging.getLogger(__name__)

DISCONNECTED: Final = "disconnected"
"""What a source yields when its connection to the publisher dropped."""

APPLY_BLOCKS: Final = 64
"""Blocks the applier applies between two checkpoints (see the module docstring)."""

Frames = Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A live message that did not decode: its sequence number if that frame did, and why."""

    seq: int | None
    error: str


Received = KVEventMessage | Undecodable | str
"""One item a source's ``receive`` returns: decoded, undecodable, or ``DISCONNECTED``."""

LiveDecoder = Callable[[Frames], "KVEventMessage | Undecodable"]
"""Decodes one PUB multipart message; never raises (a bad one is an :class:`Undecodable`)."""

ReplayDecoder = Callable[[Frames], "tuple[int, EventBatch] | None"]
"""Decodes one replay answer: ``(seq, batch)``, or None (bad, or the end marker); never raises."""


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    """What a replay request got: the decoded batches, and whether the end marker came."""

    batches: tuple[tuple[int, EventBatch], ...]
    complete: bool


class KVEventSource(Protocol):
    """Where a subscriber's messages come from (ZMQ, or a fake in tests).

    A source decodes what it received with the decoder it is given, on the
    thread that received it (a thread for ZMQ), so decoding stays off the
    event loop wherever receiving does.
    """

    async def receive(self, decode: LiveDecoder) -> list[Received]:
        """Wait for messages; returns one or more, decoded by ``decode``, or ``DISCONNECTED``."""
        ...

    async def replay(self, start_seq: int, decode: ReplayDecoder) -> ReplayAnswer | None:
        """Ask for the batches from ``start_seq`` on, decoded by ``decode`` (the Nones dropped).

        Returns None when there is no replay socket.
        """
        ...


class ZmqEventSource:
    """A SUB (and, per replay, a DEALER) socket connected to one engine's publisher.

    Args:
        endpoint: the publisher's PUB address, e.g. ``tcp://10.0.0.5:5557``.
        replay_endpoint: its ROUTER address (vLLM's ``replay_endpoint``), or None.
        topic: the topic prefix to subscribe to (vLLM's ``topic``; "" = all).
        poll_interval_s: the longest one receive call waits in its thread.
        replay_timeout_s: the longest a replay waits for its next frame.
        max_replay: the most batches one replay takes (vLLM buffers 10,000).
        max_messages: messages taken per receive call (amortises the thread hop).
        max_payload_bytes: libzmq drops larger messages (and their connection).
        rcvhwm: messages libzmq queues for us before the publisher drops them.
        context: a ``zmq.Context`` (default: the process's shared instance).

    Use as a context manager (or call :meth:`close`): the sockets are created
    and connected on entry.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        poll_interval_s: float = 0.1,
        replay_timeout_s: float = 2.0,
        max_messages: int = 256,
        max_replay: int = 20_000,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        rcvhwm: int = 10_000,
        context: Any = None,
    ) -> None:
        self._zmq = import_zmq()
        if not (poll_interval_s > 0 and math.isfinite(poll_interval_s)):
            raise ConfigError(f"poll_interval_s must be positive, got {poll_interval_s!r}")
        if not (replay_timeout_s > 0 and math.isfinite(replay_timeout_s)):
            raise ConfigError(f"replay_timeout_s must be positive, got {replay_timeout_s!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._replay_timeout_s = replay_timeout_s
        self._max_messages = max(1, max_messages)
        self._max_replay = max(1, max_replay)
        self._max_payload = max_payload_bytes
        self._rcvhwm = rcvhwm
        self._ctx = context if context is not None else self._zmq.Context.instance()
        self._sub: Any = None
        self._monitor: Any = None
        self._poller: Any = None

    def __enter__(self) -> ZmqEventSource:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_payload + 4096)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.endpoint)
        except zmq.ZMQError:
            sub.disable_monitor()
            self._monitor.close(linger=0)
            sub.close(linger=0)
            self._monitor = None
            raise
        self._sub = sub
        self._poller = zmq.Poller()
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets (idempotent); call only when no receive or replay runs."""
        if self._sub is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._sub.close(linger=0)
            self._sub = self._monitor = self._poller = None

    async def receive(self, decode: LiveDecoder) -> list[Received]:
        """Wait (in a thread, ``poll_interval_s`` at a time) until something arrives.

        Each message is decoded by ``decode`` in that thread.  Cancellation:
        honoured between thread calls, so within ``poll_interval_s``.
        """
        if self._sub is None:
            raise RuntimeError("ZmqEventSource is not open")
        while True:
            got = await trio.to_thread.run_sync(self._poll_once, decode)
            if got:
                return got

    def _poll_once(self, decode: LiveDecoder) -> list[Received]:
        zmq = self._zmq
        ready = dict(self._poller.poll(self._poll_ms))
        out: list[Received] = []
        if self._monitor in ready:
            from zmq.utils.monitor import recv_monitor_message

            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    out.append(DISCONNECTED)
        if self._sub in ready:
            while len(out) < self._max_messages:
                try:
                    out.append(decode(self._sub.recv_multipart(zmq.NOBLOCK, copy=True)))
                except zmq.Again:
                    break
        return out

    async def replay(self, start_seq: int, decode: ReplayDecoder) -> ReplayAnswer | None:
        """Ask the ROUTER for batches from ``start_seq`` on, in a thread that decodes them.

        Returns None without a replay endpoint.  Cancellation: deferred until
        the answer ends or ``replay_timeout_s`` passes.
        """
        if self.replay_endpoint is None:
            return None
        return await trio.to_thread.run_sync(self._replay_blocking, start_seq, decode)

    def _replay_blocking(self, start_seq: int, decode: ReplayDecoder) -> ReplayAnswer:
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_payload + 4096)
        batches: list[tuple[int, EventBatch]] = []
        try:
            return self._replay_on(dealer, start_seq, decode, batches)
        except zmq.ZMQError as e:
            logger.warning("KV event replay from %s failed: %s", self.replay_endpoint, e)
            return ReplayAnswer(tuple(batches), complete=False)
        finally:
            dealer.close(linger=0)

    def _replay_on(
        self,
        dealer: Any,
        start_seq: int,
        decode: ReplayDecoder,
        batches: list[tuple[int, EventBatch]],
    ) -> ReplayAnswer:
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        timeout_ms = max(1, round(self._replay_timeout_s * 1000))
        taken = 0
        while taken < self._max_replay and dealer.poll(timeout_ms):
            message = dealer.recv_multipart()
            seq_frame = message[-2] if len(message) >= 2 else b""
            if len(seq_frame) == 8 and decode_seq(seq_frame) == END_OF_REPLAY:
                return ReplayAnswer(tuple(batches), complete=True)
            taken += 1
            decoded = decode(message)
            if decoded is not None:
                batches.append(decoded)
        return ReplayAnswer(tuple(batches), complete=False)


class KVEventSubscriber:
    """Feeds one worker's KV events into a shared index.

    Args:
        worker_id: the worker whose engine publishes.
        source: where its messages come from (:class:`ZmqEventSource`).
        index: the shared index.
        buffer: decoded messages the pump may queue ahead of the applier (>= 1).
        recovery_batches: see :class:`~.feed.FeedTracker`.
        max_payload_bytes: passed to the decoder.
        apply_blocks: blocks applied between two checkpoints (>= 1).
    """

    def __init__(
        self,
        worker_id: str,
        source: KVEventSource,
        index: KVBlockIndex,
        *,
        buffer: int = 64,
        recovery_batches: int = RECOVERY_BATCHES,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        apply_blocks: int = APPLY_BLOCKS,
    ) -> None:
        if buffer < 1:
            raise ConfigError(f"KV event subscriber buffer must be >= 1, got {buffer}")
        if apply_blocks < 1:
            raise ConfigError(f"KV event subscriber apply_blocks must be >= 1, got {apply_blocks}")
        self.worker_id = worker_id
        self._source = source
        self._buffer = buffer
        self._max_payload = max_payload_bytes
        self._index = index
        self._apply_blocks = apply_blocks
        self._updates = _QueuedUpdates(index)
        self.tracker = FeedTracker(worker_id, self._updates, recovery_batches=recovery_batches)
        self.applying = False
        """A taken message's updates (and its replay's) are still going into the
        index: the tracker's ``batches`` counts a batch when it is taken, before
        its pieces are applied."""

    @property
    def state(self) -> FeedState:
        return self.tracker.state

    def statistics(self) -> FeedStatistics:
        return self.tracker.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe until cancelled (see the module docstring for cancellation)."""
        send, receive = trio.open_memory_channel[Received](self._buffer)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, send)
                task_status.started()
                await self._apply_all(receive)
        finally:
            self.tracker.stopped()  # a purge: drops what is still queued

    def decode_live(self, frames: Frames) -> KVEventMessage | Undecodable:
        """The :data:`LiveDecoder` this subscriber hands its source (thread-safe: pure)."""
        try:
            return decode_message(frames, max_payload_bytes=self._max_payload)
        except KVEventDecodeError as e:
            return Undecodable(_seq_of(frames), str(e))

    def decode_replay(self, frames: Frames) -> tuple[int, EventBatch] | None:
        """The :data:`ReplayDecoder` this subscriber hands its source (thread-safe: pure)."""
        try:
            seq, batch = decode_replay_frames(frames, max_payload_bytes=self._max_payload)
        except KVEventDecodeError as e:
            logger.warning("%s: bad KV replay frame: %s", self.worker_id, e)
            return None
        return None if batch is None else (seq, batch)

    async def _pump(self, send: trio.MemorySendChannel[Received]) -> None:
        async with send:
            while True:
                for item in await self._source.receive(self.decode_live):
                    await send.send(item)

    async def _apply_all(self, receive: trio.MemoryReceiveChannel[Received]) -> None:
        async with receive:
            async for item in receive:
                await self._apply_one(item)

    async def _apply_one(self, item: Received) -> None:
        if isinstance(item, str):
            self.tracker.disconnected()
            return
        if isinstance(item, Undecodable):
            logger.warning("%s: bad KV event message: %s", self.worker_id, item.error)
            self.tracker.undecodable(item.seq)
            return
        self.applying = True
        try:
            request = self.tracker.receive(item.seq, item.batch)
            await self._flush()
            if request is not None:
                answer = await self._source.replay(request.start, self.decode_replay)
                self.tracker.replayed(None if answer is None else answer.batches)
                await self._flush()
        finally:
            self.applying = False

    async def _flush(self) -> None:
        """Apply the queued updates, ``apply_blocks`` at a time, checkpointing after each piece.

        Cancellation: at a checkpoint; what is left stays queued and the
        stop's purge drops it.
        """
        while True:
            events = self._updates.take()
            if events is None:
                return
            for piece in split_events(events, self._apply_blocks):
                self._index.apply(self.worker_id, piece)
                await trio.lowlevel.checkpoint()


class _QueuedUpdates:
    """The tracker's :class:`~.feed.IndexWriter`: queues applies, purges at once.

    A purge drops the applies queued before it (the index would forget them
    anyway), so what is queued is always a run of events to apply after the
    index's current state.
    """

    def __init__(self, index: KVBlockIndex) -> None:
        self._index = index
        self._queued: list[Sequence[KVEvent]] = []

    def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self._queued.append(events)

    def purge(self, worker_id: str) -> None:
        self._queued.clear()
        self._index.purge(worker_id)

    def take(self) -> list[KVEvent] | None:
        """Every queued event, in order (None: nothing queued); the queue is left empty."""
        if not self._queued:
            return None
        events = [event for batch in self._queued for event in batch]
        self._queued.clear()
        return events


def _seq_of(frames: Frames) -> int | None:
    if len(frames) != 3:
        return None
    try:
        seq = decode_seq(bytes(frames[1]))
    except KVEventDecodeError:
        return None
    return seq if seq >= 0 else None
