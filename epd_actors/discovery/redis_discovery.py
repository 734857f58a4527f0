"""Workers from their registrations in Redis, read per pool every period, under Trio.

Theory of operation: :class:`RedisDiscovery` runs one task.  Every
``period_s`` it reads, for each discovered pool, the ids in the pool's index
(``SMEMBERS``), then their records (``GET`` each, one pipeline), removes the
ids whose record expired from the index (``SREM``), and applies what the
records say through :class:`~.reconcile.Reconciler`, one per pool and
backend kind: a new ready worker is added, a draining one is drained, a ready
one again is resumed, one whose record is gone (it exited, or it was killed
and its key expired) is removed, and one registered again under another
instance (restarted) is removed and added.  A worker that exits says so
(state ``stopped``) and is removed at once; one whose record vanished (it was
killed, and its key expired; or Redis lost it) is removed once it has been
missing for its TTL (:meth:`_PoolReader.view`).  Records that cannot be read, or
that name an unknown backend or an address it cannot reach, are skipped with
one warning each.

When Redis cannot be reached, answers late (each read is bounded by
``timeout_s``) or refuses, the router keeps the workers it has (its last
view), the failure is logged once at warning level (then at debug level
until Redis answers again, which is logged once at info level), counted in
``epd_discovery_errors_total{pool}``, and ``epd_discovery_up{pool}`` drops to
0 (the handling every kind shares, :mod:`~.watch_loop`; a broken connection
is opened again after one period).  A Redis restarted empty removes
no worker: each registers again within a third of its TTL, before the grace
of a missing record runs out.

Cancellation: cancelling ``run`` ends the reads and closes the client; the
workers stay in the router.
Backpressure: one read per pool per period, applied by the task that read
it; a slow router delays the next read, nothing queues.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter

from ..core.backend_kinds import backend_kind
from ..core.fleet.settings import redacted_url
from ..errors import ConfigError
from .base import Discovery, WorkerSink
from .reconcile import Reconciler
from .redis_client import REDIS_ERRORS, open_redis
from .registrations import (
    Registration,
    RegistrationError,
    RegistrationState,
    pool_key,
    worker_key,
)
from .watch_loop import Backoff, SourceHealth, SourceMetrics, StartOnce

if TYPE_CHECKING:
    from collections.abc import Mapping

    from prometheus_client import CollectorRegistry

    from .endpoints import DiscoveredWorker
    from .redis_settings import RedisDiscoverySettings, RedisPool

logger = logging.getLogger(__name__)


class _Unanswered(Exception):
    """A read that failed or got no answer in time."""


class _SinkFailed(Exception):
    """Applying a view raised (a bug, not Redis): it must not pass for an outage."""


def _holds_sink_failure(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(_SinkFailed)[0] is not None
    return isinstance(exc, _SinkFailed)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.source = SourceMetrics(
            registry, errors_help="Failed reads of the discovery source, by pool"
        )
        self.reads = Counter(
            "epd_discovery_reads",
            "Reads of a pool's registrations in Redis",
            ["pool"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class RedisPoolStatistics:
    """One pool's discovery, for tests and reports.

    Attributes:
        workers: each worker applied, by id: whether it takes new work.
        up: the last read succeeded.
        reads: reads done; errors: failed reads.
    """

    workers: Mapping[str, bool]
    up: bool
    reads: int
    errors: int


class _PoolReader:
    """Read one pool's registrations and apply them."""

    def __init__(
        self, pool: RedisPool, settings: RedisDiscoverySettings, metrics: _Metrics
    ) -> None:
        self.pool = pool
        where = f"Redis at {redacted_url(settings.redis_url)}"
        self.health = SourceHealth(
            pool.label, metrics.source, source=where, attempts="reads", logger=logger
        )
        self.prefix = settings.key_prefix
        self.index = pool_key(settings.key_prefix, pool.stage, pool.served_model)
        self.reconcilers: dict[str, Reconciler] = {}
        self.reads = 0
        self._skipped: dict[str, str] = {}
        self._known: dict[str, Registration] = {}
        self._absent_since: dict[str, float] = {}
        self._reads = metrics.reads.labels(pool.label)

    def statistics(self) -> RedisPoolStatistics:
        workers: dict[str, bool] = {}
        for reconciler in self.reconcilers.values():
            workers.update(reconciler.workers)
        return RedisPoolStatistics(workers, self.health.up, self.reads, self.health.errors)

    async def read(self, client: Any) -> list[Registration]:
        """The pool's readable records (raises a Redis error when Redis fails)."""
        ids = sorted(await client.smembers(self.index))
        if not ids:
            return []
        async with client.pipeline(transaction=False) as pipe:
            replies = [(i, pipe.get(worker_key(self.prefix, i))) for i in ids]
        found: list[Registration] = []
        gone: list[str] = []
        for worker_id, reply in replies:
            text = await reply
            if text is None:
                gone.append(worker_id)
                continue
            record = self._check(worker_id, text)
            if record is not None:
                found.append(record)
        if gone:
            await client.srem(self.index, gone)
        return found

    def _check(self, worker_id: str, text: str) -> Registration | None:
        problem = ""
        record: Registration | None = None
        try:
            record = Registration.from_json(text)
            if record.worker_id != worker_id:
                problem = f"it names worker {record.worker_id!r}"
            elif (record.stage, record.model) != (self.pool.stage, self.pool.served_model):
                problem = f"it is of pool {record.stage}@{record.model}"
            else:
                backend_kind(record.backend, key="backend").check_address(
                    record.address, key="address"
                )
        except (RegistrationError, ConfigError) as exc:
            problem = str(exc)
        if not problem:
            self._skipped.pop(worker_id, None)
            return record
        if self._skipped.get(worker_id) != problem:
            self._skipped[worker_id] = problem
            logger.warning(
                "discovery of pool %s: registration of %s skipped: %s",
                self.pool.label,
                worker_id,
                problem,
            )
        return None

    def view(self, records: list[Registration], now: float) -> list[Registration]:
        """The workers to apply after a whole read at ``now``.

        A worker whose record is missing stays, in its last state, until it
        has been missing from every read for its ``ttl_s`` (its record would
        have been refreshed meanwhile: it is gone); one that says it stopped
        goes at once.  So a Redis restarted empty removes nobody: the workers
        register again within a third of their TTL.
        """
        present = {record.worker_id: record for record in records}
        for worker_id in list(self._known):
            if worker_id in present:
                continue
            since = self._absent_since.setdefault(worker_id, now)
            if now - since >= self._known[worker_id].ttl_s:
                del self._known[worker_id], self._absent_since[worker_id]
        for worker_id, record in present.items():
            self._absent_since.pop(worker_id, None)
            if record.state is RegistrationState.STOPPED:
                self._known.pop(worker_id, None)
            else:
                self._known[worker_id] = record
        return list(self._known.values())

    async def apply(self, sink: WorkerSink, records: list[Registration]) -> None:
        wanted: dict[str, dict[str, DiscoveredWorker]] = {b: {} for b in self.reconcilers}
        for record in records:
            wanted.setdefault(record.backend, {})[record.worker_id] = record.as_discovered()
        # Removals (and moves between backends) first, so an id that changed kind is free again.
        for backend in sorted(wanted, key=lambda b: bool(wanted[b])):
            reconciler = self.reconcilers.get(backend)
            if reconciler is None:
                pool = self.pool
                reconciler = Reconciler(pool.stage, pool.model, backend, label=pool.label)
                self.reconcilers[backend] = reconciler
            await reconciler.apply(sink, wanted[backend])

    def succeeded(self) -> None:
        self.reads += 1
        self._reads.inc()
        self.health.succeeded()

    def failed(self, exc: BaseException) -> None:
        workers = sum(len(r.workers) for r in self.reconcilers.values())
        self.health.failed(str(exc), workers=workers)


