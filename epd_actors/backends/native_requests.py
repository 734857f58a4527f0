"""What a :class:`~.native.NativeBackend` multiplexes: the connection, each request, each stream.

``_Connection`` is one welcomed connection; ``_Pending`` is one registered
request with its bounded reply channel; :class:`NativeDeltaStream` is what a
caller of ``open_stream`` reads.  The backend (see :mod:`.native`) routes
replies into them and owns their lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ..errors import RemoteWorkerError
from ..protocol import (
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
    from ..errors import WorkerError
    from ..protocol import Welcome
    from ..transport import FramedStream

_Reply = StageResult | Delta | ErrorReply | Released
_Outgoing = EncodeRequest | PrefillRequest | GenerateRequest | Release

# What each kind of request may be answered with (anything else closes the connection).
_STAGE_REPLIES = (StageResult, ErrorReply)
_STREAM_REPLIES = (Delta, ErrorReply)
_RELEASE_REPLIES = (Released, ErrorReply)


class _Connection:
    """One welcomed connection: its stream, its task scope and its heartbeat state."""

    __slots__ = ("framed", "nonce", "nursery", "pings", "reason", "scope", "watchdog", "welcome")

    def __init__(self, framed: FramedStream, welcome: Welcome) -> None:
        self.framed = framed
        self.welcome = welcome
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


class _Pending:
    """One registered request: its bounded reply channel and how far it got.

    ``accepting``: the reader may still deliver replies.  ``failure``: set once;
    the next receive raises it.  ``settled``: the worker holds nothing more for
    the request (its terminal reply or ``Aborted`` arrived, or the connection
    is gone), so cleanup need not abort it.
    """

    __slots__ = (
        "abort_sent",
        "abortable",
        "accepting",
        "connection",
        "expects",
        "failure",
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
        self.send_channel, self.receive_channel = trio.open_memory_channel[_Reply](capacity)
        self.accepting = True
        self.failure: WorkerError | None = None
        self.settled = trio.Event()
        self.sent = False
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
