"""Shared state between router replicas through a real redis-server (coredis on Trio).

Real sockets, so the real clock: short periods and TTLs keep these fast, and
every wait is for a condition (bounded only as a safety net).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import coredis
import pytest
import trio
from coredis.exceptions import AuthenticationRequiredError

from epd_actors.core.fleet import SharedSettings
from epd_actors.core.fleet.redis_state import RedisFleetStore
from epd_actors.frontends.admin import RouterAdmin
from tests.fleet.redis_server import RedisServer, make_certificate
from tests.fleet.replicas import (
    Workers,
    held,
    holding_one_each,
    replica,
    replicas,
    settle,
    short_request,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from epd_actors.core.router import Router

# coredis (6.9) makes three anyio memory streams per connection object and does
# not close them when the connection fails (coredis/connection/_base.py), so a
# Redis that goes away leaves ResourceWarnings behind at garbage collection.
# Nothing of ours is unclosed; only those are let through.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function MemoryObject(Send|Receive)Stream.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)


@pytest.fixture(autouse=True)
def _collect_coredis_leftovers() -> Iterator[None]:
    """Collect them here, under this module's filter, not in some later test."""
    yield
    gc.collect()


SAFETY_S = 20.0
"""Only a net under waits for conditions, never what a test measures."""


def fast(url: str, **overrides: object) -> SharedSettings:
    values: dict[str, object] = {
        "redis_url": url,
        "publish_interval_s": 0.05,
        "ttl_s": 0.5,
        "timeout_s": 0.25,
        "key_prefix": "test",
    }
    values.update(overrides)
    return SharedSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password="s3cret-pw")
    server.start()
    yield server
    server.stop()


def store_of(settings: SharedSettings) -> RedisFleetStore:
    return RedisFleetStore(settings)


async def wait_for(router: Router, condition: object) -> None:
    assert router.fleet is not None
    with trio.fail_after(SAFETY_S):
        while not condition():  # type: ignore[operator]
            await router.fleet.wait_cycles()


def live(router: Router) -> list[str]:
    assert router.fleet is not None
    return [r.router_id for r in router.fleet.status().routers]


async def test_three_routers_share_in_flight_counts_through_redis(redis: RedisServer) -> None:
    settings = fast(redis.url)
    async with replicas(3, Workers(3), settings, store_of(settings)) as routers:
        with trio.fail_after(SAFETY_S):
            await settle(routers)
            async with holding_one_each(routers) as placed:
                assert routers[2].supervisor.remote_requests_in_flight == 2
    assert sorted(placed) == ["pd-0", "pd-1", "pd-2"]


async def test_an_admin_drain_on_one_router_reaches_the_other(redis: RedisServer) -> None:
    settings = fast(redis.url)
    async with replicas(2, Workers(2), settings, store_of(settings)) as (a, b):
        with trio.fail_after(SAFETY_S):
            await settle([a, b])
            assert (await RouterAdmin(a)("POST", "/admin/workers/pd-1/drain", None))[0] == 200
            member = b.pools["pd"].get("pd-1")
            assert member is not None
            await wait_for(b, lambda: member.drained)
            for n in range(3):
                async with held(b, f"after-drain-{n}") as worker:
                    assert worker == "pd-0"


async def test_live_routers_are_listed_and_expire_in_redis(redis: RedisServer) -> None:
    settings = fast(redis.url)
    store = store_of(settings)
    workers = Workers(1)
    async with replicas(2, workers, settings, store) as (a, b):
        with trio.fail_after(SAFETY_S):
            async with replica(workers, fast(redis.url, router_id="c"), store):
                await wait_for(a, lambda: live(a) == ["c", "r0", "r1"])
            await wait_for(a, lambda: live(a) == ["r0", "r1"])  # c's key expired
            await wait_for(b, lambda: live(b) == ["r0", "r1"])
            view = (await RouterAdmin(b)("GET", "/admin/routers", None))[1]
            assert isinstance(view, dict)
            assert [r["id"] for r in view["routers"]] == ["r0", "r1"]
            assert view["store"] == f"Redis at redis://:***@127.0.0.1:{redis.port}/0"


