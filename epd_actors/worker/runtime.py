"""The worker runtime: serves the native protocol in front of one engine.

Theory of operation
-------------------
:class:`WorkerServer` accepts connections (``serve``) or is handed streams
directly (``handle_stream``, which tests drive over memory streams).  Each
connection is one :class:`~.connection.Connection`, sharing the worker's
:class:`~.state.WorkerState` (admission, counters, the drain flag):

* a handshake (``Hello`` within ``handshake_timeout_s``; version and auth token
  checked; ``Welcome`` back);
* one reader task that decodes frames and dispatches them through a table keyed
  by message type -- it never awaits the engine, so ``Ping`` is answered at once
  however busy the engine is;
* one task per stage request (a *job*) in the connection's nursery, each under
  its own cancel scope and under the server-wide ``CapacityLimiter``
  (``max_concurrency``).  Submissions beyond ``max_concurrency + max_queued``
  are refused at once with ``overloaded``;
* a generate job streams the engine's deltas through a bounded channel to a
  pump task that writes everything already queued as one merged frame.

Stopping a job: ``Abort`` cancels its scope and the job answers ``Aborted`` after
``engine.abort`` returned; a client disconnect cancels every job of that
connection (the engine is told, nobody is answered); the end of a drain cancels
what is left and answers ``ErrorReply(draining, retryable)``.  A malformed frame
gets ``ErrorReply(protocol_error)`` and closes that connection only.

Drain (``begin_drain``, wired to SIGTERM by the CLI): stop accepting, send
``Goodbye`` on every connection, refuse new stage requests with ``draining``,
let in-flight jobs finish for up to ``drain_timeout_s``, then cancel the rest.
``EngineCrashed`` is the one error that tears the whole server down.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..errors import ConnectionLost
from ..limits import CLEANUP_TIMEOUT_S
from ..transport.framed import FramedStream
from .connection import Connection, StopReason
from .state import WorkerConfig, WorkerState, WorkerStatistics

__all__ = ["WorkerConfig", "WorkerServer", "WorkerStatistics"]

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)


class WorkerServer:
    """Serves the native protocol for one engine; see the module docstring.

    Args:
        engine: the engine doing the stage work.
        config: limits, auth and fault knobs.
    """

    def __init__(self, engine: Engine, config: WorkerConfig) -> None:
        self.engine = engine
        self.state = WorkerState(config)
        self._accept_scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"<WorkerServer {self.config.worker_id} role={self.engine.role}>"

    @property
    def config(self) -> WorkerConfig:
        """The worker's settings; replacing them applies to the next connection's handshake."""
        return self.state.config

    @config.setter
    def config(self, config: WorkerConfig) -> None:
        self.state.config = config

    @property
    def draining(self) -> bool:
        return self.state.draining

    def statistics(self) -> WorkerStatistics:
        """Current counters (cheap; safe to call at any time)."""
        return self.state.statistics()

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until a drain completes (or until cancelled).

        Reports the listeners through ``task_status`` once they accept.

        Cancellation: cancels every job; each is aborted in the engine within a
        shielded, bounded cleanup.  Raises ``EngineCrashed`` if the engine died.
        """
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptors:
                self._accept_scope = acceptors.cancel_scope
                if self.state.draining:
                    acceptors.cancel_scope.cancel(reason="worker draining")
                handler = partial(self._handle_listener_stream)
                bound = await acceptors.start(
                    partial(trio.serve_listeners, handler, listeners, handler_nursery=connections)
                )
                task_status.started(bound)
            await self.finish_drain()
            connections.cancel_scope.cancel(reason="worker drained")

    async def finish_drain(self) -> None:
        """After ``begin_drain``: let jobs finish, then stop the stragglers.

        Waits up to ``drain_timeout_s`` for in-flight jobs, then cancels the
        rest (each answers ``ErrorReply(draining)``) and waits up to
        ``CLEANUP_TIMEOUT_S`` for their cleanup.
        """
        state = self.state
        if state.jobs:
            with trio.move_on_after(self.config.drain_timeout_s):
                await state.idle.wait()
        for connection in list(state.connections):
            connection.stop_jobs(StopReason.SHUTDOWN)
        with trio.move_on_after(CLEANUP_TIMEOUT_S):
            await state.idle.wait()

    async def _handle_listener_stream(self, stream: trio.SocketStream) -> None:
        peer = _describe_peer(stream)
        await self.handle_stream(stream, peer=peer)

    def begin_drain(self, reason: str = "draining") -> None:
        """Stop accepting, say goodbye to every client, refuse new work.

        In-flight jobs continue; ``serve`` returns once they finished or the
        drain deadline passed.  Idempotent.
        """
        if not self.state.begin_drain():
            return
        logger.info("worker %s draining: %s", self.config.worker_id, reason)
        if self._accept_scope is not None:
            self._accept_scope.cancel(reason="worker draining")
        for connection in list(self.state.connections):
            connection.say_goodbye(reason)

    async def handle_stream(self, stream: trio.abc.Stream, *, peer: str = "?") -> None:
        """Serve one client connection until it closes; closes ``stream``.

        Errors that concern only this connection (protocol errors, disconnects)
        are logged and end it; ``EngineCrashed`` propagates.
        """
        framed = FramedStream(stream, max_frame_bytes=self.config.max_frame_bytes, peer=peer)
        connection = Connection(self.state, self.engine, framed)
        try:
            await connection.run()
        except* ConnectionLost as group:
            logger.debug("connection %s lost: %s", peer, group.exceptions[0])
        finally:
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await framed.aclose()


def _describe_peer(stream: trio.SocketStream) -> str:
    try:
        name = stream.socket.getpeername()
    except OSError:
        return "?"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or "unix"
