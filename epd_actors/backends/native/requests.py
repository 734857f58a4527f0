"""What a :class:`~.backend.NativeBackend` multiplexes: the connection, each request, each stream.

``_Connection`` is one welcomed connection; ``_Outbox`` holds the frames
waiting for its writer; ``_Pending`` is one registered request with its
bounded reply channel; :class:`NativeDeltaStream` is what a caller of
``open_stream`` reads.  The backend (see :mod:`.backend`) routes replies into
them and owns their lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import trio

from ...errors import RemoteWorkerError
from ...handoff import open_handoff
from ...protocol import (
    Delta,
    EncodeRequest,
    ErrorReply,
    GenerateRequest,
    PrefillRequest,
    Release,
    Released,
    StageResult,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...errors import WorkerError
    from ...handoff import HandoffReceiver, HandoffSender, Taker
    from ...protocol import Welcome
    from ...transport.framed import FramedStream

_Reply = StageResult | Delta | ErrorReply | Released
_Outgoing = EncodeRequest | PrefillRequest | GenerateRequest | Release

# What each kind of request may be answered with (anything else closes the connection).
_STAGE_REPLIES = (StageResult, ErrorReply)
_STREAM_REPLIES = (Delta, ErrorReply)
_RELEASE_REPLIES = (Released, ErrorReply)


class _Outbox:
    """Encoded frames waiting for a connection's writer task.

    Two queues: *control* frames (``Ping``, ``Abort``) and *data* frames (the
    requests).  The writer takes both whole -- control first -- and writes them
    with one ``send_all``, so a burst of submissions costs a few writes, not one
    each.  The data queue is bounded by ``max_frames`` and ``max_bytes``
    (a frame is always admitted into an empty queue); a submitter that finds it
    full parks in :meth:`wait_for_room` until the writer has taken the queue.
    The control queue is not bounded by those limits, so a ``Ping`` or an
    ``Abort`` never waits behind requests: it holds at most one ``Abort`` per
    registered request and one ``Ping`` per heartbeat interval until the
    heartbeat deadline ends a stuck connection.

    Data frames are numbered in queue order; :meth:`still_queued` tells
    whether a frame has not been taken by the writer yet (an ``Abort`` for
    such a request is queued behind it, in the data queue, to keep the order).
    """

    __slots__ = (
        "_space",
        "_work",
        "closed",
        "control",
        "data",
        "data_bytes",
        "data_queued",
        "data_taken",
        "max_bytes",
        "max_frames",
    )

    def __init__(self, *, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.control: list[bytes] = []
        self.data: list[bytes] = []
        self.data_bytes = 0
        self.data_queued = 0  # data frames ever queued: the next frame's number
        self.data_taken = 0  # data frames the writer has taken
        self.closed = False
        self._work = trio.lowlevel.ParkingLot()  # the writer, while nothing is queued
        self._space = trio.lowlevel.ParkingLot()  # submitters, while the data queue is full

    def has_room(self, size: int) -> bool:
        """Whether a data frame of ``size`` bytes may be queued now."""
        data = self.data
        return not data or (
            len(data) < self.max_frames and self.data_bytes + size <= self.max_bytes
        )

    async def wait_for_room(self, size: int) -> None:
        """Return once a data frame of ``size`` bytes may be queued, or the outbox is closed.

        A submitter does not pass others already waiting for room.  Not a
        checkpoint when there is room: the caller queues its frame in the same
        step, so the bound holds without a second check.

        Cancellation: safe; nothing was queued.
        """
        if self.closed or (self.has_room(size) and not self._space.statistics().tasks_waiting):
            return
        while True:
            await self._space.park()
            if self.closed or self.has_room(size):
                return

    def put_data(self, frame: bytes) -> int:
        """Queue a data frame (the caller checked for room); return its number."""
        if not self.control and not self.data:
            self._work.unpark()
        self.data.append(frame)
        self.data_bytes += len(frame)
        number = self.data_queued
        self.data_queued += 1
        return number

    def put_control(self, frame: bytes) -> None:
        """Queue a control frame; it goes out with the writer's next batch."""
        if not self.control and not self.data:
            self._work.unpark()
        self.control.append(frame)

    def put_after(self, number: int, frame: bytes) -> None:
        """Queue a control frame that must follow data frame ``number`` on the wire."""
        if self.still_queued(number):
            self.put_data(frame)  # behind it; not counted against the bound's waiters
        else:
            self.put_control(frame)

    def still_queued(self, number: int) -> bool:
        """Whether data frame ``number`` has not been taken by the writer yet."""
        return number >= self.data_taken

    async def wait_for_work(self) -> None:
        """Return once a frame is queued (the writer's wait).

        Cancellation: safe.
        """
        while not self.control and not self.data:
            await self._work.park()

    def take(self) -> tuple[bytes, int]:
        """Take every queued frame, control first: the bytes to write and the frame count."""
        frames = self.control + self.data if self.control else self.data
        count = len(frames)
        batch = b"".join(frames)
        self.control = []
        self.data = []
        self.data_bytes = 0
        self.data_taken = self.data_queued
        self._space.unpark_all()
        return batch, count

    def close(self) -> None:
        """Drop what is queued and wake every waiting submitter (the connection ended)."""
        self.closed = True
        self.control = []
        self.data = []
        self.data_bytes = 0
        self._space.unpark_all()


