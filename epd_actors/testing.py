"""Helpers for testing code that uses epd_actors: a simulated fleet in one process.

``build_sim_fleet({"encode": 2, "prefill": 1, "decode": 1})`` makes one
:class:`~epd_actors.simulator.engine.SimEngine` per worker, all sharing
in-memory stores, each behind an
:class:`~epd_actors.backends.inprocess.InProcessBackend`, grouped into pools.
Hand ``fleet.pools`` to a :class:`~epd_actors.core.supervisor.Supervisor`, or use
``fleet.backend_factory`` with :func:`~epd_actors.core.router.open_router` and
``fleet.router_config()``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from .backends.inprocess import InProcessBackend
from .core.config import Deadlines, PoolConfig, RouterConfig, WorkerEndpoint
from .core.pool import WorkerPool
from .core.routing import make_policy
from .protocol import Role
from .simulator.engine import SimConfig, SimCounters, SimEngine
from .simulator.store import SimStores, create_sim_stores

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .backends.base import ManagedBackend


@dataclass
class SimFleet:
    """Simulated workers of one process, by worker id (``<stage>-<n>``)."""

    stores: SimStores
    engines: dict[str, SimEngine]
    backends: dict[str, InProcessBackend]
    pools: dict[str, WorkerPool]
    policies: dict[str, str]

    def counters(self, stage: str | None = None) -> dict[str, SimCounters]:
        """Counters of every engine (of one stage, if given)."""
        return {
            worker_id: engine.statistics()
            for worker_id, engine in self.engines.items()
            if stage is None or engine.role.value == stage
        }

    def total(self, counter: str, stage: str | None = None) -> int:
        """A counter summed over the engines (of one stage, if given)."""
        return sum(int(getattr(c, counter)) for c in self.counters(stage).values())

    def kv_handles_outstanding(self) -> int:
        return self.total("kv_handles_outstanding")

    def router_config(self, *, deadlines: Deadlines | None = None) -> RouterConfig:
        """A router config naming this fleet's workers (use with ``backend_factory``)."""
        pools = []
        for stage, pool in self.pools.items():
            endpoints = tuple(
                WorkerEndpoint(m.worker_id, "tcp://127.0.0.1:0") for m in pool.members
            )
            pools.append(PoolConfig(stage, endpoints, policy=self.policies[stage]))
        return RouterConfig(tuple(pools), deadlines=deadlines or Deadlines())

    def backend_factory(self, endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
        """A ``BackendFactory`` returning this fleet's in-process backends."""
        return self.backends[endpoint.worker_id]


def build_sim_fleet(
    workers: Mapping[str, int],
    *,
    config: SimConfig | None = None,
    configs: Mapping[str, SimConfig] | None = None,
    policies: Mapping[str, str] | None = None,
    max_in_flight_per_worker: int = 256,
    stores: SimStores | None = None,
) -> SimFleet:
    """Build simulated workers and their pools.

    Args:
        workers: stage -> number of workers.
        config: simulator settings for every worker.
        configs: per-stage overrides of ``config``.
        policies: stage -> routing policy name (default ``round_robin``).
        max_in_flight_per_worker: the pools' per-worker limit.
        stores: the stores the engines share (default: new in-memory ones).
    """
    stores = stores or create_sim_stores()
    base = config or SimConfig()
    engines: dict[str, SimEngine] = {}
    backends: dict[str, InProcessBackend] = {}
    pools: dict[str, WorkerPool] = {}
    chosen: dict[str, str] = {}
    for stage, count in workers.items():
        chosen[stage] = (policies or {}).get(stage, "round_robin")
        pool = WorkerPool(
            stage,
            make_policy(chosen[stage]),
            max_in_flight_per_worker=max_in_flight_per_worker,
        )
        for index in range(count):
            worker_id = f"{stage}-{index}"
            engine = SimEngine(
                Role(stage),
                worker_id=worker_id,
                config=(configs or {}).get(stage, base),
                ec_store=stores.ec,
                kv_store=stores.kv,
            )
            backend = InProcessBackend(worker_id, engine, stage=stage)
            engines[worker_id] = engine
            backends[worker_id] = backend
            pool.add(backend)
        pools[stage] = pool
    return SimFleet(stores, engines, backends, pools, chosen)


def sim_config(**overrides: object) -> SimConfig:
    """A :class:`SimConfig` with ``overrides`` (names checked)."""
    known = {f.name for f in fields(SimConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown simulator knobs: {sorted(unknown)}")
    return SimConfig(**overrides)  # type: ignore[arg-type]
