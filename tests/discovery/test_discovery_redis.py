"""Workers registered in Redis: the record, the reader's view, and both ends against a real Redis.

The registrar (the worker's side) and the ``redis`` discovery (the router's)
run in one Trio process against a real ``redis-server``, with in-process
simulated workers behind the router.  Real sockets, so the real clock: short
periods and TTLs keep these fast, and every wait is for a condition (bounded
only as a safety net).  Worker processes registering themselves are in
``test_discovery_redis_processes.py``.
"""

from __future__ import annotations

import gc
import json
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

pytest.importorskip("coredis")

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.addresses import Address
from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.config_tables import ConfigTable
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.fleet import SharedSettings
from epd_actors.discovery import RedisDiscoverySettings, RedisPool, open_discovery
from epd_actors.discovery.redis_discovery import RedisDiscovery, _PoolReader
from epd_actors.discovery.redis_kind import RedisKind
from epd_actors.discovery.registrations import (
    Registration,
    RegistrationError,
    RegistrationState,
    pool_key,
    worker_key,
)
from epd_actors.errors import ConfigError
from epd_actors.program.worker_registration import Registrar, RegistrationSettings
from epd_actors.protocol import Role
from epd_actors.request import DoneEvent
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import create_sim_stores
from epd_actors.testing import sim_config
from tests.discovery.test_discovery_kubernetes import Recorder, members
from tests.fleet.redis_server import RedisServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

    from epd_actors.core.router import Router

# coredis leaves anyio memory streams unclosed when a connection fails (see test_fleet_redis).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function MemoryObject(Send|Receive)Stream.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)

SAFETY_S = 20.0
"""Only a net under waits for conditions, never what a test measures."""
PREFIX = "test"
TTL_S = 0.6
ROUTER = RouterConfig((PoolConfig("pd"),))


@pytest.fixture(autouse=True)
def _collect_coredis_leftovers() -> Iterator[None]:
    yield
    gc.collect()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password="reg-pw")
    server.start()
    yield server
    server.stop()


def record(worker_id: str = "pd-a", **overrides: Any) -> Registration:
    values: dict[str, Any] = {
        "worker_id": worker_id,
        "stage": "pd",
        "model": "sim-model",
        "address": "tcp://127.0.0.1:9",
        "backend": "native",
        "instance": "i1",
        "ttl_s": 2.0,
    }
    values.update(overrides)
    return Registration(**values)


# -- the record, without Redis -------------------------------------------------------------


def test_a_record_reads_back_as_written() -> None:
    for state in RegistrationState:
        written = record(state=state)
        assert Registration.from_json(written.to_json()) == written


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        (json.dumps({"worker_id": "a"}), "'stage'"),
        (json.dumps({**json.loads(record().to_json()), "ttl_s": "2"}), "'ttl_s'"),
        (json.dumps({**json.loads(record().to_json()), "ttl_s": -1}), "positive"),
        (json.dumps({**json.loads(record().to_json()), "state": "odd"}), "unknown state"),
    ],
)
def test_a_bad_record_is_refused_with_its_reason(text: str, problem: str) -> None:
    with pytest.raises(RegistrationError, match=problem):
        Registration.from_json(text)


def test_draining_and_stopped_records_are_not_eligible() -> None:
    assert record().as_discovered().state.eligible
    assert not record(state=RegistrationState.DRAINING).as_discovered().state.eligible


def settings(url: str = "redis://127.0.0.1:1/0", **overrides: Any) -> RedisDiscoverySettings:
    values: dict[str, Any] = {
        "kind": "redis",
        "redis_url": url,
        "key_prefix": PREFIX,
        "period_s": 0.05,
        "timeout_s": 0.25,
        "pools": (RedisPool("pd", None, "sim-model"),),
    }
    values.update(overrides)
    return RedisDiscoverySettings(**values)


def test_a_missing_record_stays_for_its_ttl_and_a_stopped_one_goes_at_once() -> None:
    from prometheus_client import CollectorRegistry

    from epd_actors.discovery.redis_discovery import _Metrics

    reader = _PoolReader(settings().pools[0], settings(), _Metrics(CollectorRegistry()))
    a, b = record("a"), record("b")
    assert reader.view([a, b], now=0.0) == [a, b]
    assert reader.view([b], now=1.0) == [a, b]  # a missing since 1.0
    assert reader.view([b], now=2.9) == [a, b]
    assert reader.view([b], now=3.0) == [b]  # missing for its ttl: gone
    assert reader.view([b, a], now=3.1) == [b, a]  # back (Redis restarted, say)
    assert reader.view([b], now=4.0) == [b, a]  # the clock starts again
    assert reader.view([record("a", state=RegistrationState.STOPPED), b], now=4.1) == [b]


