"""The worker runtime: serves the native protocol in front of one engine.

Theory of operation
-------------------
:class:`WorkerServer` accepts connections (``serve``) or is handed streams
directly (``handle_stream``, which tests drive over memory streams).  Each
connection is one ``_Connection`` (:mod:`.connection`):

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
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..errors import ConnectionLost, EngineError
from ..limits import CLEANUP_TIMEOUT_S, HANDSHAKE_TIMEOUT_S
from ..protocol import DEFAULT_MAX_FRAME_BYTES, ErrorCode, WorkerStats
from ..transport.framed import FramedStream
from .connection import _Connection, _StopReason

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Settings of one worker process.

    Attributes:
        worker_id: announced in ``Welcome``; unique within a deployment.
        auth_token: the token a client must present; ``None`` disables the
            check (development only; the CLI insists on an explicit flag).
        max_concurrency: stage requests running in the engine at once.
        max_queued: requests allowed to wait for a slot before new ones are
            refused with ``overloaded``.
        drain_timeout_s: how long in-flight work may finish after a drain began.
        handshake_timeout_s: how long a new connection has to send ``Hello``.
        max_frame_bytes: frame limit in both directions.
        heartbeat_delay_s: fault injection: delay every ``Pong`` by this much.
        heartbeat_drop: fault injection: never answer ``Ping``.
    """

    worker_id: str
    auth_token: str | None
    max_concurrency: int = 64
    max_queued: int = 256
    drain_timeout_s: float = 30.0
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    heartbeat_delay_s: float = 0.0
    heartbeat_drop: bool = False


@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    """A snapshot of the runtime's counters."""

    connections: int
    running: int
    queued: int
    draining: bool
    requests_total: int
    refused_total: int
    aborts_total: int
    protocol_errors_total: int


class WorkerServer:
    """Serves the native protocol for one engine; see the module docstring.

    Args:
        engine: the engine doing the stage work.
        config: limits, auth and fault knobs.
    """

    def __init__(self, engine: Engine, config: WorkerConfig) -> None:
        self.engine = engine
        self.config = config
        self._limiter = trio.CapacityLimiter(config.max_concurrency)
        self._connections: set[_Connection] = set()
        self._accept_scope: trio.CancelScope | None = None
        self._draining = False
        self._idle = trio.Event()
        self.running = 0
        self.queued = 0
        self._jobs = 0
        self.requests_total = 0
        self.refused_total = 0
        self.aborts_total = 0
        self.protocol_errors_total = 0

    def __repr__(self) -> str:
        return f"<WorkerServer {self.config.worker_id} role={self.engine.role}>"

    @property
    def draining(self) -> bool:
        return self._draining

    def statistics(self) -> WorkerStatistics:
        """Current counters (cheap; safe to call at any time)."""
        return WorkerStatistics(
            connections=len(self._connections),
            running=self.running,
            queued=self.queued,
            draining=self._draining,
            requests_total=self.requests_total,
            refused_total=self.refused_total,
            aborts_total=self.aborts_total,
            protocol_errors_total=self.protocol_errors_total,
        )

    def worker_stats(self) -> WorkerStats:
        """The load report carried by ``Pong``."""
        return WorkerStats(
            running=self.running,
            queued=self.queued,
            draining=self._draining,
            engine_ready=self.engine.is_ready(),
            aborts=self.aborts_total,
        )

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
                if self._draining:
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
        if self._jobs:
            with trio.move_on_after(self.config.drain_timeout_s):
                await self._idle.wait()
        for connection in list(self._connections):
            connection.stop_jobs(_StopReason.SHUTDOWN)
        with trio.move_on_after(CLEANUP_TIMEOUT_S):
            await self._idle.wait()

    async def _handle_listener_stream(self, stream: trio.SocketStream) -> None:
        peer = _describe_peer(stream)
        await self.handle_stream(stream, peer=peer)

    def begin_drain(self, reason: str = "draining") -> None:
        """Stop accepting, say goodbye to every client, refuse new work.

        In-flight jobs continue; ``serve`` returns once they finished or the
        drain deadline passed.  Idempotent.
        """
        if self._draining:
            return
        logger.info("worker %s draining: %s", self.config.worker_id, reason)
        self._draining = True
        if self._jobs == 0:
            self._idle.set()
        if self._accept_scope is not None:
            self._accept_scope.cancel(reason="worker draining")
        for connection in list(self._connections):
            connection.say_goodbye(reason)

    async def handle_stream(self, stream: trio.abc.Stream, *, peer: str = "?") -> None:
        """Serve one client connection until it closes; closes ``stream``.

        Errors that concern only this connection (protocol errors, disconnects)
        are logged and end it; ``EngineCrashed`` propagates.
        """
        framed = FramedStream(stream, max_frame_bytes=self.config.max_frame_bytes, peer=peer)
        connection = _Connection(self, framed)
        try:
            await connection.run()
        except* ConnectionLost as group:
            logger.debug("connection %s lost: %s", peer, group.exceptions[0])
        finally:
            with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await framed.aclose()

    # -- bookkeeping used by connections

    def _admit(self) -> None:
        """Refuse a new stage request when draining or full (raises EngineError)."""
        if self._draining:
            raise EngineError(ErrorCode.DRAINING, "worker is draining", retryable=True)
        limit = self.config.max_concurrency + self.config.max_queued
        if self.running + self.queued >= limit:
            raise EngineError(
                ErrorCode.OVERLOADED, f"worker is full ({limit} requests)", retryable=True
            )

    def _job_started(self) -> None:
        self._jobs += 1
        self.requests_total += 1

    def _job_finished(self) -> None:
        self._jobs -= 1
        if self._draining and self._jobs == 0:
            self._idle.set()


def _describe_peer(stream: trio.SocketStream) -> str:
    try:
        name = stream.socket.getpeername()
    except OSError:
        return "?"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or "unix"
