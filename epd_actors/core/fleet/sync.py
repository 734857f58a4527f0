"""The Trio task that keeps one router in step with its replicas.

Theory of operation: :class:`FleetSync` runs beside the router (started by
:func:`~epd_actors.router.open_router` when ``[shared]`` names a store).
Every ``publish_interval_s`` it runs one *cycle* against the store:

1. send the admin changes this router made since the last cycle (an
   outbox; changes made while the store was away wait there, bounded by
   ``admin_history``);
2. publish this router's :class:`~.state.ReplicaReport` (requests in
   flight, in-flight jobs per worker) with a TTL of ``ttl_s`` and read every
   live report back: the other routers' per-worker counts, summed, become
   each pool's ``remote_in_flight`` (an input the routing policies see added
   to the local count), their requests in flight the supervisor's
   ``remote_requests_in_flight`` (what the fleet-wide admission limit
   counts), and the reports themselves the list of live routers;
3. read the admin changes logged after this router's cursor and apply the
   other routers' ones to this router (``Router.add_worker`` /
   ``drain_worker`` / ``remove_worker`` with an ``origin``, so they are not
   sent back).

Nothing on the request path awaits the store: requests read plain numbers
that the cycle replaced.  Every store call is bounded by ``timeout_s``; a
failed or late call ends the cycle, and the router carries on with what it
has.  When nothing succeeded for ``ttl_s`` the remote counts are dropped and
the router serves on its local view alone.  The first failure after a
success is logged once (a warning), and so is the recovery; metrics count
every failure (``fleet/metrics.py``).  A store whose connection broke in a
way its calls did not report (its own tasks failed) is closed and opened
again on the next cycle.

Cancellation: cancelling :meth:`FleetSync.run` stops the cycles at once
(a call in progress is abandoned); the router's hook is unset.
Backpressure: one cycle at a time; admin changes beyond ``admin_history``
waiting for the store are dropped oldest first, with a warning.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter, deque
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from ...errors import EpdError
from ..config import WorkerEndpoint
from .metrics import FleetCollector
from .state import FleetStoreError, ReplicaReport
from .status import FleetStatus, LiveRouter

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from typing import Any

    from ..config import RouterConfig
    from ..metrics import RouterMetrics
    from ..pool import WorkerPool
    from ..supervisor import Supervisor
    from .changes import WorkerChange
    from .settings import SharedSettings
    from .state import FleetConnection, FleetStore

logger = logging.getLogger(__name__)


class Router(Protocol):
    """What the sync needs of the router it keeps in step (`epd_actors.core.router.Router`)."""

    config: RouterConfig
    supervisor: Supervisor
    pools: dict[str, WorkerPool]
    metrics: RouterMetrics
    on_worker_change: Callable[[WorkerChange], None] | None
    fleet: FleetSync | None

    async def add_worker(
        self,
        stage: str,
        endpoint: WorkerEndpoint,
        *,
        model: str | None = None,
        origin: str | None = None,
    ) -> None:
        """Add a worker to a running router."""
        ...

    def drain_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Send a worker no new work."""
        ...

    def resume_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Send a drained worker new work again."""
        ...

    def remove_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Take a worker out of its pool."""
        ...


T = TypeVar("T")


async def _apply_add(router: Router, change: WorkerChange) -> None:
    endpoint = WorkerEndpoint(
        change.worker_id,
        change.address,
        change.backend,
        change.kv_events_endpoint or None,
        change.kv_events_replay_endpoint or None,
    )
    await router.add_worker(
        change.stage, endpoint, model=change.model or None, origin=change.origin
    )


async def _apply_drain(router: Router, change: WorkerChange) -> None:
    router.drain_worker(change.worker_id, origin=change.origin)


async def _apply_resume(router: Router, change: WorkerChange) -> None:
    router.resume_worker(change.worker_id, origin=change.origin)


async def _apply_remove(router: Router, change: WorkerChange) -> None:
    router.remove_worker(change.worker_id, origin=change.origin)


APPLY: dict[str, Callable[[Router, WorkerChange], Coroutine[Any, Any, None]]] = {
    "add": _apply_add,
    "drain": _apply_drain,
    "resume": _apply_resume,
    "remove": _apply_remove,
}
"""How a replica applies another replica's change, by action."""


