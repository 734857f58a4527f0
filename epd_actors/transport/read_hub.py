"""One task reads many sockets: each readable one once per scheduler pass.

Theory of operation
-------------------
A streamed response arrives in small pieces -- one engine step's token every
10 or 30 ms -- on a connection of its own.  Read the usual way, every piece
costs its reader a full round: a ``recv`` that finds nothing, a re-arm of
Trio's one-shot ``epoll`` registration, a park, a wake-up through the
scheduler and a timeout scope, then the ``recv`` that gets the bytes.  With
hundreds of streams in step, that round is most of what the router does per
token besides parsing and writing.

A :class:`ReadHub` keeps the sockets of parked readers in an ``epoll`` set of
its own, level-triggered, so a socket is registered once per wait rather than
once per read.  Its one task waits for that set to become readable (Trio
watches the set's file descriptor like any other), asks the set which sockets
are readable, and calls each one's *handler* once: the handler reads what is
there without waiting and passes it on, in the hub's task.  Every stream with
data is handled in the same pass, up to ``max_per_pass`` of them; a socket
that still has bytes after its one read, or that was left for the next pass,
is reported again then (the kernel's ready list turns round), so one busy
stream cannot starve the others.  The hub checkpoints between passes, so a
pass over hundreds of streams that got their tokens on the same engine step
does not hold up the router's other tasks (a new request's parse, its
prefill call) for all of it.

The owner of a socket -- the task that would otherwise read it -- calls
:meth:`ReadHub.serve` and stays parked while its handler returns True.  The
handler returns False (or raises) when the owner must take over: something it
cannot pass on without waiting, the end of the stream, a failure.  The owner
then resumes, with the handler's exception if it raised one.

Which platforms: ``select.epoll`` (Linux).  Elsewhere :attr:`ReadHub.available`
is False, :meth:`ReadHub.run` returns at once and :meth:`ReadHub.serve`
returns False, and owners read their sockets themselves, as they do whenever
the hub is not running.

Cancellation: a cancelled owner leaves the set before it resumes (its handler
is never called again); the hub's own cancellation hands every owner back.
Backpressure: none of its own -- a handler that cannot pass its data on hands
its owner back, and the owner waits the usual way.
"""

from __future__ import annotations

import contextlib
import select
from typing import TYPE_CHECKING, Final

import outcome
import trio

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ReadHub"]

_EPOLL: Final = getattr(select, "epoll", None)
_READABLE: Final = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0)
MAX_PER_PASS: Final = 64
"""Handlers a pass calls at most, by default, before the hub lets other tasks run."""


class _Watch:
    """One parked owner: its task, its socket's descriptor and its handler."""

    __slots__ = ("fd", "handle", "task")

    def __init__(self, fd: int, handle: Callable[[], bool], task: trio.lowlevel.Task) -> None:
        self.fd = fd
        self.handle = handle
        self.task = task


class ReadHub:
    """Reads the sockets of parked owners in one task (see the module docstring).

    One hub serves the sockets of one component (a backend's streams); its
    :meth:`run` task lives in that component's nursery.

    Args:
        max_per_pass: the readable sockets handled in one pass at most (>= 1).
    """

    available: Final = _EPOLL is not None
    """Whether this platform has what the hub needs (``select.epoll``)."""

    __slots__ = ("_epoll", "_watching", "max_per_pass", "passes")

    def __init__(self, max_per_pass: int = MAX_PER_PASS) -> None:
        if max_per_pass < 1:
            raise ValueError(f"max_per_pass must be at least 1, not {max_per_pass}")
        self.max_per_pass = max_per_pass
        self._epoll: select.epoll | None = None  # while run() runs
        self._watching: dict[int, _Watch] = {}
        self.passes = 0  # scheduler passes that found readable sockets

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ReadHub {state} watching={len(self._watching)}>"

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is running (owners can be served)."""
        return self._epoll is not None

    @property
    def watching(self) -> int:
        """How many owners are parked on the hub now."""
        return len(self._watching)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Call the handlers of readable sockets until cancelled.

        Reports started once owners can be served.  On a platform without
        ``epoll`` it reports started and returns at once.

        Raises:
            trio.BusyResourceError: ``run`` is already running for this hub.

        Cancellation: every parked owner is handed back (its :meth:`serve`
        returns False) and the ``epoll`` set is closed.
        """
        if self._epoll is not None:
            raise trio.BusyResourceError(f"{self!r} is already running")
        if _EPOLL is None:
            task_status.started()
            return
        epoll = self._epoll = _EPOLL()
        fd = epoll.fileno()
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(fd)
                ready = epoll.poll(0, self.max_per_pass)
                if ready:
                    self.passes += 1
                for ready_fd, _events in ready:
                    watch = self._watching.get(ready_fd)
                    if watch is None:  # handed back earlier in this pass
                        continue
                    try:
                        keep = watch.handle()
                    except Exception as exc:  # the owner raises it; the hub goes on
                        self._hand_back(watch, outcome.Error(exc))
                        continue
                    if not keep:
                        self._hand_back(watch, outcome.Value(True))
        finally:
            # The set closes below: the owners only need resuming, not unregistering.
            self._epoll = None
            watching, self._watching = self._watching, {}
            for watch in watching.values():
                trio.lowlevel.reschedule(watch.task, outcome.Value(False))
            trio.lowlevel.notify_closing(fd)
            epoll.close()

    async def serve(self, sock: trio.socket.SocketType, handle: Callable[[], bool]) -> bool:
        """Stay parked while the hub calls ``handle`` each time ``sock`` is readable.

        ``handle`` runs in the hub's task, never while the caller runs: it
        reads what is there without waiting and returns True to be called
        again, False to resume the caller.  It must not block.

        Returns:
            True when ``handle`` returned False (or :meth:`release` was
            called); False at once, or later, when the hub is not running or
            stopped, or cannot watch ``sock`` (closed): the caller reads
            ``sock`` itself, and its own read reports what is wrong.

        Raises:
            what ``handle`` raised (the caller resumes with it).
            trio.BusyResourceError: another owner is parked on ``sock``.

        Cancellation: ``sock`` leaves the set before the caller resumes;
        ``handle`` is not called again.
        """
        epoll = self._epoll
        if epoll is None:
            return False
        fd = sock.fileno()
        if fd in self._watching:
            raise trio.BusyResourceError("another task is already served on this socket")
        try:
            epoll.register(fd, _READABLE)
        except (OSError, ValueError):  # closed (-1), or not a pollable socket: the caller reads
            return False
        watch = self._watching[fd] = _Watch(fd, handle, trio.lowlevel.current_task())

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._leave(watch)
            return trio.lowlevel.Abort.SUCCEEDED

        served: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return served

    def release(self, sock: trio.socket.SocketType) -> None:
        """Resume the owner parked on ``sock`` now, if any (its :meth:`serve` returns True).

        Called before closing a socket that may be served (from any task);
        never waits.
        """
        watch = self._watching.get(sock.fileno())
        if watch is not None:
            self._hand_back(watch, outcome.Value(True))

    def _hand_back(self, watch: _Watch, result: outcome.Outcome[bool]) -> None:
        self._leave(watch)
        trio.lowlevel.reschedule(watch.task, result)

    def _leave(self, watch: _Watch) -> None:
        if self._watching.get(watch.fd) is watch:
            del self._watching[watch.fd]
        epoll = self._epoll
        if epoll is not None:
            # OSError: closed already (the kernel dropped it from the set).
            with contextlib.suppress(OSError):
                epoll.unregister(watch.fd)
