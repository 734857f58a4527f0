"""A pool of workers for one stage: membership, eligibility, in-flight counts, leases.

Theory of operation: a :class:`WorkerPool` holds one :class:`PoolMember` per
worker (its backend plus the router's own bookkeeping).  To run a job an actor
asks for a :class:`Lease`: the pool filters the members that can take work now
(connected, engine ready, not draining, not refused, circuit breaker closed
or probing, below its in-flight limit, not excluded by the caller), lets the
pool's routing policy pick one (a pure, synchronous decision), and counts the
job against that member until the lease is released; the lease carries the
job's verdict to the member's circuit breaker (``health.py``).  When every
usable member is at its limit the caller waits for a slot (bounded by the
request's deadline, which the caller owns); when no member is usable at all
the pool refuses at once with ``NoHealthyWorker``, and so does every waiter
once the members it waited for become unusable (each waiter that finds none
wakes the next).

A member's in-flight limit is the pool's ``max_in_flight_per_worker``, or the
``max_concurrency`` its worker announced when that is lower: the router keeps
the excess queued here, where any worker that frees a slot can take it, rather
than in one worker's queue.  A worker that refuses a job because it is full
anyway (``overloaded``, or ``draining``) is not failing: that refusal never
counts against its breaker, and the actor moves the job to another worker
(:func:`~.health.is_backpressure`; :meth:`WorkerPool.saturated` when none has
room).

When a worker is added, the pool tells its backend what the pool's workers
must be (:class:`~epd_actors.backends.base.WorkerRequirement`: the roles that serve the
stage, the pool's model); a backend whose worker announced something else
reports itself refused, and a refused member is never usable.

A pool serves one model (``model``; None in pools built by hand: whatever the
workers serve).  A job whose key names a LoRA adapter (``RouteKey.adapter``)
is offered, among the members with room, those whose backend reports the
adapter loaded (``BackendStatus.adapters``); only when none of them has room
does the policy see the others (whose backend may load the adapter first, or
whose worker refuses it).

Membership changes at run time (``add``/``remove``/``drain``) take effect for
the next lease; leases already granted finish normally.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..backends.base import WorkerRequirement
from ..errors import ConfigError, NoHealthyWorker, Overloaded
from .health import CircuitBreaker, HealthPolicy
from .routing import Candidate, Policy, RouteKey

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ..backends.base import BackendStatus, StageBackend
    from ..errors import EpdError

logger = logging.getLogger(__name__)

SATURATED_RETRY_AFTER_S = 1.0
"""The ``Retry-After`` (seconds) of a job every worker of its pool refused as full."""


class PoolMember:
    """One worker in a pool."""

    __slots__ = ("backend", "breaker", "drained", "in_flight", "served", "worker_id")

    def __init__(self, backend: StageBackend, health: HealthPolicy) -> None:
        self.backend = backend
        self.worker_id = backend.worker_id
        self.breaker = CircuitBreaker(health)
        self.in_flight = 0
        self.served = 0
        self.drained = False

    def __repr__(self) -> str:
        return f"<PoolMember {self.worker_id} in_flight={self.in_flight}>"

    def reachable(self, status: BackendStatus | None = None) -> bool:
        """Connected, ready, not refused, and neither the worker nor an operator drains it."""
        s = self.backend.status() if status is None else status
        return s.connected and s.ready and not s.draining and s.refused is None and not self.drained

    def usable(self, now: float | None = None, status: BackendStatus | None = None) -> bool:
        """Reachable, and its circuit breaker lets a job through at ``now``."""
        moment = trio.current_time() if now is None else now
        return self.reachable(status) and self.breaker.allows(moment)

    def limit(self, pool_limit: int, status: BackendStatus | None = None) -> int:
        """Jobs this member may hold: the pool's limit, or the worker's announced one if lower."""
        announced = (self.backend.status() if status is None else status).max_concurrency
        return min(pool_limit, announced) if announced > 0 else pool_limit


@dataclass(frozen=True, slots=True)
class MemberStatistics:
    """One member's state, for /health and metrics."""

    worker_id: str
    usable: bool
    connected: bool
    draining: bool
    in_flight: int
    served: int
    breaker: str
    aborts_sent: int
    worker_aborts: int | None
    refused: str | None = None
    refusals: int = 0
    limit: int = 0


