"""The contract between stage actors and a backend (one backend object per worker).

A backend hides how a worker is reached (native msgpack connection, vLLM's HTTP
API) behind three operations that match the stage contract:

* :meth:`StageBackend.run_stage` for encode and prefill (one answer);
* :meth:`StageBackend.open_stream` for generate (a stream of deltas);
* :meth:`StageBackend.release` for a prefilled KV handle nobody will consume.

A pool tells each backend what its workers must be (:meth:`StageBackend.expect`
with a :class:`WorkerRequirement`: the roles that serve the pool's stage, the
model the router serves).  The backend checks what its worker announces -- the
native ``Welcome``, an HTTP server's ``/v1/models`` -- and refuses a worker
that does not fit: the refusal shows in :attr:`BackendStatus.refused` and the
pool never routes to it, until the worker announces something that fits (a
reconnect, a later probe).

Errors are typed (``errors.WorkerError`` and subclasses).  Cancellation is
always safe: a backend that is cancelled while a worker holds work for the
request tells the worker to abort, inside a shielded, bounded cleanup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from contextlib import AbstractAsyncContextManager

    from ..lora import LoraAdapter
    from ..protocol import Delta, EncodeRequest, GenerateRequest, PrefillRequest, StageResult


@dataclass(frozen=True, slots=True)
class WorkerRequirement:
    """What a pool needs of its workers, checked against what each one announces.

    Attributes:
        stage: the pool's stage (named in refusals).
        roles: the worker roles that may serve the stage (the stage actor's
            ``worker_roles``); empty: any role.
        model: the model the pool serves; None: any model.
        loadable_adapters: LoRA adapters of that model the backend may load
            on its worker at run time, before a request that names one (the
            pool's ``lora_loading``); empty: it loads none.
        consumes_kv_handoff: the pool's workers take KV caches other stages
            hand on (the stage actor's ``consumes_kv_handoff``).
    """

    stage: str = ""
    roles: frozenset[str] = frozenset()
    model: str | None = None
    loadable_adapters: tuple[LoraAdapter, ...] = ()
    consumes_kv_handoff: bool = False

    def loadable(self, adapter: str) -> LoraAdapter | None:
        """The adapter ``adapter`` if the backend may load it at run time, else None."""
        return next((a for a in self.loadable_adapters if a.name == adapter), None)

    def problem(
        self,
        *,
        role: str | None = None,
        models: Collection[str] | None = None,
        max_concurrency: int = 0,
    ) -> str | None:
        """Why a worker announcing these cannot serve the pool; None when it can.

        Args:
            role: the role the worker announced (None: it announces none).
            models: the models it serves (None: it announces none).
            max_concurrency: the jobs it runs at once (0: not announced).
        """
        problems: list[str] = []
        pool = f"the {self.stage} pool" if self.stage else "the pool"
        if role is not None and self.roles and role not in self.roles:
            needed = " or ".join(repr(r) for r in sorted(self.roles))
            problems.append(f"it announced role {role!r}, {pool} needs role {needed}")
        if models is not None and self.model is not None and self.model not in models:
            announced = ", ".join(repr(m) for m in sorted(models)) or "none"
            problems.append(f"it serves model {announced}, the router serves {self.model!r}")
        if max_concurrency < 0:
            problems.append(f"it announced max_concurrency {max_concurrency} (must be >= 0)")
        return "; ".join(problems) or None


ANY_WORKER = WorkerRequirement()
"""The requirement of a backend no pool has claimed yet: nothing is checked."""


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
        refused: why the worker was refused (it announced a role or model its
            pool cannot use), or None; a refused worker is never routed to.
        refusals: how often it was refused (observability).
        max_concurrency: the jobs the worker said it runs at once (0: not
            announced); the pool sends it no more than that.
        adapters: the LoRA adapters the worker has loaded, as far as the
            backend knows (announced, listed, or loaded through it); the pool
            prefers these workers for a request naming one.
    """

    connected: bool
    draining: bool
    ready: bool
    worker_load: int = 0
    aborts_sent: int = 0
    worker_aborts: int | None = None
    refused: str | None = None
    refusals: int = 0
    max_concurrency: int = 0
    adapters: frozenset[str] = frozenset()


class DeltaStream(Protocol):
    """The deltas of one generate request.

    ``receive`` returns the next delta; after the terminal delta (the one with
    ``finish_reason``) it raises ``trio.EndOfChannel``.  Failures raise typed
    ``WorkerError``s.
    """

    async def receive(self) -> Delta:
        """Next delta (see class docstring)."""
        ...

    def receive_nowait(self) -> Delta:
        """The next delta if it already arrived: what ``receive`` raises, or ``trio.WouldBlock``.

        Lets a relay pass on a burst of deltas without a scheduling round per delta.
        """
        ...

    def set_sink(self, sink: Callable[[Delta], bool]) -> None:
        """Hand non-final deltas to ``sink`` in the task that produced them.

        The stream's deltas travel on a hand-off channel (:mod:`~epd_actors.handoff`)
        and ``sink`` is its taker: called only while this stream's reader waits
        in ``receive`` with nothing queued, never raising or blocking; a
        refusal queues the delta, and every later one until the reader caught
        up.  A stream whose reader is its producer (it reads only when asked)
        has no other task to hand over in, and keeps the deltas for ``receive``.
        """
        ...


class StageBackend(Protocol):
    """One worker, as the stage actors see it."""

    worker_id: str

    def status(self) -> BackendStatus:
        """Current connection and readiness state (no I/O)."""
        ...

    def expect(self, requirement: WorkerRequirement) -> None:
        """Check the worker against ``requirement`` from now on (its pool calls this).

        A worker that does not fit is refused (``status().refused``); one that
        is connected already is checked at once.  Never waits.
        """
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
