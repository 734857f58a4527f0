"""What replicas exchange, the store interface, and an in-memory store.

Theory of operation: every router replica periodically *publishes* one
:class:`ReplicaReport` (its id, its requests in flight, its in-flight jobs
per worker) under a time to live, and reads every live replica's report
back; a report that was not refreshed within its TTL is gone, so a dead
router's load and its entry among the live routers disappear by
themselves.  Admin changes (:class:`~.changes.WorkerChange`) go into an
append-only log that each replica reads from its own cursor.

A store is opened with :meth:`FleetStore.connect`, an async context manager
yielding a :class:`FleetConnection`; the connection's coroutines raise
:class:`FleetStoreError` for anything the store did wrong (unreachable, slow,
garbage).  :class:`~.sync.FleetSync` bounds each call with its own timeout.

:class:`MemoryFleetStore` keeps all of it in this process: routers in one
Trio program can share it (tests, a single-machine fleet), and its
``failing`` switch stands in for an unreachable Redis.  TTLs run on
``trio.current_time()``, so tests can use an autojump clock.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from ...errors import EpdError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping
    from contextlib import AbstractAsyncContextManager

    from .changes import WorkerChange


class FleetStoreError(EpdError):
    """The shared store did not answer, answered too late, or answered garbage."""


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What one router publishes about itself.

    Attributes:
        router_id: the router (``[shared] router_id``).
        instance: unique per process, so a restarted router with the same id
            is told apart from its predecessor.
        requests_in_flight: requests the router is serving.
        workers: jobs in flight per worker id, for workers with any.
        expires_in_s: how long until the report expires (filled in by the
            store on reading; 0 when unknown).
    """

    router_id: str
    instance: str
    requests_in_flight: int = 0
    workers: Mapping[str, int] = field(default_factory=dict)
    expires_in_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.router_id,
                "instance": self.instance,
                "requests_in_flight": self.requests_in_flight,
                "workers": dict(self.workers),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, expires_in_s: float = 0.0) -> ReplicaReport:
        """Parse a report.

        Raises:
            FleetStoreError: not a report.
        """
        try:
            data = json.loads(text)
            workers = data["workers"]
            report = cls(
                router_id=str(data["id"]),
                instance=str(data["instance"]),
                requests_in_flight=_count(data["requests_in_flight"]),
                workers={str(k): _count(v) for k, v in workers.items()},
                expires_in_s=expires_in_s,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FleetStoreError(f"a shared router report is malformed: {exc!r}") from None
        return report


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


class FleetConnection(Protocol):
    """An open store; every coroutine raises :class:`FleetStoreError` on failure."""

    async def exchange(self, report: ReplicaReport, ttl_s: float) -> list[ReplicaReport]:
        """Publish ``report`` for ``ttl_s`` seconds; return every live report (``report`` too)."""
        ...

    async def append_change(self, change: WorkerChange) -> None:
        """Append ``change`` to the shared log of admin changes."""
        ...

    async def changes_after(self, cursor: str | None) -> list[tuple[str, WorkerChange | None]]:
        """The logged changes after ``cursor`` (None: all), oldest first, with their cursors.

        A logged entry that is not a change comes as ``None`` (skipped, but
        the cursor moves past it).
        """
        ...


class FleetStore(Protocol):
    """Where replicas meet; ``connect()`` opens it for one session."""

    def connect(self) -> AbstractAsyncContextManager[FleetConnection]:
        """An async context manager yielding a :class:`FleetConnection`.

        Raises (on entry or from the connection's coroutines):
            FleetStoreError: the store cannot be reached.
        """
        ...

    def describe(self) -> str:
        """How logs name the store (no secrets)."""
        ...


class MemoryFleetStore:
    """A store in this process (see the module docstring).

    Args:
        max_changes: changes kept in the log (older ones are dropped).

    Attributes:
        failing: while true, every call raises :class:`FleetStoreError`, as an
            unreachable Redis would.
        stalled: while true, every call waits forever (a Redis that stopped
            answering); the caller's timeout ends it.
    """

    def __init__(self, *, max_changes: int = 1000) -> None:
        self.failing = False
        self.stalled = False
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}
        self._changes: list[tuple[int, WorkerChange]] = []
        self._next = 0
        self._max_changes = max_changes

    def describe(self) -> str:
        return "the in-process store"

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FleetConnection]:
        await self._check()
        yield _MemoryConnection(self)

    async def _check(self) -> None:
        if self.stalled:
            await trio.sleep_forever()
        if self.failing:
            raise FleetStoreError("the in-process store is switched off")

    def clear(self) -> None:
        """Forget everything, as a restarted Redis without persistence does."""
        self._reports.clear()
        self._changes.clear()

    def live(self) -> list[ReplicaReport]:
        now = trio.current_time()
        for router_id, (_, expires) in list(self._reports.items()):
            if expires <= now:
                del self._reports[router_id]
        return [
            ReplicaReport(r.router_id, r.instance, r.requests_in_flight, r.workers, exp - now)
            for r, exp in self._reports.values()
        ]


class _MemoryConnection:
    def __init__(self, store: MemoryFleetStore) -> None:
        self._store = store

    async def exchange(self, report: ReplicaReport, ttl_s: float) -> list[ReplicaReport]:
        store = self._store
        await store._check()
        store._reports[report.router_id] = (report, trio.current_time() + ttl_s)
        return store.live()

    async def append_change(self, change: WorkerChange) -> None:
        store = self._store
        await store._check()
        store._changes.append((store._next, change))
        store._next += 1
        del store._changes[: -store._max_changes]

    async def changes_after(self, cursor: str | None) -> list[tuple[str, WorkerChange | None]]:
        store = self._store
        await store._check()
        after = -1 if cursor is None else int(cursor)
        return [(str(n), change) for n, change in store._changes if n > after]
