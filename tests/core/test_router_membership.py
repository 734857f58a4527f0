"""Workers join, drain and leave a running router."""

from __future__ import annotations

import pytest
import trio

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.errors import ConfigError
from epd_actors.frontends.admin import RouterAdmin
from epd_actors.request import DoneEvent
from epd_actors.testing import SimFleet, build_sim_fleet


def config_without(fleet: SimFleet, *absent: str) -> RouterConfig:
    pools = []
    for stage, pool in fleet.pools.items():
        endpoints = tuple(
            WorkerEndpoint(m.worker_id, "tcp://127.0.0.1:1")
            for m in pool.members
            if m.worker_id not in absent
        )
        pools.append(PoolConfig(stage, endpoints, policy="round_robin"))
    return RouterConfig(tuple(pools))


async def run(router: object, n: int) -> None:
    request = GenerationRequest(
        Prompt(text=f"q{n}"), sampling=SamplingParams(max_tokens=3), request_id=f"m{n}"
    )
    async with router.generate(request) as events:  # type: ignore[attr-defined]
        assert isinstance([e async for e in events][-1], DoneEvent)


async def test_add_drain_and_remove_workers_at_run_time() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 2})
    config = config_without(fleet, "decode-1")
    async with open_router(config, backend_factory=fleet.backend_factory) as router:
        for n in range(4):
            await run(router, n)
        assert fleet.engines["decode-1"].statistics().generate_requests == 0

        await router.add_worker("decode", WorkerEndpoint("decode-1", "tcp://127.0.0.1:1"))
        for n in range(4, 8):
            await run(router, n)
        assert fleet.engines["decode-1"].statistics().generate_requests == 2

        router.drain_worker("decode-0")
        for n in range(8, 11):
            await run(router, n)
        assert fleet.engines["decode-0"].statistics().generate_requests == 6
        assert fleet.engines["decode-1"].statistics().generate_requests == 5

        router.remove_worker("decode-0")
        assert [m.worker_id for m in router.pools["decode"].members] == ["decode-1"]
        with pytest.raises(ConfigError):
            router.remove_worker("decode-0")
        with pytest.raises(ConfigError):
            await router.add_worker("decode", WorkerEndpoint("decode-1", "tcp://127.0.0.1:1"))
        with pytest.raises(ConfigError):
            await router.add_worker("nope", WorkerEndpoint("x", "tcp://127.0.0.1:1"))


async def test_admin_routes_change_membership() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 2})
    config = config_without(fleet, "decode-1")
    async with open_router(config, backend_factory=fleet.backend_factory) as router:
        admin = RouterAdmin(router)
        status, body = await admin("GET", "/admin/workers", None)
        assert status == 200
        assert [w["worker_id"] for w in body["pools"]["decode"]] == ["decode-0"]  # type: ignore[index]
        added = await admin(
            "POST",
            "/admin/workers",
            {"stage": "decode", "id": "decode-1", "address": "tcp://127.0.0.1:1"},
        )
        assert added[0] == 201
        assert (await admin("POST", "/admin/workers/decode-0/drain", None))[0] == 200
        await run(router, 1)
        assert fleet.engines["decode-1"].statistics().generate_requests == 1
        assert (await admin("DELETE", "/admin/workers/decode-0", None))[0] == 200
        assert (await admin("DELETE", "/admin/workers/decode-0", None))[0] == 404
        assert (await admin("POST", "/admin/workers", {"stage": "decode"}))[0] == 400
        assert (await admin("POST", "/admin/workers", [1]))[0] == 400
        assert (await admin("PUT", "/admin/workers", None))[0] == 405
        assert (await admin("GET", "/admin/elsewhere", None))[0] == 404
        await trio.lowlevel.checkpoint()