async def test_redis_killed_and_restarted_mid_load_fails_no_request(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_actors.core.fleet")
    settings = fast(redis.url)
    outcomes: list[bool] = []
    async with replicas(2, Workers(2), settings, store_of(settings)) as (a, b):
        assert a.fleet is not None
        with trio.fail_after(SAFETY_S):
            await settle([a, b])
            stop = trio.Event()

            async def load(router: Router, tag: str) -> None:
                n = 0
                while not stop.is_set():
                    outcomes.append(await short_request(router, f"{tag}-{n}"))
                    n += 1

            async with trio.open_nursery() as nursery:
                for router, tag in ((a, "a"), (a, "a2"), (b, "b"), (b, "b2")):
                    nursery.start_soon(load, router, tag)
                redis.stop()
                await wait_for(a, lambda: not a.fleet.up)  # type: ignore[union-attr]
                await wait_for(a, lambda: live(a) == [])  # past the TTL: the local view
                before = len(outcomes)
                a.drain_worker("pd-1")  # made while Redis is away: sent when it is back
                await a.fleet.wait_cycles(5)
                assert len(outcomes) > before  # requests went on while Redis was down
                redis.start()  # empty: no persistence
                await wait_for(a, lambda: live(a) == ["r0", "r1"])
                await wait_for(b, lambda: live(b) == ["r0", "r1"])
                member = b.pools["pd"].get("pd-1")
                assert member is not None
                await wait_for(b, lambda: member.drained)
                stop.set()
            assert a.fleet.status().outages == 1
            value = a.metrics.registry.get_sample_value("epd_fleet_store_up")
            assert value == 1
    assert outcomes
    assert all(outcomes)  # zero failed requests
    down = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(down) == 2  # one line per router for the whole outage
    assert "s3cret-pw" not in caplog.text


async def test_a_paused_redis_times_out_and_recovers(redis: RedisServer) -> None:
    settings = fast(redis.url)
    async with replicas(2, Workers(2), settings, store_of(settings)) as (a, b):
        assert a.fleet is not None
        with trio.fail_after(SAFETY_S):
            await settle([a, b])
            redis.pause()
            try:
                await wait_for(a, lambda: not a.fleet.up)  # type: ignore[union-attr]
                assert await short_request(a, "while-paused")
                assert "0.25 s" in (a.fleet.status().last_error or "")
            finally:
                redis.resume()
            await wait_for(a, lambda: a.fleet.up and live(a) == ["r0", "r1"])  # type: ignore[union-attr]


async def test_a_wrong_password_leaves_the_router_on_its_local_view(redis: RedisServer) -> None:
    wrong = redis.url.replace("s3cret-pw", "wrong")
    settings = fast(wrong)
    async with replica(Workers(1), settings, store_of(settings)) as router:
        assert router.fleet is not None
        with trio.fail_after(SAFETY_S):
            await router.fleet.wait_cycles(2)
        status = router.fleet.status()
        assert not status.up
        assert status.exchanges == 0
        assert status.failures >= 2
        assert await short_request(router, "served-anyway")


async def test_password_auth_against_the_server(redis: RedisServer) -> None:
    # The server refuses clients without the password; the configured URL carries it.
    settings = fast(redis.url)
    async with replicas(2, Workers(1), settings, store_of(settings)) as (a, _):
        with trio.fail_after(SAFETY_S):
            await wait_for(a, lambda: live(a) == ["r0", "r1"])
    bare = coredis.Redis(host="127.0.0.1", port=redis.port, stream_timeout=1, connect_timeout=1)
    with pytest.RaisesGroup(pytest.RaisesExc(AuthenticationRequiredError), flatten_subgroups=True):
        async with bare:
            await bare.ping()


async def test_rediss_tls_with_a_password(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, password="tls-pw", tls=make_certificate(tmp_path))
    server.start()
    try:
        settings = fast(server.url)
        async with replicas(2, Workers(1), settings, store_of(settings)) as (a, b):
            with trio.fail_after(SAFETY_S):
                await wait_for(a, lambda: live(a) == ["r0", "r1"])
                await wait_for(b, lambda: live(b) == ["r0", "r1"])
    finally:
        server.stop()


async def test_a_garbage_admin_entry_is_skipped(redis: RedisServer) -> None:
    settings = fast(redis.url)
    client = coredis.Redis.from_url(redis.url, decode_responses=True)
    async with client:
        await client.xadd("test:admin", {"change": "not json"})
        await client.xadd("test:admin", {"change": '{"action": "drain", "worker_id": "pd-0"}'})
    async with replica(Workers(1), settings, store_of(settings)) as router:
        member = router.pools["pd"].get("pd-0")
        assert member is not None
        await wait_for(router, lambda: member.drained)
        assert router.fleet is not None
        assert router.fleet.up
