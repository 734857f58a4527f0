"""A bridge from a Trio program to an asyncio event loop running in its own thread.

Theory of operation
-------------------
vLLM's ``AsyncLLM`` is built on asyncio; the worker runtime is Trio.  The two
event loops cannot share a thread, so :func:`open_asyncio_bridge` starts one
dedicated thread that runs a private asyncio loop for as long as the ``async
with`` block lasts, and everything asyncio happens there.  The Trio side never
blocks on that thread; the two sides talk only through thread-safe hand-offs:

* **Trio -> asyncio**: ``loop.call_soon_threadsafe`` schedules a callback on
  the loop (start a task, cancel a task, return stream permits).  Callbacks
  submitted from the Trio thread run in submission order.
* **asyncio -> Trio**: ``TrioToken.run_sync_soon`` runs a small callback in the
  Trio run (set an event, put an item in a memory channel).  Trio runs these in
  strict FIFO order, so a stream's items always arrive before its end.

Three operations are built on that:

* :meth:`AsyncioBridge.run` -- run a coroutine function on the loop as an
  asyncio task and wait for its outcome (value or exception, re-raised in Trio).
* :meth:`AsyncioBridge.run_sync` -- call a plain function on the loop thread
  (e.g. to construct or shut down an object bound to that loop).
* :meth:`AsyncioBridge.open_stream` -- iterate an async iterator on the loop and
  receive its items in Trio through a bounded memory channel.

Backpressure: a stream's producer task holds an ``asyncio.Semaphore`` with
``max_buffer`` permits.  It takes a permit *before* pulling the next item from
its iterator and hands the item over with ``run_sync_soon``; the Trio consumer
gives the permits of a batch back (one ``call_soon_threadsafe`` for the whole
batch) when it asks for the next batch, i.e. after it processed the previous
one.  So at most ``max_buffer`` items exist between the iterator and the
consumer, the Trio channel (capacity ``max_buffer``) can never be full when an
item arrives, and a slow consumer makes the producer wait in ``acquire()``
instead of buffering.

Cancellation: cancelling the Trio side of :meth:`~AsyncioBridge.run` or leaving
an :meth:`~AsyncioBridge.open_stream` block early cancels the asyncio task and
*waits until that task has finished* (so its ``finally`` blocks, e.g. an engine
abort, have run), shielded and bounded by ``CLEANUP_TIMEOUT_S``.  A plain
function given to :meth:`~AsyncioBridge.run_sync` cannot be interrupted; a
cancelled caller waits for it up to the same bound, then abandons it.

Resource handling: leaving :func:`open_asyncio_bridge` stops the loop, which
cancels the tasks still on it, finalizes async generators, closes the loop and
ends the thread; the Trio side waits for that (shielded, bounded by
``BRIDGE_STOP_TIMEOUT_S``).  Calls still pending then fail with
:class:`BridgeClosed`.  The thread is a daemon thread: if the loop is stuck in
blocking code past the bound, the thread is abandoned (logged) rather than
holding the process open.

Costs: each call costs two thread hops (there and back); a stream costs one hop
per item towards Trio and one hop per consumed batch back.  An item should
therefore be a batch in itself (vLLM's ``RequestOutput`` in ``DELTA`` mode is:
vLLM merges the tokens produced while nobody was reading into one output).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, TypeVarTuple, Unpack

import trio

from ...limits import CLEANUP_TIMEOUT_S

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

__all__ = [
    "BRIDGE_STOP_TIMEOUT_S",
    "AsyncioBridge",
    "BridgeClosed",
    "BridgeStatistics",
    "BridgeStream",
    "open_asyncio_bridge",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")

# Seconds the Trio side waits, when the bridge closes, for the asyncio loop to
# cancel its leftover tasks, close and end its thread.  Past it the (daemon)
# thread is abandoned and a warning logged.
BRIDGE_STOP_TIMEOUT_S: Final = 10.0


class BridgeClosed(Exception):
    """The asyncio loop behind the bridge has stopped (or is stopping)."""


@dataclass(frozen=True, slots=True)
class BridgeStatistics:
    """A snapshot of one bridge.

    Attributes:
        running: the loop thread is alive and the bridge is not closing.
        calls_in_flight: ``run``/``run_sync`` calls and streams not finished.
        streams_open: ``open_stream`` blocks currently entered.
        hops_to_asyncio: callbacks scheduled on the loop from Trio (total).
        hops_to_trio: callbacks scheduled in Trio from the loop (total).
    """

    running: bool
    calls_in_flight: int
    streams_open: int
    hops_to_asyncio: int
    hops_to_trio: int


class _Call:
    """One unit of work on the loop: its outcome and how Trio learns of it.

    Written by the loop thread until ``finish`` is scheduled; read by Trio
    after ``done`` is set (``run_sync_soon`` orders the two).
    """

    __slots__ = ("cancel_requested", "done", "error", "on_done", "task", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None
        self.cancel_requested = False
        self.on_done: Callable[[], None] | None = None

    def finish(self) -> None:
        """Trio side: the outcome is in; wake the waiter."""
        if self.done.is_set():
            return
        self.done.set()
        if self.on_done is not None:
            self.on_done()

    def fail(self, error: BaseException) -> None:
        """Trio side: finish with ``error`` unless an outcome arrived already."""
        if not self.done.is_set():
            self.error = error
            self.finish()

    def unwrap(self) -> Any:
        """The outcome, once: the call forgets its value (frames may outlive it)."""
        value, self.value = self.value, None
        if self.error is not None:
            if isinstance(self.error, asyncio.CancelledError):
                raise BridgeClosed("the asyncio task was cancelled by the loop shutting down")
            raise self.error
        return value


class _StreamState:
    """Shared by a stream's producer task (loop thread) and its consumer (Trio)."""

    __slots__ = ("call", "permits", "send_channel", "waiting")

    def __init__(self, send_channel: trio.MemorySendChannel[Any]) -> None:
        self.send_channel = send_channel
        self.call = _Call()
        self.permits: asyncio.Semaphore | None = None  # created on the loop
        self.waiting = False  # the producer waits for a permit (statistics/tests)

    def deliver(self, item: Any) -> None:
        """Trio side (``run_sync_soon``): must never raise."""
        try:
            self.send_channel.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; its exit cancels the producer
        except trio.WouldBlock:  # impossible while permits bound the items in flight
            logger.error("asyncio bridge stream overran its buffer; item dropped")

    def close(self) -> None:
        self.send_channel.close()


