"""Draining tells load balancers first: /health and /readyz turn 503 before the listeners close."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
import trio.testing

from epd_actors.core.router import open_router
from epd_actors.frontends.http import RouterHttpApp
from epd_actors.program.config_file import FileConfig, ServerConfig
from epd_actors.program.serve import serve_router
from epd_actors.testing import build_sim_fleet
from tests.frontends.test_http_frontend import connected

PD = {"pd": 1}


async def get(port: int, path: str) -> tuple[int, dict[str, object]]:
    """One ``GET`` on a fresh loopback connection: (status, JSON body)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_liveness_and_readiness_follow_the_router() -> None:
    fleet = build_sim_fleet(PD)
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        app = RouterHttpApp(router)
        async with connected(app) as client:
            ready = await client.request("GET", "/readyz")
            app.draining = True
            draining = await client.request("GET", "/readyz")
            health = await client.request("GET", "/health")
            alive = await client.request("GET", "/livez")
    assert (ready.status, ready.json()) == (200, {"status": "ok"})
    assert (draining.status, draining.json()) == (503, {"status": "draining"})
    assert (health.status, health.json()["status"]) == (503, "draining")
    assert (alive.status, alive.json()) == (200, {"status": "alive"})


async def test_a_stopping_router_says_draining_while_it_still_accepts() -> None:
    fleet = build_sim_fleet(PD)
    config = FileConfig(fleet.router_config(), ServerConfig("127.0.0.1:0", drain_notice_s=0.5))
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            start = partial(serve_router, config, stop=stop, backend_factory=fleet.backend_factory)
            addresses, router = await nursery.start(start)
            await router.wait_ready()
            port = addresses.http[1]
            assert (await get(port, "/health"))[0] == 200
            stop.set()
            await trio.testing.wait_all_tasks_blocked()
            status, body = await get(port, "/health")  # a new connection is still accepted
            assert (status, body["status"]) == (503, "draining")
            assert (await get(port, "/livez"))[0] == 200
    # serve_router returned: the listeners closed after the notice, nothing was left to drain.
    with pytest.raises(OSError, match="all attempts to connect"):
        await trio.open_tcp_stream("127.0.0.1", port)
