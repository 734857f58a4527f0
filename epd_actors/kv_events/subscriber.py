"""One KV event subscriber per (router, worker): ZMQ SUB in a thread -> bounded channel -> index.

Theory of operation
-------------------
:class:`KVEventSubscriber` runs two tasks:

- the **pump** asks its :class:`KVEventSource` for whatever arrived (raw
  multipart messages, or a disconnect) and sends each into a bounded Trio
  memory channel (``buffer`` items);
- the **applier** takes them in order, decodes them (:mod:`.decode`), feeds
  them to the worker's :class:`~.feed.FeedTracker` and, when it asks for one,
  runs the replay through the source before taking the next message.

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
``buffer`` + ``rcvhwm`` messages of at most ``max_payload_bytes`` each.

pyzmq is the optional ``kv-events`` extra; :class:`ZmqEventSource` imports it
when built and says how to install it when it is missing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

from ..errors import ConfigError
from .decode import (
    END_OF_REPLAY,
    MAX_PAYLOAD_BYTES,
    KVEventDecodeError,
    decode_message,
    decode_replay_frames,
    decode_seq,
)
from .feed import RECOVERY_BATCHES, FeedTracker
from .zmq_import import import_zmq

if TYPE_CHECKING:
    from .decode import EventBatch
    from .feed import FeedState, FeedStatistics
    from .index import KVBlockIndex

__all__ = [
    "DISCONNECTED",
    "KVEventSource",
    "KVEventSubscriber",
    "ReplayAnswer",
    "ZmqEventSource",
]

logger = logging.getLogger(__name__)

DISCONNECTED: Final = "disconnected"
"""What a source yields when its connection to the publisher dropped."""

Frames = Sequence[bytes]


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    """What a replay request got: the frames received, and whether the end marker came."""

    frames: tuple[Frames, ...]
    complete: bool


class KVEventSource(Protocol):
    """Where a subscriber's messages come from (ZMQ, or a fake in tests)."""

    async def receive(self) -> list[Frames | str]:
        """Wait for messages; returns one or more multipart messages or ``DISCONNECTED``."""
        ...

    async def replay(self, start_seq: int) -> ReplayAnswer | None:
        """Ask for the batches from ``start_seq`` on; None when there is no replay socket."""
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

    async def receive(self) -> list[Frames | str]:
        """Wait (in a thread, ``poll_interval_s`` at a time) until something arrives.

        Cancellation: honoured between thread calls, so within ``poll_interval_s``.
        """
        if self._sub is None:
            raise RuntimeError("ZmqEventSource is not open")
        while True:
            got = await trio.to_thread.run_sync(self._poll_once)
            if got:
                return got

    def _poll_once(self) -> list[Frames | str]:
        zmq = self._zmq
        ready = dict(self._poller.poll(self._poll_ms))
        out: list[Frames | str] = []
        if self._monitor in ready:
            from zmq.utils.monitor import recv_monitor_message

            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    out.append(DISCONNECTED)
        if self._sub in ready:
            while len(out) < self._max_messages:
                try:
                    out.append(self._sub.recv_multipart(zmq.NOBLOCK, copy=True))
                except zmq.Again:
                    break
        return out

    async def replay(self, start_seq: int) -> ReplayAnswer | None:
        """Ask the ROUTER for batches from ``start_seq`` on, in a thread.

        Returns None without a replay endpoint.  Cancellation: deferred until
        the answer ends or ``replay_timeout_s`` passes.
        """
        if self.replay_endpoint is None:
            return None
        return await trio.to_thread.run_sync(self._replay_blocking, start_seq)

    def _replay_blocking(self, start_seq: int) -> ReplayAnswer:
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_payload + 4096)
        frames: list[Frames] = []
        try:
            return self._replay_on(dealer, start_seq, frames)
        except zmq.ZMQError as e:
            logger.warning("KV event replay from %s failed: %s", self.replay_endpoint, e)
            return ReplayAnswer(tuple(frames), complete=False)
        finally:
            dealer.close(linger=0)

    def _replay_on(self, dealer: Any, start_seq: int, frames: list[Frames]) -> ReplayAnswer:
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        timeout_ms = max(1, round(self._replay_timeout_s * 1000))
        while len(frames) < self._max_replay and dealer.poll(timeout_ms):
            message = dealer.recv_multipart()
            seq_frame = message[-2] if len(message) >= 2 else b""
            if len(seq_frame) == 8 and decode_seq(seq_frame) == END_OF_REPLAY:
                return ReplayAnswer(tuple(frames), complete=True)
            frames.append(message)
        return ReplayAnswer(tuple(frames), complete=False)


class KVEventSubscriber:
    """Feeds one worker's KV events into a shared index.

    Args:
        worker_id: the worker whose engine publishes.
        source: where its messages come from (:class:`ZmqEventSource`).
        index: the shared index.
        buffer: messages the pump may queue ahead of the applier (>= 1).
        recovery_batches: see :class:`~.feed.FeedTracker`.
        max_payload_bytes: passed to the decoder.
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
    ) -> None:
        if buffer < 1:
            raise ConfigError(f"KV event subscriber buffer must be >= 1, got {buffer}")
        self.worker_id = worker_id
        self._source = source
        self._buffer = buffer
        self._max_payload = max_payload_bytes
        self.tracker = FeedTracker(worker_id, index, recovery_batches=recovery_batches)

    @property
    def state(self) -> FeedState:
        return self.tracker.state

    def statistics(self) -> FeedStatistics:
        return self.tracker.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe until cancelled (see the module docstring for cancellation)."""
        send, receive = trio.open_memory_channel[Frames | str](self._buffer)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, send)
                task_status.started()
                await self._apply_all(receive)
        finally:
            self.tracker.stopped()

    async def _pump(self, send: trio.MemorySendChannel[Frames | str]) -> None:
        async with send:
            while True:
                for item in await self._source.receive():
                    await send.send(item)

    async def _apply_all(self, receive: trio.MemoryReceiveChannel[Frames | str]) -> None:
        async with receive:
            async for item in receive:
                await self._apply_one(item)

    async def _apply_one(self, item: Frames | str) -> None:
        if isinstance(item, str):
            self.tracker.disconnected()
            return
        try:
            message = decode_message(item, max_payload_bytes=self._max_payload)
        except KVEventDecodeError as e:
            logger.warning("%s: bad KV event message: %s", self.worker_id, e)
            self.tracker.undecodable(_seq_of(item))
            return
        request = self.tracker.receive(message.seq, message.batch)
        if request is not None:
            self.tracker.replayed(await self._replay(request.start))

    async def _replay(self, start: int) -> list[tuple[int, EventBatch | None]] | None:
        answer = await self._source.replay(start)
        if answer is None:
            return None
        out: list[tuple[int, EventBatch | None]] = []
        for frames in answer.frames:
            try:
                seq, batch = decode_replay_frames(frames, max_payload_bytes=self._max_payload)
            except KVEventDecodeError as e:
                logger.warning("%s: bad KV replay frame: %s", self.worker_id, e)
                continue
            if seq != END_OF_REPLAY:
                out.append((seq, batch))
        return out


def _seq_of(frames: Frames) -> int | None:
    if len(frames) != 3:
        return None
    try:
        seq = decode_seq(bytes(frames[1]))
    except KVEventDecodeError:
        return None
    return seq if seq >= 0 else None
