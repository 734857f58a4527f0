"""Several routers in one Trio process over the same simulated workers.

Each router gets its own in-process backend per engine (as two routers
would each hold their own connection to one worker); the engines are
shared, so what one router sends occupies the worker for all.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.request import DoneEvent
from epd_actors.testing import build_sim_fleet, sim_config

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.backends.base import ManagedBackend
    from epd_actors.core.fleet import SharedSettings
    from epd_actors.core.fleet.state import FleetStore
    from epd_actors.core.router import Router

ADDRESS = "tcp://127.0.0.1:1"


class Workers:
    """``count`` simulated PD workers ``pd-0`` ...; the first ``configured`` are configured."""

    def __init__(self, count: int, *, configured: int | None = None, token_s: float = 0.01):
        fleet = build_sim_fleet({"pd": count}, config=sim_config(output_token_s=token_s))
        self.engines = fleet.engines
        self.ids = sorted(self.engines)
        self.configured = self.ids[: count if configured is None else configured]

    def config(self, policy: str, shared: SharedSettings) -> RouterConfig:
        endpoints = tuple(WorkerEndpoint(i, ADDRESS) for i in self.configured)
        return RouterConfig((PoolConfig("pd", endpoints, policy=policy),), shared=shared)

    def factory(self, endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
        return InProcessBackend(endpoint.worker_id, self.engines[endpoint.worker_id], stage="pd")


@asynccontextmanager
async def replica(
    workers: Workers,
    settings: SharedSettings,
    store: FleetStore | None,
    *,
    policy: str = "least_in_flight",
) -> AsyncIterator[Router]:
    """One router over ``workers`` sharing ``store`` (None: nothing shared)."""
    config = workers.config(policy, settings)
    async with open_router(config, backend_factory=workers.factory, fleet_store=store) as router:
        yield router


@asynccontextmanager
async def replicas(
    count: int,
    workers: Workers,
    settings: SharedSettings,
    store: FleetStore | None,
    *,
    policy: str = "least_in_flight",
) -> AsyncIterator[list[Router]]:
    """``count`` routers named ``r0`` ... sharing ``store``."""
    async with AsyncExitStack() as stack:
        routers = []
        for n in range(count):
            named = replace(settings, router_id=f"r{n}")
            opened = replica(workers, named, store, policy=policy)
            routers.append(await stack.enter_async_context(opened))
        yield routers


def long_request(tag: str) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"hold {tag}"), sampling=SamplingParams(max_tokens=4000), request_id=tag
    )


def busy_workers(router: Router) -> dict[str, int]:
    return {m.worker_id: m.in_flight for m in router.pools["pd"].members if m.in_flight}


@asynccontextmanager
async def held(router: Router, tag: str) -> AsyncIterator[str]:
    """Start a long request on ``router``; yield the worker it runs on; cancel it on exit."""
    before = served(router)
    async with router.generate(long_request(tag)) as events:
        await events.receive()  # its first token: the worker is leased
        after = served(router)
        (worker,) = [w for w, n in after.items() if n > before.get(w, 0)]
        yield worker


@asynccontextmanager
async def holding_one_each(
    routers: list[Router], *, settle_between: bool = True
) -> AsyncIterator[list[str]]:
    """One long request on each router in turn; yield the workers they run on while all run.

    With ``settle_between``, every router exchanges with the store after each start, so the
    next router routes on the load the previous ones published.
    """
    placed: list[str] = []

    async def hold(router: Router, tag: str, started: trio.Event, stop: trio.Event) -> None:
        async with held(router, tag) as worker:
            placed.append(worker)
            started.set()
            await stop.wait()

    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        for n, router in enumerate(routers):
            started = trio.Event()
            nursery.start_soon(hold, router, f"long{n}", started, stop)
            await started.wait()
            if settle_between:
                await settle(routers)
        try:
            yield placed
        finally:
            stop.set()


def served(router: Router) -> dict[str, int]:
    return {m.worker_id: m.served for m in router.pools["pd"].members}


async def short_request(router: Router, tag: str) -> bool:
    """Run one short request to its end; whether it finished with a DoneEvent."""
    request = GenerationRequest(
        Prompt(text=tag), sampling=SamplingParams(max_tokens=2), request_id=tag
    )
    async with router.generate(request) as events:
        final = [event async for event in events][-1]
    return isinstance(final, DoneEvent)


async def settle(routers: list[Router], exchanges: int = 2) -> None:
    """Wait until every router has completed ``exchanges`` more exchanges with the store."""
    async with trio.open_nursery() as nursery:
        for router in routers:
            assert router.fleet is not None
            nursery.start_soon(router.fleet.wait_exchanges, exchanges)