class FleetSync:
    """Publishes this router's state and reads its replicas' (see the module docstring).

    Args:
        router: the running router.
        store: where the replicas meet.
        settings: periods, TTLs, timeouts and limits (``[shared]``).
    """

    def __init__(self, router: Router, store: FleetStore, settings: SharedSettings) -> None:
        self.router = router
        self.store = store
        self.settings = settings
        self.router_id = settings.resolved_router_id()
        self.instance = f"{self.router_id}#{secrets.token_hex(4)}"
        self.up = False
        self.failures = 0
        self.outages = 0
        self.exchanges = 0
        self.changes_applied = 0
        self.changes_dropped = 0
        self.last_error: str | None = None
        self._known = False  # whether the store has answered or failed at least once
        self._down_since = 0.0
        self._last_ok = -float("inf")
        self._routers: tuple[ReplicaReport, ...] = ()
        self._remote: dict[str, int] = {}
        self._remote_requests = 0
        self._cursor: str | None = None
        self._outbox: deque[WorkerChange] = deque()
        self._namesake_warned = False
        self._progress = trio.Event()

    # ------------------------------------------------------------ the hook

    def announce(self, change: WorkerChange) -> None:
        """Queue a change this router made for the other replicas (``Router`` calls it)."""
        if len(self._outbox) >= self.settings.admin_history:
            self._outbox.popleft()
            self.changes_dropped += 1
            logger.warning(
                "shared state: more than %d admin changes wait for %s; the oldest is dropped",
                self.settings.admin_history,
                self.store.describe(),
            )
        self._outbox.append(replace(change, origin=self.instance))

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the cycles until cancelled; reports started at once (the store may be down)."""
        router = self.router
        limit = self.settings.max_requests_in_flight
        if limit:
            router.supervisor.fleet_admission = replace(
                router.config.admission, max_requests_in_flight=limit
            )
        for pool in router.pools.values():
            pool.remote_in_flight = self._remote
        router.on_worker_change = self.announce
        router.fleet = self
        collector = FleetCollector(self.status)
        router.metrics.registry.register(collector)
        task_status.started()
        try:
            while True:
                try:
                    await self._session()
                except Exception as exc:  # the store's own tasks failed: open it again
                    self._failed(FleetStoreError(f"the connection broke: {exc!r}"))
                    self._expire()
                    await trio.sleep(self.settings.publish_interval_s)
        finally:
            router.metrics.registry.unregister(collector)
            router.on_worker_change = None
            router.fleet = None
            router.supervisor.fleet_admission = None
            router.supervisor.remote_requests_in_flight = 0
            for pool in router.pools.values():
                pool.remote_in_flight = {}

    async def _session(self) -> None:
        try:
            async with self.store.connect() as connection:
                while True:
                    await self._cycle(connection)
                    await trio.sleep(self.settings.publish_interval_s)
        except FleetStoreError as exc:  # could not connect
            self._failed(exc)
            self._expire()
            await trio.sleep(self.settings.publish_interval_s)

    async def _cycle(self, connection: FleetConnection) -> None:
        try:
            await self._flush(connection)
            ttl = self.settings.ttl_s
            reports = await self._bounded(connection.exchange(self._report(), ttl), "publish")
            self._absorb(reports)
            changes = await self._bounded(connection.changes_after(self._cursor), "read changes")
            await self._apply(changes)
        except FleetStoreError as exc:
            self._failed(exc)
        else:
            self._succeeded()
        self._expire()
        self._progress.set()
        self._progress = trio.Event()

    async def _bounded(self, call: Awaitable[T], what: str) -> T:
        with trio.move_on_after(self.settings.timeout_s):
            return await call
        raise FleetStoreError(f"{what}: no answer within {self.settings.timeout_s:g} s")

    async def _flush(self, connection: FleetConnection) -> None:
        while self._outbox:
            await self._bounded(connection.append_change(self._outbox[0]), "send a change")
            self._outbox.popleft()

    def _report(self) -> ReplicaReport:
        router = self.router
        workers = {
            member.worker_id: member.in_flight
            for pool in router.pools.values()
            for member in pool.members
            if member.in_flight
        }
        return ReplicaReport(
            self.router_id, self.instance, router.supervisor.requests_in_flight, workers
        )

    def _absorb(self, reports: list[ReplicaReport]) -> None:
        others = [r for r in reports if r.router_id != self.router_id]
        namesakes = [
            r for r in reports if r.router_id == self.router_id and r.instance != self.instance
        ]
        if namesakes and not self._namesake_warned:
            self._namesake_warned = True
            logger.warning(
                "shared state: another router publishes as %r too; give each its own "
                "[shared] router_id",
                self.router_id,
            )
        load: Counter[str] = Counter()
        for report in others:
            load.update(report.workers)
        self._set_remote(dict(load), sum(r.requests_in_flight for r in others))
        self._routers = tuple(reports)
        self._last_ok = trio.current_time()

    def _set_remote(self, load: dict[str, int], requests: int) -> None:
        # Replace the contents, not the mapping: every pool holds this one dict.
        self._remote.clear()
        self._remote.update(load)
        self._remote_requests = requests
        self.router.supervisor.remote_requests_in_flight = requests

    async def _apply(self, changes: list[tuple[str, WorkerChange | None]]) -> None:
        for cursor, change in changes:
            self._cursor = cursor
            if change is None or change.origin == self.instance:
                continue
            try:
                await APPLY[change.action](self.router, change)
            except (EpdError, ValueError) as exc:
                # Typical when a change is replayed: the worker is configured already, or gone.
                logger.info(
                    "shared state: %s of worker %s not applied: %s",
                    change.action,
                    change.worker_id,
                    exc,
                )
                continue
            self.changes_applied += 1
            logger.info(
                "shared state: worker %s %s by router %s",
                change.worker_id,
                {"add": "added", "drain": "drained", "resume": "resumed", "remove": "removed"}[
                    change.action
                ],
                change.origin.partition("#")[0],
            )

    def _succeeded(self) -> None:
        self.exchanges += 1
        if not self.up:
            store = self.store.describe()
            if self._known:
                down_for = trio.current_time() - self._down_since
                logger.warning(
                    "shared state: %s answers again after %.1f s; the fleet view is back",
                    store,
                    down_for,
                )
            else:
                logger.info("shared state: %s reached, this router is %r", store, self.router_id)
        self.up = True
        self._known = True
        self.last_error = None

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = str(exc)
        if self.up or not self._known:
            self.outages += 1
            self._down_since = trio.current_time()
            logger.warning(
                "shared state: %s is unreachable (%s); this router serves on its local view "
                "until it answers again",
                self.store.describe(),
                exc,
            )
        self.up = False
        self._known = True

    def _expire(self) -> None:
        """Drop the remote view once nothing was heard for ``ttl_s``."""
        if trio.current_time() - self._last_ok <= self.settings.ttl_s:
            return
        if self._routers or self._remote or self._remote_requests:
            self._routers = ()
            self._set_remote({}, 0)

    # ------------------------------------------------------------ reading

    def status(self) -> FleetStatus:
        routers = tuple(
            LiveRouter(
                r.router_id, r.requests_in_flight, r.expires_in_s, r.instance == self.instance
            )
            for r in sorted(self._routers, key=lambda r: r.router_id)
        )
        return FleetStatus(
            router_id=self.router_id,
            store=self.store.describe(),
            up=self.up,
            routers=routers,
            remote_requests_in_flight=self._remote_requests,
            remote_in_flight=dict(self._remote),
            pending_changes=len(self._outbox),
            failures=self.failures,
            outages=self.outages,
            exchanges=self.exchanges,
            changes_applied=self.changes_applied,
            changes_dropped=self.changes_dropped,
            last_error=self.last_error,
        )

    async def wait_cycles(self, count: int = 1) -> None:
        """Wait until ``count`` more cycles have ended (successful or not).

        Cancellation: safe; nothing is held.
        """
        for _ in range(count):
            await self._progress.wait()

    async def wait_exchanges(self, count: int = 2) -> None:
        """Wait until ``count`` more cycles succeeded; the last one began after this call."""
        target = self.exchanges + count
        while self.exchanges < target:
            await self.wait_cycles()