class _Connection:
    """One welcomed connection: its stream, its outbox, its task scope and heartbeat state.

    ``held``: the deltas of the read being routed that go to their streams' sinks
    at the end of the read, merged per stream.
    """

    __slots__ = (
        "framed",
        "held",
        "nonce",
        "nursery",
        "outbox",
        "pings",
        "reason",
        "scope",
        "watchdog",
        "welcome",
    )

    def __init__(
        self, framed: FramedStream, welcome: Welcome, *, max_frames: int, max_bytes: int
    ) -> None:
        self.framed = framed
        self.held: dict[_Pending, list[Delta]] = {}
        self.welcome = welcome
        self.outbox = _Outbox(max_frames=max_frames, max_bytes=max_bytes)
        self.scope = trio.CancelScope()
        self.watchdog = trio.CancelScope()
        self.nursery: trio.Nursery | None = None
        self.nonce = 0
        self.pings: dict[int, float] = {}  # nonce -> send time, of unanswered pings
        self.reason: str | None = None

    def close(self, reason: str) -> None:
        """End the connection (its tasks are cancelled); the first reason sticks."""
        if self.reason is None:
            self.reason = reason
        self.scope.cancel(reason=reason)
        self.outbox.close()


class _Pending:
    """One registered request: its bounded reply channel and how far it got.

    ``accepting``: the reader may still deliver replies.  ``failure``: set once;
    the next receive raises it.  ``settled``: the worker holds nothing more for
    the request (its terminal reply or ``Aborted`` arrived, or the connection
    is gone), so cleanup need not abort it.  The replies travel on a hand-off
    channel (:mod:`~epd_actors.handoff`); see :meth:`NativeDeltaStream.set_sink`.
    """

    __slots__ = (
        "abort_sent",
        "abortable",
        "accepting",
        "connection",
        "expects",
        "failure",
        "number",
        "receive_channel",
        "request_id",
        "send_channel",
        "sent",
        "settled",
        "stage",
        "worker_id",
    )

    def __init__(
        self,
        message: _Outgoing,
        connection: _Connection,
        *,
        worker_id: str,
        expects: tuple[type[_Reply], ...],
        capacity: int,
    ) -> None:
        self.request_id = message.request_id
        self.stage = message.TAG
        self.worker_id = worker_id
        self.connection = connection
        self.expects = expects
        self.abortable = not isinstance(message, Release)
        # Typed by annotation, not by subscripting the call (a typing look-up per request).
        self.send_channel: HandoffSender[_Reply]
        self.receive_channel: HandoffReceiver[_Reply]
        self.send_channel, self.receive_channel = open_handoff(capacity)
        self.accepting = True
        self.failure: WorkerError | None = None
        self.settled = trio.Event()
        self.sent = False  # the request frame is queued or written
        self.number = -1  # the request frame's number in the connection's outbox
        self.abort_sent = False

    def stop_accepting(self) -> None:
        self.accepting = False
        self.send_channel.close()

    def settle(self) -> None:
        self.stop_accepting()
        self.settled.set()

    def fail(self, failure: WorkerError) -> None:
        if self.failure is None:
            self.failure = failure
        self.stop_accepting()

    async def receive(self) -> _Reply:
        """The next reply; an ``ErrorReply`` is raised as ``RemoteWorkerError``.

        Raises:
            trio.EndOfChannel: the terminal reply was already received.
            RemoteWorkerError, WorkerDisconnected, StreamOverrun: the request failed.
        """
        if self.failure is not None:
            raise self.failure
        try:
            reply = await self.receive_channel.receive()
        except trio.EndOfChannel:
            if self.failure is not None:
                raise self.failure from None
            raise
        return self._checked(reply)

    def receive_nowait(self) -> _Reply:
        """The next reply if one is already buffered (same errors as :meth:`receive`).

        Raises:
            trio.WouldBlock: no reply is buffered yet.
        """
        if self.failure is not None:
            raise self.failure
        try:
            reply = self.receive_channel.receive_nowait()
        except trio.EndOfChannel:
            if self.failure is not None:
                raise self.failure from None
            raise
        return self._checked(reply)

    def _checked(self, reply: _Reply) -> _Reply:
        if isinstance(reply, ErrorReply):
            raise RemoteWorkerError(
                reply.code,
                reply.message,
                retryable=reply.retryable,
                worker_id=self.worker_id,
                stage=self.stage,
                request_id=self.request_id,
                param=reply.param,
            )
        return reply