class Lease:
    """The right to run one job on one member; release it exactly once.

    Record the job's verdict before releasing: ``succeeded()``, or
    ``failed()`` for a worker-side failure.  A lease released without a
    verdict (cancelled, client error) leaves the worker's health unchanged.
    """

    __slots__ = ("_pool", "member", "released", "verdict")

    def __init__(self, pool: WorkerPool, member: PoolMember) -> None:
        self._pool = pool
        self.member = member
        self.released = False
        self.verdict: bool | None = None

    @property
    def backend(self) -> StageBackend:
        return self.member.backend

    def succeeded(self) -> None:
        self.verdict = True

    def failed(self) -> None:
        self.verdict = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        breaker = self.member.breaker
        if self.verdict is True:
            breaker.record_success()
        elif self.verdict is False:
            breaker.record_failure(trio.current_time())
        else:
            breaker.release_probe()
        self._pool._return(self.member)


class WorkerPool:
    """The workers of one stage.

    Args:
        stage: the stage name (``encode``, ``prefill``, ``decode``, ``pd``, ...).
        policy: the routing policy choosing among usable members.
        max_in_flight_per_worker: jobs one worker may hold from this router
            (lower for a worker that announces a lower ``max_concurrency``).
        health: the members' circuit-breaker thresholds.
        requirement: what the pool's workers must announce (default: any
            role, any model); given to each backend added.
        model: the model the pool serves (None: unnamed, the router's default).
        name: how statistics and logs name the pool (default: the stage).
    """

    def __init__(
        self,
        stage: str,
        policy: Policy,
        *,
        max_in_flight_per_worker: int,
        health: HealthPolicy | None = None,
        requirement: WorkerRequirement | None = None,
        model: str | None = None,
        name: str | None = None,
    ) -> None:
        if max_in_flight_per_worker < 1:
            raise ConfigError(f"pools.{stage}.max_in_flight_per_worker must be >= 1")
        self.stage = stage
        self.model = model
        self.name = name or stage
        self.policy = policy
        self.max_in_flight_per_worker = max_in_flight_per_worker
        self.health = health or HealthPolicy()
        self.requirement = requirement or WorkerRequirement(stage)
        self._members: dict[str, PoolMember] = {}
        self._slot_freed = trio.lowlevel.ParkingLot()
        self.remote_in_flight: Mapping[str, int] = {}
        """Other routers' jobs in flight per worker id (``epd_actors.core.fleet``), added
        to each candidate's ``in_flight`` for the policy; the limits stay local."""

    def __repr__(self) -> str:
        return f"<WorkerPool {self.name} members={len(self._members)}>"

    def __len__(self) -> int:
        return len(self._members)

    @property
    def members(self) -> list[PoolMember]:
        return list(self._members.values())

    def get(self, worker_id: str) -> PoolMember | None:
        return self._members.get(worker_id)

    def add(self, backend: StageBackend) -> PoolMember:
        """Add a worker (its backend must already be running); it must meet the requirement."""
        if backend.worker_id in self._members:
            raise ConfigError(f"worker {backend.worker_id!r} is already in pool {self.stage!r}")
        backend.expect(self.requirement)
        member = PoolMember(backend, self.health)
        self._members[backend.worker_id] = member
        logger.info("pool %s: added worker %s", self.stage, backend.worker_id)
        return member

    def remove(self, worker_id: str) -> PoolMember:
        """Take a worker out of the pool; its in-flight jobs finish normally."""
        member = self._members.pop(worker_id)
        logger.info("pool %s: removed worker %s", self.stage, worker_id)
        return member

    def drain(self, worker_id: str) -> None:
        """Stop giving the worker new jobs (operator drain)."""
        self._members[worker_id].drained = True

    def resume(self, worker_id: str) -> None:
        """Give a drained worker new jobs again (undoes ``drain``)."""
        self._members[worker_id].drained = False

    def statistics(self) -> list[MemberStatistics]:
        out = []
        now = trio.current_time()
        for member in self._members.values():
            status = member.backend.status()
            out.append(
                MemberStatistics(
                    worker_id=member.worker_id,
                    usable=member.usable(now, status),
                    connected=status.connected,
                    draining=status.draining or member.drained,
                    in_flight=member.in_flight,
                    served=member.served,
                    breaker=member.breaker.state.value,
                    aborts_sent=status.aborts_sent,
                    worker_aborts=status.worker_aborts,
                    refused=status.refused,
                    refusals=status.refusals,
                    limit=member.limit(self.max_in_flight_per_worker, status),
                )
            )
        return out

    def has_usable(self) -> bool:
        """Whether any member is usable now (busy or not); no side effects."""
        now = trio.current_time()
        return any(member.usable(now) for member in self._members.values())

    def refusal(self) -> NoHealthyWorker:
        """The error for a request this pool cannot serve because no member is usable."""
        return NoHealthyWorker(f"no healthy {self.stage} worker{self._of_model()}", retry_after=1.0)

    def _of_model(self) -> str:
        return "" if self.model is None else f" of model {self.model!r}"

    def saturated(self, last: EpdError) -> Overloaded:
        """The error for a job every worker with room refused as full (``last``: the latest)."""
        return Overloaded(
            f"every {self.stage} worker{self._of_model()} is full (the last said: {last})",
            retry_after=SATURATED_RETRY_AFTER_S,
        )

    def try_lease(self, key: RouteKey, *, exclude: Iterable[str] = ()) -> Lease | None:
        """Pick a member now, or return None if every usable one is full.

        Raises:
            NoHealthyWorker: no member is usable at all (after ``exclude``).
        """
        excluded = set(exclude)
        now = trio.current_time()
        pool_limit = self.max_in_flight_per_worker
        any_usable = False
        open_members: dict[str, PoolMember] = {}
        for m in self._members.values():
            if m.worker_id in excluded:
                continue
            status = m.backend.status()
            if not m.usable(now, status):
                continue
            any_usable = True
            if m.in_flight < m.limit(pool_limit, status):
                open_members[m.worker_id] = m
        if not any_usable:
            raise self.refusal()
        if not open_members:
            return None
        if key.adapter is not None:
            open_members = _preferring_adapter(open_members, key.adapter)
        remote = self.remote_in_flight
        candidates = [
            Candidate(m.worker_id, m.in_flight + remote.get(m.worker_id, 0))
            for m in open_members.values()
        ]
        choice = self.policy.choose(candidates, key)
        assert choice is not None, "a policy returns None only for no candidates"
        member = open_members[choice.worker_id]
        member.breaker.on_dispatch(now)
        member.in_flight += 1
        member.served += 1
        return Lease(self, member)

    async def lease(self, key: RouteKey, *, exclude: Iterable[str] = ()) -> Lease:
        """Pick a member, waiting for a free slot when every usable one is full.

        Raises:
            NoHealthyWorker: no member is usable (checked again after each wait).

        Cancellation: safe; nothing is held until the lease is returned.
        Backpressure: waits while all usable members are at their limit.
        """
        excluded = tuple(exclude)
        while True:
            try:
                granted = self.try_lease(key, exclude=excluded)
            except NoHealthyWorker:
                # Only a returned lease wakes a waiter, one per lease.  When the
                # workers are gone (a lost connection fails the jobs holding its
                # slots) more waiters may be parked than leases come back, and
                # nothing else would wake the rest before their deadlines: pass
                # the wake-up on, so each waiter in turn sees NoHealthyWorker.
                self._slot_freed.unpark()
                raise
            if granted is not None:
                return granted
            await self._slot_freed.park()

    def _return(self, member: PoolMember) -> None:
        member.in_flight -= 1
        self._slot_freed.unpark()


def _preferring_adapter(members: dict[str, PoolMember], adapter: str) -> dict[str, PoolMember]:
    """The members that have ``adapter`` loaded, if any; else all of them."""
    having = {
        worker_id: member
        for worker_id, member in members.items()
        if adapter in member.backend.status().adapters
    }
    return having or members