# -- configuration -----------------------------------------------------------------------


def parse(table: dict[str, Any], router: RouterConfig = ROUTER) -> RedisDiscoverySettings:
    parsed = RedisKind().parse(ConfigTable(table, "discovery"), router)
    assert isinstance(parsed, RedisDiscoverySettings)
    return parsed


def test_the_redis_kind_defaults_to_every_pool_and_the_shared_redis() -> None:
    router = RouterConfig(
        (PoolConfig("prefill"), PoolConfig("decode"), PoolConfig("pd", model="other")),
        shared=SharedSettings(redis_url="redis://:pw@r:6379/0", key_prefix="fleet"),
    )
    parsed = parse({}, router)
    assert parsed.redis_url == "redis://:pw@r:6379/0"
    assert parsed.key_prefix == "fleet"
    assert [(p.stage, p.model, p.served_model) for p in parsed.pools] == [
        ("prefill", None, "sim-model"),
        ("decode", None, "sim-model"),
        ("pd", "other", "other"),
    ]
    text = "\n".join(parsed.describe())
    assert "pw" not in text
    assert "fleet:workers:pd:other" in text


def test_the_redis_kind_reads_its_own_keys() -> None:
    parsed = parse(
        {
            "redis_url": "rediss://h:6380/1",
            "key_prefix": "p",
            "period_s": 2,
            "timeout_s": 0.1,
            "pools": [{"stage": "pd"}],
        }
    )
    assert (parsed.redis_url, parsed.key_prefix, parsed.period_s, parsed.timeout_s) == (
        "rediss://h:6380/1",
        "p",
        2.0,
        0.1,
    )


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({}, "redis_url: required"),
        ({"redis_url": "http://h/0"}, "scheme 'http'"),
        ({"redis_url": "redis://h/0", "period_s": 0}, "period_s"),
        ({"redis_url": "redis://h/0", "pools": [{"stage": "decode"}]}, r"no \[pools.decode\]"),
        ({"redis_url": "redis://h/0", "pools": [{"stage": "pd"}, {"stage": "pd"}]}, "twice"),
        ({"redis_url": "redis://h/0", "pools": []}, "at least one pool"),
        ({"redis_url": "redis://h/0", "typo": 1}, "discovery.typo"),
    ],
)
def test_bad_redis_discovery_settings_are_refused(table: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse(table)


def test_registration_settings_refuse_a_wildcard_without_an_advertised_address() -> None:
    reg = RegistrationSettings("redis://h/0", "pd", "m")
    with pytest.raises(ConfigError, match="--advertise-address"):
        reg.advertised(Address("tcp", host="0.0.0.0", port=5))
    assert reg.advertised(Address("tcp", host="127.0.0.1", port=5)) == "tcp://127.0.0.1:5"
    named = RegistrationSettings("redis://h/0", "pd", "m", advertise="10.1.2.3")
    assert named.advertised(Address("tcp", host="0.0.0.0", port=5)) == "tcp://10.1.2.3:5"
    full = RegistrationSettings("redis://h/0", "pd", "m", advertise="tcp://w.example:7000")
    assert full.advertised(Address("tcp", host="::", port=5)) == "tcp://w.example:7000"
    with pytest.raises(ConfigError, match="scheme 'http'"):
        RegistrationSettings("http://h/0", "pd", "m")
    with pytest.raises(ConfigError, match="--register-ttl"):
        RegistrationSettings("redis://h/0", "pd", "m", ttl_s=0)


# -- both ends against a real Redis ------------------------------------------------------


class Engines:
    """A backend factory: one in-process simulated worker per registered id."""

    def __init__(self) -> None:
        self.config = sim_config(output_token_s=0.001)
        self.stores = create_sim_stores()
        self.built: list[str] = []

    def __call__(self, endpoint: WorkerEndpoint, config: RouterConfig) -> InProcessBackend:
        engine = SimEngine(
            Role.PD,
            worker_id=endpoint.worker_id,
            config=self.config,
            ec_store=self.stores.ec,
            kv_store=self.stores.kv,
        )
        self.built.append(f"{endpoint.worker_id} {endpoint.address}")
        return InProcessBackend(endpoint.worker_id, engine, stage="pd")


def registration(url: str, **overrides: Any) -> RegistrationSettings:
    values: dict[str, Any] = {
        "url": url,
        "stage": "pd",
        "model": "sim-model",
        "key_prefix": PREFIX,
        "ttl_s": TTL_S,
        "timeout_s": 0.25,
    }
    values.update(overrides)
    return RegistrationSettings(**values)


class Worker:
    """A registrar running in its own cancel scope (cancelled = the worker stopped)."""

    def __init__(self, url: str, worker_id: str, port: int = 9, **overrides: Any) -> None:
        self.draining = False
        self.registrar = Registrar(
            registration(url, **overrides),
            worker_id,
            f"tcp://127.0.0.1:{port}",
            draining=lambda: self.draining,
        )
        self.scope = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            await self.registrar.run(task_status=task_status)

    def drain(self) -> None:
        self.draining = True
        self.registrar.wake()


@asynccontextmanager
async def routed(url: str, **overrides: Any) -> AsyncIterator[tuple[Router, Recorder, Any]]:
    engines = Engines()
    async with open_router(ROUTER, backend_factory=engines) as router:
        recorder = Recorder(router)
        discovery = RedisDiscovery(settings(url, **overrides), router.metrics.registry)
        async with trio.open_nursery() as nursery:
            await nursery.start(discovery.run, recorder)
            yield router, recorder, discovery
            nursery.cancel_scope.cancel()


async def finishes(router: Router, n: int) -> bool:
    request = GenerationRequest(
        Prompt(text=f"q{n}"), sampling=SamplingParams(max_tokens=2), request_id=f"r{n}"
    )
    async with router.generate(request) as events:
        return isinstance([e async for e in events][-1], DoneEvent)


async def test_a_registered_worker_is_routed_to_drained_and_removed(
    redis: RedisServer,
) -> None:
    with trio.fail_after(SAFETY_S):
        async with routed(redis.url) as (router, recorder, _), trio.open_nursery() as nursery:
            worker = Worker(redis.url, "pd-a")
            await nursery.start(worker.run)
            await recorder.wait_for(("add", "pd-a"))
            assert await finishes(router, 1)
            assert [(m.worker_id, m.served) for m in router.pools["pd"].members] == [("pd-a", 1)]
            worker.drain()
            await recorder.wait_for(("drain", "pd-a"))
            assert members(router, "pd") == {"pd-a": True}
            worker.scope.cancel()  # the worker stops: it says so, and is removed at once
            await recorder.wait_for(("remove", "pd-a"))
            assert members(router, "pd") == {}
            assert recorder.ops == [("add", "pd-a"), ("drain", "pd-a"), ("remove", "pd-a")]


async def test_a_worker_that_stops_refreshing_is_removed_once_its_key_expired(
    redis: RedisServer,
) -> None:
    import coredis

    # A worker killed outright: its record, written once with its TTL, is never
    # refreshed and never says "stopped".
    killed = record("pd-k", ttl_s=TTL_S)
    with trio.fail_after(SAFETY_S):
        async with routed(redis.url) as (router, recorder, discovery):
            client = coredis.Redis.from_url(redis.url, decode_responses=True)
            async with client:
                key = worker_key(PREFIX, "pd-k")
                await client.set(key, killed.to_json(), px=round(TTL_S * 1000))
                await client.sadd(pool_key(PREFIX, "pd", "sim-model"), ["pd-k"])
                await recorder.wait_for(("add", "pd-k"))
                while await client.exists([key]):
                    await discovery.wait_cycles()
            await discovery.wait_cycles(2)
            assert members(router, "pd") == {"pd-k": False}  # kept for one more TTL
            await recorder.wait_for(("remove", "pd-k"))
            assert recorder.ops == [("add", "pd-k"), ("remove", "pd-k")]


async def test_a_restarted_worker_is_a_new_instance(redis: RedisServer) -> None:
    with trio.fail_after(SAFETY_S):
        async with routed(redis.url) as (router, recorder, _), trio.open_nursery() as nursery:
            first = Worker(redis.url, "pd-a", port=9)
            await nursery.start(first.run)
            await recorder.wait_for(("add", "pd-a"))
            first.scope.cancel()
            second = Worker(redis.url, "pd-a", port=10)
            await nursery.start(second.run)
            while [op for op in recorder.ops if op == ("add", "pd-a")] != [("add", "pd-a")] * 2:
                await recorder._event.wait()
            assert ("remove", "pd-a") in recorder.ops
            assert [m.worker_id for m in router.pools["pd"].members] == ["pd-a"]
            second.scope.cancel()


async def test_redis_restarted_keeps_every_worker_and_learns_them_again(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with trio.fail_after(SAFETY_S):
        async with routed(redis.url) as (router, recorder, discovery), trio.open_nursery() as n:
            a = Worker(redis.url, "pd-a")
            await n.start(a.run)
            await recorder.wait_for(("add", "pd-a"))
            redis.stop()
            await discovery.wait_cycles(3)
            stats = discovery.statistics()["pd"]
            assert not stats.up
            assert stats.errors >= 1
            assert members(router, "pd") == {"pd-a": False}  # the last view
            assert await finishes(router, 1)  # and it serves on it
            redis.start()  # empty: nothing persisted
            await a.registrar.wait_writes(1)  # registered again
            b = Worker(redis.url, "pd-b")
            await n.start(b.run)
            await recorder.wait_for(("add", "pd-b"))  # learned after the restart
            await discovery.wait_cycles(round(TTL_S / 0.05) + 2)  # past a's grace
            assert members(router, "pd") == {"pd-a": False, "pd-b": False}
            assert recorder.ops == [("add", "pd-a"), ("add", "pd-b")]
            assert discovery.statistics()["pd"].up
            a.scope.cancel()
            b.scope.cancel()
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    router_lines = [r for r in unreachable if r.name.endswith("redis_discovery")]
    assert len(router_lines) == 1  # one line for the outage, not one per read
    assert "reg-pw" not in router_lines[0].getMessage()
    assert any("answers again" in r.getMessage() for r in caplog.records)
    registry = router.metrics.registry
    assert registry.get_sample_value("epd_discovery_errors_total", {"pool": "pd"}) >= 1
    assert registry.get_sample_value("epd_discovery_up", {"pool": "pd"}) == 1


async def test_bad_records_are_skipped_with_one_warning(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    import coredis

    with trio.fail_after(SAFETY_S):
        async with routed(redis.url) as (router, recorder, discovery), trio.open_nursery() as n:
            client = coredis.Redis.from_url(redis.url, decode_responses=True)
            async with client:
                index = pool_key(PREFIX, "pd", "sim-model")
                await client.set(worker_key(PREFIX, "junk"), "{")
                await client.set(worker_key(PREFIX, "odd"), record("odd", backend="nope").to_json())
                await client.set(worker_key(PREFIX, "moved"), record("other").to_json())
                await client.sadd(index, ["junk", "odd", "moved", "ghost"])
                good = Worker(redis.url, "pd-a")
                await n.start(good.run)
                await recorder.wait_for(("add", "pd-a"))
                await discovery.wait_cycles(3)
                assert await client.smembers(index) == {"junk", "odd", "moved", "pd-a"}
            assert members(router, "pd") == {"pd-a": False}
            good.scope.cancel()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3
    assert any("unknown backend 'nope'" in line for line in skipped)
    assert any("names worker 'other'" in line for line in skipped)


async def test_a_router_bug_while_applying_is_not_taken_for_an_outage(redis: RedisServer) -> None:
    class Broken(Recorder):
        async def add_worker(self, stage: str, endpoint: WorkerEndpoint, **kw: Any) -> None:
            raise RuntimeError("a bug in the router")

    async def crash() -> None:
        async with open_router(ROUTER, backend_factory=Engines()) as router:
            nonlocal discovery
            discovery = RedisDiscovery(settings(redis.url), router.metrics.registry)
            async with trio.open_nursery() as nursery:
                worker = Worker(redis.url, "pd-a")
                await nursery.start(worker.run)
                await nursery.start(discovery.run, Broken(router))
                await trio.sleep_forever()

    discovery: Any = None
    with trio.fail_after(SAFETY_S), pytest.raises(Exception) as raised:  # noqa: PT011
        await crash()
    assert "pool pd: RuntimeError('a bug in the router')" in str(raised.value)
    assert discovery.statistics()["pd"].errors == 0


async def test_the_kind_runs_from_the_configuration_through_open_discovery(
    redis: RedisServer,
) -> None:
    router_config = RouterConfig(
        (PoolConfig("pd"),), shared=SharedSettings(redis_url=redis.url, key_prefix=PREFIX)
    )
    parsed = RedisKind().parse(ConfigTable({"period_s": 0.05}, "discovery"), router_config)
    engines = Engines()
    with trio.fail_after(SAFETY_S):
        async with (
            open_router(ROUTER, backend_factory=engines) as router,
            trio.open_nursery() as nursery,
        ):
            worker = Worker(redis.url, "pd-a")
            await nursery.start(worker.run)
            async with open_discovery(router, parsed) as discovery:
                assert isinstance(discovery, RedisDiscovery)
                while "pd-a" not in members(router, "pd"):
                    await discovery.wait_cycles()
            assert engines.built == ["pd-a tcp://127.0.0.1:9"]
            worker.scope.cancel()