class BridgeStream(Generic[T]):
    """The Trio end of :meth:`AsyncioBridge.open_stream`.

    Items arrive in the order the async iterator produced them.  Take them with
    :meth:`receive_batch`; the permits of a batch go back to the producer when
    the next batch is asked for.
    """

    def __init__(
        self,
        bridge: AsyncioBridge,
        state: _StreamState,
        receive_channel: trio.MemoryReceiveChannel[T],
    ) -> None:
        self._bridge = bridge
        self._state = state
        self._receive = receive_channel
        self._taken = 0

    @property
    def producer_waiting(self) -> bool:
        """True while the producer waits for the consumer (a full buffer)."""
        return self._state.waiting

    async def receive_batch(self) -> list[T]:
        """Every item available now (at least one), in order.

        Raises:
            trio.EndOfChannel: the iterator is exhausted (all items were received).
            Exception: whatever the iterator raised, after the items before it.
            BridgeClosed: the loop stopped under the producer.

        Cancellation: safe; no item is lost (it stays in the channel).
        Backpressure: returns the previous batch's permits first (one hop).
        """
        self._give_back()
        try:
            first = await self._receive.receive()
        except trio.EndOfChannel:
            call = self._state.call
            if call.error is not None:
                call.unwrap()
            raise
        batch = [first]
        while True:
            try:
                batch.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._taken = len(batch)
        return batch

    def _give_back(self) -> None:
        if self._taken:
            count, self._taken = self._taken, 0
            self._bridge._to_loop(_release_permits, self._state, count)


