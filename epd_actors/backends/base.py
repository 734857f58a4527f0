"""The contract between stage actors and a backend (one backend object per worker).

A backend hides how a worker is reached (native msgpack connection, vLLM's HTTP
API) behind three operations that match the stage contract:

* :meth:`StageBackend.run_stage` for encode and prefill (one answer);
* :meth:`StageBackend.open_stream` for generate (a stream of deltas);
* :meth:`StageBackend.release` for a prefilled KV handle nobody will consume.

Errors are typed (``errors.WorkerError`` and subclasses).  Cancellation is
always safe: a backend that is cancelled while a worker holds work for the
request tells the worker to abort, inside a shielded, bounded cleanup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ..protocol import Delta, EncodeRequest, GenerateRequest, PrefillRequest, StageResult


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """What the pool needs to know to route to a worker.

    Attributes:
        connected: a working connection (or, for HTTP, the last probe passed).
        draining: the worker said goodbye, or an operator drained it.
        ready: the engine answers (last heartbeat said so).
        worker_load: running + queued requests the worker last reported.
        aborts_sent: aborts this router sent the worker (observability).
        worker_aborts: aborts the worker last said it received, or None when
            the worker does not report it.
    """

    connected: bool
    draining: bool
    ready: bool
    worker_load: int = 0
    aborts_sent: int = 0
    worker_aborts: int | None = None


class DeltaStream(Protocol):
    """The deltas of one generate request.

    ``receive`` returns the next delta; after the terminal delta (the one with
    ``finish_reason``) it raises ``trio.EndOfChannel``.  Failures raise typed
    ``WorkerError``s.
    """

    async def receive(self) -> Delta:
        """Next delta (see class docstring)."""
        ...


class StageBackend(Protocol):
    """One worker, as the stage actors see it."""

    worker_id: str

    def status(self) -> BackendStatus:
        """Current connection and readiness state (no I/O)."""
        ...

    async def run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        """Send an encode or prefill request and wait for its result.

        Raises:
            RemoteWorkerError: the worker answered with an error.
            WorkerDisconnected: the connection was lost (or never made).

        Cancellation: the worker is told to abort (shielded, bounded).
        """
        ...

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[DeltaStream]:
        """Send a generate request; the context yields its delta stream.

        Leaving the context before the terminal delta aborts the request on the
        worker (shielded, bounded).
        """
        ...

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Free a prefilled KV handle on this (prefill) worker; False if already gone."""
        ...


class ManagedBackend(StageBackend, Protocol):
    """A backend with a lifetime: ``run`` keeps its connection up until cancelled."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Maintain the connection (reconnecting as needed) until cancelled.

        Reports started at once: the router must start even if a worker is down.
        """
        ...

    async def wait_connected(self) -> None:
        """Return once a connection is up (immediately if it already is)."""
        ...

    async def wait_ready(self) -> None:
        """Return once the worker can take work (connected and its engine ready)."""
        ...