class RedisDiscovery(Discovery):
    """The ``redis`` discovery (see the module docstring).

    Args:
        settings: the ``[discovery]`` table.
        registry: where its metrics go (the router's).
    """

    def __init__(self, settings: RedisDiscoverySettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        metrics = _Metrics(registry)
        self.pools = {pool.label: _PoolReader(pool, settings, metrics) for pool in settings.pools}
        self.cycles = 0
        self._progress = trio.Event()

    def statistics(self) -> dict[str, RedisPoolStatistics]:
        return {label: reader.statistics() for label, reader in self.pools.items()}

    async def wait_cycles(self, count: int = 1) -> None:
        """Wait until ``count`` more read cycles (over every pool) have ended."""
        target = self.cycles + count
        while self.cycles < target:
            await self._progress.wait()

    async def run(
        self, sink: WorkerSink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        started = StartOnce(task_status)
        # A broken connection is opened again after one period, every time.
        retry = Backoff(self.settings.period_s, self.settings.period_s)
        while True:
            try:
                async with open_redis(self.settings.redis_url, self.settings.timeout_s) as client:
                    while True:
                        await self._cycle(client, sink)
                        started()
                        await trio.sleep(self.settings.period_s)
            except Exception as exc:  # the client's own tasks failed (or it could not open)
                if _holds_sink_failure(exc):
                    raise
                for reader in self.pools.values():
                    reader.failed(_Unanswered(f"the connection broke: {exc!r}"))
                self._ended_cycle()
                started()
                await retry.wait()

    async def _cycle(self, client: Any, sink: WorkerSink) -> None:
        for reader in self.pools.values():
            try:
                records = await self._bounded(reader.read(client))
            except _Unanswered as exc:
                reader.failed(exc)
                continue
            reader.succeeded()
            try:
                await reader.apply(sink, reader.view(records, trio.current_time()))
            except Exception as exc:
                raise _SinkFailed(f"discovery of pool {reader.pool.label}: {exc!r}") from exc
        self._ended_cycle()

    async def _bounded(self, read: Any) -> list[Registration]:
        timeout = self.settings.timeout_s
        try:
            with trio.move_on_after(timeout):
                result: list[Registration] = await read
                return result
        except REDIS_ERRORS as exc:
            raise _Unanswered(repr(exc)) from None
        raise _Unanswered(f"no answer within {timeout:g} s")

    def _ended_cycle(self) -> None:
        self.cycles += 1
        self._progress.set()
        self._progress = trio.Event()