class NativeDeltaStream:
    """The deltas of one generate request (a ``DeltaStream``); ``async for`` works too.

    Valid only inside the ``open_stream`` context that made it.
    """

    __slots__ = ("_pending",)

    def __init__(self, pending: _Pending) -> None:
        self._pending = pending

    def __repr__(self) -> str:
        return f"<NativeDeltaStream {self._pending.request_id} on {self._pending.worker_id}>"

    def set_sink(self, sink: Callable[[Delta], bool]) -> None:
        """Let the connection's reader hand non-final deltas to ``sink`` directly.

        While the reader of this stream waits in :meth:`receive` with nothing
        queued, each non-final delta that arrives goes to ``sink`` in the
        connection reader's task, without waking this stream's reader.  ``sink``
        must not raise or block; returning False means it did not take the
        delta, which is then queued as usual -- and so is everything after it,
        until this stream's reader has caught up and waits again, so the order
        of the deltas always holds (the hand-off channel's rule).  The terminal
        delta and errors are always queued.

        ``sink`` is the channel's taker as it is: the connection's reader
        offers it only non-final deltas (``send_nowait``) and queues every
        other reply past it (``queue_nowait``), so no wrapper checks each reply.
        """
        self._pending.receive_channel.attach(cast("Taker[_Reply]", sink))

    async def receive(self) -> Delta:
        """The next delta.

        Raises:
            trio.EndOfChannel: the terminal delta was already returned.
            RemoteWorkerError: the worker answered with an error.
            WorkerDisconnected: the connection was lost.
            StreamOverrun: this stream was read too slowly and was aborted.

        Cancellation: safe; nothing is lost (the context's exit aborts the request).
        Backpressure: none towards the worker; a reader that falls
        ``request_buffer`` replies behind gets ``StreamOverrun``.
        """
        reply = await self._pending.receive()
        assert isinstance(reply, Delta)  # the reader checked the reply kind
        return reply

    def receive_nowait(self) -> Delta:
        """The next delta if it already arrived; what :meth:`receive` raises, or ``WouldBlock``.

        Lets a relay pass on a burst of deltas without a scheduling round per delta.
        """
        reply = self._pending.receive_nowait()
        assert isinstance(reply, Delta)  # the reader checked the reply kind
        return reply

    def __aiter__(self) -> NativeDeltaStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
