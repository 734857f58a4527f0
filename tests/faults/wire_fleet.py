"""A router whose native connections run over memory streams to real worker runtimes.

Each worker is a :class:`WorkerServer` around a :class:`SimEngine` (all sharing
in-memory stores); the router's :class:`NativeBackend` for it dials through
:meth:`WireFleet.connect`, which opens a ``trio.testing.memory_stream_pair``
and serves the far end -- with the real runtime, or with a hand-written
"worker" for the first connections when a test wants a fault a real worker
never commits.  Everything runs on the virtual clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio
import trio.testing

from epd_actors.addresses import parse_address
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.core.config import Deadlines, PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.health import HealthPolicy
from epd_actors.core.retry import RetryPolicy
from epd_actors.core.router import open_router
from epd_actors.protocol import Role
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.store import create_sim_stores
from epd_actors.worker.runtime import WorkerConfig, WorkerServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.backends.base import ManagedBackend
    from epd_actors.core.router import Router

TOKEN = "wire-token"
Serve = Callable[[trio.abc.Stream], Awaitable[None]]
SETTINGS = NativeSettings(
    reconnect_backoff_start_s=0.25, reconnect_backoff_max_s=1.0, reconnect_jitter=0.0
)


@dataclass
class WireWorker:
    """One worker: its engine, its runtime and the connections the router opened."""

    engine: SimEngine
    server: WorkerServer
    first: list[Serve] = field(default_factory=list)
    connections: int = 0


class WireFleet:
    """Workers by id; ``connect(worker_id)`` is what their backends dial."""

    def __init__(
        self,
        layout: Mapping[str, list[str]],
        configs: Mapping[str, SimConfig],
        worker_overrides: Mapping[str, dict[str, object]],
    ) -> None:
        stores = create_sim_stores()
        self.layout = layout
        self.workers: dict[str, WireWorker] = {}
        self.nursery: trio.Nursery | None = None
        for stage, ids in layout.items():
            for worker_id in ids:
                engine = SimEngine(
                    Role(stage),
                    worker_id=worker_id,
                    config=configs.get(worker_id, SimConfig()),
                    ec_store=stores.ec,
                    kv_store=stores.kv,
                )
                options: dict[str, object] = {"worker_id": worker_id, "auth_token": TOKEN}
                options.update(worker_overrides.get(worker_id, {}))
                server = WorkerServer(engine, WorkerConfig(**options))  # type: ignore[arg-type]
                self.workers[worker_id] = WireWorker(engine, server)

    async def connect(self, worker_id: str) -> trio.abc.Stream:
        worker = self.workers[worker_id]
        worker.connections += 1
        router_end, worker_end = trio.testing.memory_stream_pair()
        serve = worker.first.pop(0) if worker.first else worker.server.handle_stream
        assert self.nursery is not None
        self.nursery.start_soon(serve, worker_end)
        return router_end

    def backend_factory(self, endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
        return NativeBackend(
            endpoint.worker_id,
            parse_address(endpoint.address),
            auth_token=config.auth_token,
            settings=SETTINGS,
            connect=partial(self.connect, endpoint.worker_id),
        )

    def config(
        self, *, deadlines: Deadlines, retries: RetryPolicy, health: HealthPolicy
    ) -> RouterConfig:
        # The tests name which worker a call tries first: least_in_flight gives an
        # idle pool's call to the lowest id (cache_aware, the P and PD default,
        # would send a cold prompt wherever its rendezvous hash points).
        pools = tuple(
            PoolConfig(
                stage,
                tuple(WorkerEndpoint(w, "tcp://127.0.0.1:0") for w in ids),
                policy=None if stage == "encode" else "least_in_flight",
            )
            for stage, ids in self.layout.items()
        )
        return RouterConfig(
            pools, auth_token=TOKEN, deadlines=deadlines, retries=retries, health=health
        )

    def counter(self, worker_id: str, name: str) -> int:
        return int(getattr(self.workers[worker_id].engine.statistics(), name))

    def total(self, name: str) -> int:
        return sum(self.counter(w, name) for w in self.workers)


@asynccontextmanager
async def open_wire_router(
    layout: Mapping[str, list[str]],
    *,
    configs: Mapping[str, SimConfig] | None = None,
    worker_overrides: Mapping[str, dict[str, object]] | None = None,
    first: Mapping[str, list[Serve]] | None = None,
    deadlines: Deadlines | None = None,
    retries: RetryPolicy | None = None,
    health: HealthPolicy | None = None,
) -> AsyncIterator[tuple[WireFleet, Router]]:
    """A router over a :class:`WireFleet`, every worker connected and ready."""
    fleet = WireFleet(layout, configs or {}, worker_overrides or {})
    for worker_id, serves in (first or {}).items():
        fleet.workers[worker_id].first.extend(serves)
    config = fleet.config(
        deadlines=deadlines or Deadlines(),
        retries=retries or RetryPolicy(max_attempts=1),
        health=health or HealthPolicy(),
    )
    async with trio.open_nursery() as nursery:
        fleet.nursery = nursery
        async with open_router(config, backend_factory=fleet.backend_factory) as router:
            for backend in router.backends.values():
                await backend.wait_ready()
            yield fleet, router
        nursery.cancel_scope.cancel(reason="test finished")
