"""What every connection of one worker shares: its settings, admission, counters and drain flag.

:class:`WorkerState` is owned by the :class:`~.runtime.WorkerServer` and handed
to each :class:`~.connection.Connection`; neither reaches into the other.  It
is plain bookkeeping on the Trio thread: nothing here awaits except
:meth:`WorkerState.slot`, which waits for an engine slot.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from ..errors import EngineError
from ..limits import HANDSHAKE_TIMEOUT_S
from ..protocol import DEFAULT_MAX_FRAME_BYTES, ErrorCode, WorkerStats

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class ConnectionHandle(Protocol):
    """What a drain needs of a connection."""

    def say_goodbye(self, reason: str) -> None:
        """Tell the client this worker takes no new requests."""
        ...

    def stop_jobs(self, reason: str) -> None:
        """Cancel every job of the connection, for ``reason``."""
        ...


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


class WorkerState:
    """Admission, counters and the drain flag of one worker, shared by its connections.

    Args:
        config: the worker's settings (limits, auth, fault knobs).
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.connections: set[ConnectionHandle] = set()
        self.draining = False
        self.idle = trio.Event()
        """Set once a drain began and no job is left."""
        self.jobs = 0
        self.running = 0
        self.queued = 0
        self.requests_total = 0
        self.refused_total = 0
        self.aborts_total = 0
        self.protocol_errors_total = 0
        self._limiter = trio.CapacityLimiter(config.max_concurrency)

    def admit(self) -> None:
        """Refuse a new stage request when draining or full; else count it as queued.

        Raises:
            EngineError: ``draining`` or ``overloaded``, both retryable.
        """
        if self.draining:
            raise EngineError(ErrorCode.DRAINING, "worker is draining", retryable=True)
        limit = self.config.max_concurrency + self.config.max_queued
        if self.running + self.queued >= limit:
            raise EngineError(
                ErrorCode.OVERLOADED, f"worker is full ({limit} requests)", retryable=True
            )
        # Counted as queued from admission, not from when its task first runs: several
        # requests decoded from one read are admitted before any of their tasks starts.
        self.jobs += 1
        self.requests_total += 1
        self.queued += 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for an engine slot for an admitted job (queued → running), and hold it.

        Cancellation: while waiting, the job leaves the queue and holds nothing.
        """
        try:
            await self._limiter.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._limiter.release()

    def job_finished(self) -> None:
        """An admitted job ended, however it ended."""
        self.jobs -= 1
        if self.draining and self.jobs == 0:
            self.idle.set()

    def begin_drain(self) -> bool:
        """Mark the worker draining; False when it was already."""
        if self.draining:
            return False
        self.draining = True
        if self.jobs == 0:
            self.idle.set()
        return True

    def statistics(self) -> WorkerStatistics:
        """Current counters (cheap; safe to call at any time)."""
        return WorkerStatistics(
            connections=len(self.connections),
            running=self.running,
            queued=self.queued,
            draining=self.draining,
            requests_total=self.requests_total,
            refused_total=self.refused_total,
            aborts_total=self.aborts_total,
            protocol_errors_total=self.protocol_errors_total,
        )

    def worker_stats(self, *, engine_ready: bool) -> WorkerStats:
        """The load report carried by ``Pong``."""
        return WorkerStats(
            running=self.running,
            queued=self.queued,
            draining=self.draining,
            engine_ready=engine_ready,
            aborts=self.aborts_total,
        )
