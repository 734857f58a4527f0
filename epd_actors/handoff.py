"""A bounded channel whose sender hands an item straight to a waiting receiver.

Theory of operation
-------------------
A stream of small items (a request's tokens) crosses several tasks on its way
out: a backend's reader, the output job, the front end's writer.  Waking each
task once per item costs more than the item's own work, so the receiving end
may *attach a taker*: a callable that consumes an item in the sending task,
without waking the receiver.  One rule keeps the order of the items:

    hand an item over directly only while the receiver waits with nothing
    queued; after a refusal, queue until the receiver has caught up.

The receiver "waits with nothing queued" from the moment :meth:`HandoffReceiver.receive`
finds the buffer empty and parks, to the moment it runs again.  While it does,
:meth:`HandoffSender.send_nowait` calls the taker; True means the item was
consumed there and then.  False (a full socket, a partial write) ends the
direct hand-over: the item is queued -- which wakes the receiver -- and so is
every item after it until the receiver waits on an empty buffer again.  A
taker never runs while the receiver runs, so the two never write to the same
place at once.

Without a taker this is a plain bounded channel (Trio's memory channel, one
sender, one receiver): items are queued in order, a full buffer makes
:meth:`~HandoffSender.send_nowait` raise ``trio.WouldBlock`` and
:meth:`~HandoffSender.send` wait.

Closing: the sender's :meth:`~HandoffSender.close` ends the stream (the
receiver gets ``trio.EndOfChannel`` once the buffer is drained); the receiver's
:meth:`~HandoffReceiver.close` detaches its taker and makes the sender's next
send raise ``trio.BrokenResourceError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar, final

import trio

if TYPE_CHECKING:
    from types import TracebackType
    from typing import Self

T = TypeVar("T")

Taker = Callable[[T], bool]
"""Consumes one item in the sending task: True if it did, False to have it queued.

It must neither block nor raise; it runs only while the receiver waits with
nothing queued (see the module docstring).
"""


class _Shared(Generic[T]):
    """The state both ends see: the queue and whether the receiver waits on it empty."""

    __slots__ = ("direct", "receive", "send", "taker")

    def __init__(self, capacity: int) -> None:
        # Typed by annotation, not by subscripting the call (a typing look-up per channel).
        self.send: trio.MemorySendChannel[T]
        self.receive: trio.MemoryReceiveChannel[T]
        self.send, self.receive = trio.open_memory_channel(capacity)
        self.taker: Taker[T] | None = None
        self.direct = False  # the receiver waits with nothing queued: the taker may take


@final
class open_handoff(tuple["HandoffSender[T]", "HandoffReceiver[T]"]):
    """A new hand-off channel buffering up to ``capacity`` items: its two ends.

    Subscriptable like ``trio.open_memory_channel``: ``open_handoff[Item](n)``.
    """

    __slots__ = ()

    def __new__(  # type: ignore[misc]  # returns a plain tuple, as trio's factory does
        cls, capacity: int
    ) -> tuple[HandoffSender[T], HandoffReceiver[T]]:
        shared: _Shared[T] = _Shared(capacity)  # typed here: no typing look-up per channel
        return HandoffSender(shared), HandoffReceiver(shared)

    def __init__(self, capacity: int) -> None:
        super().__init__()


class _End(Generic[T]):
    """What both ends share: the channel's state, ``queued``, and closing (also as a context)."""

    __slots__ = ("_shared",)

    def __init__(self, shared: _Shared[T]) -> None:
        self._shared = shared

    @property
    def queued(self) -> int:
        """How many items are queued, not yet received."""
        return self._shared.receive.statistics().current_buffer_used

    def close(self) -> None:
        """Close this end (see each end's own)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """:meth:`close`, as an awaitable (a checkpoint)."""
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class HandoffSender(_End[T]):
    """The sending end of a hand-off channel (one sending task at a time)."""

    __slots__ = ()

    def send_nowait(self, item: T) -> None:
        """Hand ``item`` to the taker if the receiver waits on nothing, else queue it.

        Not a checkpoint.

        Raises:
            trio.WouldBlock: the buffer is full (nothing was done).
            trio.BrokenResourceError: the receiver closed its end.
            trio.ClosedResourceError: this end was closed.
        """
        shared = self._shared
        if shared.direct:
            # The taker is called here, not through a helper: once per token relayed.
            taker = shared.taker
            assert taker is not None  # ``direct`` is only set with a taker attached
            if taker(item):
                return
            shared.direct = False  # refused: queue until the receiver caught up
        shared.send.send_nowait(item)

    def queue_nowait(self, item: T) -> None:
        """Queue ``item`` without offering it to the taker; later items queue behind it.

        For an item the taker would refuse anyway (the end of a stream): the
        direct hand-over stops until the receiver has taken it, so nothing
        sent after it can overtake it.  Not a checkpoint.

        Raises:
            trio.WouldBlock: the buffer is full (nothing was done).
            trio.BrokenResourceError: the receiver closed its end.
            trio.ClosedResourceError: this end was closed.
        """
        shared = self._shared
        shared.send.send_nowait(item)
        shared.direct = False

    def offer(self, item: T) -> bool:
        """:meth:`send_nowait`, False instead of ``trio.WouldBlock`` (the others still raise)."""
        try:
            self.send_nowait(item)
        except trio.WouldBlock:
            return False
        return True

    async def send(self, item: T) -> None:
        """Hand over or queue ``item``, waiting for room in the buffer.

        Raises:
            trio.BrokenResourceError: the receiver closed its end.
            trio.ClosedResourceError: this end was closed.

        Cancellation: safe; an item whose send was cancelled was neither
        handed over nor queued.
        Backpressure: waits while ``capacity`` items are queued.
        """
        shared = self._shared
        if shared.direct:
            await trio.lowlevel.checkpoint_if_cancelled()
            if shared.direct:
                try:
                    self.send_nowait(item)  # taken, or refused and queued
                except trio.WouldBlock:
                    pass  # refused, and the buffer is full: wait for room below
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return
        await shared.send.send(item)

    def close(self) -> None:
        """No more items: the receiver ends with ``trio.EndOfChannel`` after the queued ones."""
        self._shared.send.close()


class HandoffReceiver(_End[T]):
    """The receiving end of a hand-off channel (one receiving task at a time)."""

    __slots__ = ()

    def attach(self, taker: Taker[T] | None) -> None:
        """Have ``taker`` consume items in the sending task while this end waits empty.

        None detaches it.  Takes effect at the next :meth:`receive`.
        """
        self._shared.taker = taker
        if taker is None:
            self._shared.direct = False

    async def receive(self) -> T:
        """The next item; while none is queued, the taker (if any) takes them meanwhile.

        Raises:
            trio.EndOfChannel: the sender closed its end and nothing is queued.
            trio.ClosedResourceError: this end was closed.

        Cancellation: safe; an item is either returned or left queued.
        Backpressure: none (the sender waits for room).
        """
        shared = self._shared
        receive = shared.receive
        if shared.taker is not None and not receive.statistics().current_buffer_used:
            shared.direct = True
        try:
            return await receive.receive()
        finally:
            shared.direct = False

    def receive_nowait(self) -> T:
        """The next queued item.

        Raises:
            trio.WouldBlock: nothing is queued.
            trio.EndOfChannel: the sender closed its end and nothing is queued.
            trio.ClosedResourceError: this end was closed.
        """
        return self._shared.receive.receive_nowait()

    def close(self) -> None:
        """Stop receiving: the taker is detached, the sender's next send fails."""
        self.attach(None)
        self._shared.receive.close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