class AsyncioBridge:
    """Runs coroutines on an asyncio loop in a dedicated thread; see the module docstring.

    Obtain one with :func:`open_asyncio_bridge`.
    """

    def __init__(self, name: str, trio_token: trio.lowlevel.TrioToken) -> None:
        self.name = name
        self._token = trio_token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)
        self._pending: set[_Call] = set()
        self._closing = False
        self._stopped = trio.Event()
        self._streams_open = 0
        self._hops_to_asyncio = 0
        self._hops_to_trio = 0

    def __repr__(self) -> str:
        state = "running" if self._thread.is_alive() and not self._closing else "closed"
        return f"<AsyncioBridge {self.name} {state} in_flight={len(self._pending)}>"

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread (alive from entry until the bridge closed)."""
        return self._thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The asyncio loop; only the loop thread may use it directly."""
        return self._loop

    def statistics(self) -> BridgeStatistics:
        return BridgeStatistics(
            running=self._thread.is_alive() and not self._closing,
            calls_in_flight=len(self._pending),
            streams_open=self._streams_open,
            hops_to_asyncio=self._hops_to_asyncio,
            hops_to_trio=self._hops_to_trio,
        )

    # -- public operations (Trio side)

    async def run(
        self,
        async_fn: Callable[[Unpack[PosArgsT]], Coroutine[Any, Any, T]],
        *args: *PosArgsT,
    ) -> T:
        """Run ``async_fn(*args)`` as an asyncio task on the loop; return its result.

        Raises:
            Exception: what the coroutine raised.
            BridgeClosed: the bridge is closing or its loop stopped.

        Cancellation: cancels the asyncio task and waits (shielded, at most
        ``CLEANUP_TIMEOUT_S``) until it has finished, then raises ``Cancelled``.
        Backpressure: none; one hop each way.
        """
        call = self._submit(_start_task, self, async_fn, args)
        return await self._wait(call)  # type: ignore[no-any-return]

    async def run_sync(self, fn: Callable[[Unpack[PosArgsT]], T], *args: *PosArgsT) -> T:
        """Call ``fn(*args)`` on the loop thread (inside the running loop).

        For objects that must be built or torn down on the loop (they capture
        the running loop).  ``fn`` blocks the loop while it runs.

        Raises:
            Exception: what ``fn`` raised.
            BridgeClosed: the bridge is closing or its loop stopped.

        Cancellation: ``fn`` cannot be interrupted; a cancelled caller waits for
        it up to ``CLEANUP_TIMEOUT_S`` (shielded), then abandons it.
        """
        call = self._submit(_call_sync, self, fn, args)
        return await self._wait(call)  # type: ignore[no-any-return]

    @asynccontextmanager
    async def open_stream(
        self,
        agen_fn: Callable[[Unpack[PosArgsT]], AsyncIterator[T]],
        *args: *PosArgsT,
        max_buffer: int,
    ) -> AsyncIterator[BridgeStream[T]]:
        """Iterate ``agen_fn(*args)`` on the loop; receive its items in Trio.

        Args:
            agen_fn: returns an async iterator (typically an async generator
                function); it is called on the loop.
            max_buffer: the most items that may exist between the iterator and
                the consumer (>= 1).

        Cancellation: leaving the block before the iterator is exhausted cancels
        the producer task (the iterator is closed with ``aclose()`` on the loop)
        and waits for it to finish, shielded and bounded by ``CLEANUP_TIMEOUT_S``.
        Backpressure: see the module docstring.
        Resource handling: the iterator lives and dies on the loop.
        """
        if max_buffer < 1:
            raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
        send_channel, receive_channel = trio.open_memory_channel[T](max_buffer)
        state = _StreamState(send_channel)
        state.call.on_done = state.close
        self._submit(
            _start_task, self, _pump, (self, state, agen_fn, args, max_buffer), call=state.call
        )
        self._streams_open += 1
        try:
            with receive_channel:
                yield BridgeStream(self, state, receive_channel)
        finally:
            self._streams_open -= 1
            await self._settle(state.call)

    # -- plumbing (Trio side)

    def _submit(self, fn: Callable[..., object], *args: Any, call: _Call | None = None) -> _Call:
        if self._closing:
            raise BridgeClosed(f"the asyncio bridge {self.name} is closed")
        call = _Call() if call is None else call
        self._pending.add(call)
        self._to_loop(fn, call, *args)
        return call

    async def _wait(self, call: _Call) -> Any:
        try:
            await call.done.wait()
        finally:
            await self._settle(call)
        return call.unwrap()

    async def _settle(self, call: _Call) -> None:
        """Make sure ``call`` is over: cancel it and wait (shielded, bounded)."""
        if not call.done.is_set():
            self._to_loop(_cancel_task, call)
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await call.done.wait()
            if not call.done.is_set():
                logger.warning(
                    "%s: asyncio work did not finish within %.1f s of its cancellation; abandoned",
                    self.name,
                    CLEANUP_TIMEOUT_S,
                )
                call.fail(BridgeClosed("abandoned after cancellation"))
        self._pending.discard(call)

    def _to_loop(self, fn: Callable[..., object], *args: Any) -> None:
        self._hops_to_asyncio += 1
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            for arg in args:
                if isinstance(arg, _Call):
                    arg.fail(BridgeClosed(f"the asyncio loop of {self.name} is closed"))

    def _start(self) -> None:
        self._thread.start()

    async def _stop(self) -> None:
        """Stop the loop and wait for the thread (the caller bounds the wait)."""
        self._closing = True
        if self._thread.is_alive():
            self._to_loop(self._loop.stop)
            await self._stopped.wait()
            # The thread's last act was to schedule ``_on_stopped``; it is
            # returning now, so this join is immediate.
            self._thread.join(timeout=1.0)

    def _on_stopped(self) -> None:
        """Trio side: the loop is closed; fail whatever is still waiting."""
        for call in list(self._pending):
            call.fail(BridgeClosed(f"the asyncio loop of {self.name} stopped"))
        self._stopped.set()

    # -- plumbing (loop thread)

    def _to_trio(self, fn: Callable[..., object], *args: Any) -> None:
        self._hops_to_trio += 1
        with contextlib.suppress(trio.RunFinishedError):  # nobody is left to tell
            self._token.run_sync_soon(fn, *args)

    def _thread_main(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            _cancel_leftover_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        except BaseException:
            # Nothing above this frame could handle it: report it and let the
            # waiters on the Trio side fail with BridgeClosed.
            logger.exception("%s: the asyncio loop failed", self.name)
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            self._to_trio(self._on_stopped)


# ---------------------------------------------------------------- loop-side helpers


def _start_task(
    call: _Call,
    bridge: AsyncioBridge,
    async_fn: Callable[..., Coroutine[Any, Any, Any]],
    args: tuple[Any, ...],
) -> None:
    if call.cancel_requested:
        call.error = asyncio.CancelledError()
        bridge._to_trio(call.finish)
        return
    call.task = bridge.loop.create_task(_capture(call, bridge, async_fn, args))


async def _capture(
    call: _Call,
    bridge: AsyncioBridge,
    async_fn: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
) -> None:
    try:
        call.value = await async_fn(*args)
    except BaseException as exc:  # every outcome goes back to Trio, even cancellation
        call.error = exc
    finally:
        bridge._to_trio(call.finish)


def _call_sync(
    call: _Call, bridge: AsyncioBridge, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    try:
        call.value = fn(*args)
    except BaseException as exc:  # delivered to the Trio caller
        call.error = exc
    finally:
        bridge._to_trio(call.finish)


def _cancel_task(call: _Call) -> None:
    call.cancel_requested = True
    if call.task is not None:
        call.task.cancel()


def _release_permits(state: _StreamState, count: int) -> None:
    if state.permits is not None:
        for _ in range(count):
            state.permits.release()


async def _pump(
    bridge: AsyncioBridge,
    state: _StreamState,
    agen_fn: Callable[..., AsyncIterator[Any]],
    args: tuple[Any, ...],
    max_buffer: int,
) -> None:
    """The producer task of a stream: permit, pull, hand over; close the iterator at the end."""
    permits = state.permits = asyncio.Semaphore(max_buffer)
    iterator = agen_fn(*args)
    try:
        while True:
            state.waiting = permits.locked()
            await permits.acquire()
            state.waiting = False
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                return
            bridge._to_trio(state.deliver, item)
    finally:
        state.waiting = False
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


def _cancel_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.wait(tasks, timeout=BRIDGE_STOP_TIMEOUT_S))


# ---------------------------------------------------------------- entry point


@asynccontextmanager
async def open_asyncio_bridge(*, name: str = "asyncio-bridge") -> AsyncIterator[AsyncioBridge]:
    """Start an asyncio loop in a dedicated thread for the duration of the block.

    Args:
        name: the thread's name (shows in logs and thread dumps).

    Cancellation: the block may be cancelled at any point; leaving it always
    stops the loop (see Resource handling).
    Resource handling: on exit the loop cancels its remaining tasks, shuts down
    async generators and its default executor, closes, and the thread ends;
    the wait is shielded and bounded by ``BRIDGE_STOP_TIMEOUT_S``.
    """
    bridge = AsyncioBridge(name, trio.lowlevel.current_trio_token())
    bridge._start()
    try:
        yield bridge
    finally:
        with trio.move_on_after(BRIDGE_STOP_TIMEOUT_S, shield=True):
            await bridge._stop()
        if bridge.thread.is_alive():
            logger.warning(
                "%s: the asyncio thread did not stop within %.1f s; abandoned (daemon)",
                name,
                BRIDGE_STOP_TIMEOUT_S,
            )
