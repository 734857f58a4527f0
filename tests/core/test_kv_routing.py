"""The router follows its engines' KV events: configuration, subscribers per worker, metrics."""

from __future__ import annotations

import contextlib
import re

import prometheus_client
import pytest
import trio
import trio.lowlevel
import trio.testing

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.kv_feeds import KVSourceSpec, zmq_source
from epd_actors.core.kv_settings import KVEventsSettings
from epd_actors.errors import ConfigError
from epd_actors.kv_events import FeedState
from epd_actors.program.config_file import parse_config
from epd_actors.request import DoneEvent
from epd_actors.simulator.kv_memory import MemoryKVEventPublisher
from epd_actors.simulator.prefix_cache import prompt_token_ids
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from tests.metric_families import documented, families

KV_ON = KVEventsSettings(enabled=True, port=5557, replay_port=5558)
SYSTEM = " ".join(f"rule{i}" for i in range(96))  # 96 words: 6 blocks of 16 sim tokens


def kv_fleet(prefill: int = 2) -> tuple[SimFleet, dict[str, MemoryKVEventPublisher]]:
    """Simulated P (with prefix caches publishing in memory) and one D."""
    cached = sim_config(prefix_cache_blocks=1024)
    fleet = build_sim_fleet({"prefill": prefill, "decode": 1}, configs={"prefill": cached})
    publishers = {}
    for worker_id, engine in fleet.engines.items():
        if engine.prefix_cache is not None:
            publishers[worker_id] = MemoryKVEventPublisher()
            engine.prefix_cache.sink = publishers[worker_id]
    return fleet, publishers


def memory_sources(publishers: dict[str, MemoryKVEventPublisher]):  # type: ignore[no-untyped-def]
    def factory(spec: KVSourceSpec):  # type: ignore[no-untyped-def]
        return contextlib.nullcontext(publishers[spec.worker_id])

    return factory


def kv_config(fleet: SimFleet, *, policy: str = "kv_aware", absent: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    pools = []
    for stage, pool in fleet.pools.items():
        endpoints = tuple(
            WorkerEndpoint(m.worker_id, "tcp://127.0.0.1:1")
            for m in pool.members
            if m.worker_id not in absent
        )
        if stage == "prefill":
            pools.append(
                PoolConfig(
                    stage,
                    endpoints,
                    policy=policy,
                    kv_events=KV_ON,
                    policy_options={"tokenizer": "sim"} if policy == "kv_aware" else {},
                )
            )
        else:
            pools.append(PoolConfig(stage, endpoints, policy="round_robin"))
    return RouterConfig(tuple(pools))


async def generate(router, text: str, n: int) -> None:  # type: ignore[no-untyped-def]
    request = GenerationRequest(
        Prompt(text=text), sampling=SamplingParams(max_tokens=2), request_id=f"r{n}"
    )
    async with router.generate(request) as events:
        assert isinstance([e async for e in events][-1], DoneEvent)


# -- configuration


def test_the_file_turns_kv_events_on_per_pool_with_a_port_rule_or_own_endpoints() -> None:
    file = parse_config(
        {
            "pools": {
                "prefill": {
                    "policy": "kv_aware",
                    "kv_events": True,
                    "kv_events_port": 5557,
                    "kv_events_replay_port": 5558,
                    "kv_events_topic": "kv",
                    "kv_index_max_blocks": 1000,
                    "workers": [
                        {"id": "p0", "address": "tcp://10.0.0.5:9000"},
                        {
                            "id": "p1",
                            "address": "unix:/run/p1.sock",
                            "kv_events_endpoint": "tcp://10.0.0.6:6000",
                            "kv_events_replay_endpoint": "tcp://10.0.0.6:6001",
                        },
                    ],
                },
                "decode": {"workers": [{"id": "d0", "address": "tcp://10.0.0.7:9000"}]},
            }
        }
    )
    pool = file.router.pool("prefill")
    assert pool is not None
    settings = pool.kv_events
    assert settings == KVEventsSettings(True, 5557, 5558, "kv", 1 << 20, 1000)
    p0, p1 = pool.workers
    assert settings.endpoints(p0.address, p0.kv_events_endpoint, p0.kv_events_replay_endpoint) == (
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5558",
    )
    assert settings.endpoints(p1.address, p1.kv_events_endpoint, p1.kv_events_replay_endpoint) == (
        "tcp://10.0.0.6:6000",
        "tcp://10.0.0.6:6001",
    )
    assert not file.router.pool("decode").kv_events.enabled  # type: ignore[union-attr]


def test_an_ipv6_or_http_worker_address_gives_its_host_to_the_port_rule() -> None:
    assert KV_ON.endpoints("http://[::1]:8000", None, None) == (
        "tcp://[::1]:5557",
        "tcp://[::1]:5558",
    )
    assert KVEventsSettings(enabled=True, port=7).endpoints("tcp://h:1", None, None) == (
        "tcp://h:7",
        None,
    )


@pytest.mark.parametrize(
    ("pool", "worker", "message"),
    [
        ({}, {"kv_events_endpoint": "tcp://h:1"}, "workers[0].kv_events_endpoint: the pool"),
        ({"kv_events": True}, {}, "workers[0].kv_events_endpoint: required"),
        (
            {"kv_events": True, "kv_events_port": 5557},
            {"address": "unix:/x"},
            "workers[0].kv_events_endpoint: required",
        ),
        ({"kv_events": True}, {"kv_events_endpoint": "h:1"}, "is not a ZMQ endpoint"),
        ({"kv_events": True}, {"kv_events_endpoint": "tcp://h:x"}, "is not tcp://HOST:PORT"),
        (
            {"kv_events": True},
            {"kv_events_replay_endpoint": "tcp://h:2"},
            "replay_endpoint: needs kv_events_endpoint",
        ),
        ({"kv_events": True, "kv_events_port": 70000}, {}, "kv_events_port: 70000 is out"),
        ({"kv_events": True, "kv_index_max_blocks": 0}, {}, "kv_index_max_blocks: must be >= 1"),
        ({"kv_events": "yes"}, {}, "kv_events"),
    ],
)
def test_bad_kv_event_settings_are_refused_by_key(
    pool: dict[str, object], worker: dict[str, object], message: str
) -> None:
    entry = {"id": "p0", "address": "tcp://10.0.0.5:9000", **worker}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"pools": {"pd": {**pool, "workers": [entry]}}})


def test_the_zmq_source_refuses_an_endpoint_libzmq_rejects() -> None:
    spec = KVSourceSpec("w", "tcp://:abc", None, "")
    with pytest.raises(ConfigError, match="worker 'w': KV events endpoint"), zmq_source(spec):
        pass


# -- the router runs one subscriber per worker


async def test_each_worker_of_a_kv_pool_gets_a_subscriber_that_makes_its_state_exact() -> None:
    fleet, publishers = kv_fleet()
    factory = memory_sources(publishers)
    config = kv_config(fleet)
    async with open_router(
        config, backend_factory=fleet.backend_factory, kv_source_factory=factory
    ) as router:
        feeds = router.kv_feeds.pools["prefill"]
        assert set(feeds.subscribers) == {"prefill-0", "prefill-1"}
        assert "decode" not in router.kv_feeds.pools
        assert feeds.state("prefill-0") is FeedState.FALLBACK  # nothing published yet
        await generate(router, SYSTEM + " first question", 0)
        await trio.testing.wait_all_tasks_blocked()
        served = [w for w, e in fleet.engines.items() if e.statistics().prefill_requests]
        assert len(served) == 1
        assert feeds.state(served[0]) is FeedState.EXACT
        assert feeds.index.blocks(served[0]) == 6
        scrape = prometheus_client.generate_latest(router.metrics.registry).decode()
        live = {n: f for n, f in families(scrape).items() if n.startswith("epd_kv_")}
        doc = documented("KV event feeds")
        assert sorted(live) == sorted(doc)
        assert all(live[n].type == doc[n].type and live[n].labels == doc[n].labels for n in doc)
        assert f'epd_kv_index_state{{state="exact",worker="{served[0]}"}} 1.0' in scrape
        assert f'epd_kv_index_blocks{{worker="{served[0]}"}} 6.0' in scrape


async def test_workers_added_and_removed_at_run_time_start_and_stop_their_subscriber() -> None:
    fleet, publishers = kv_fleet()
    config = kv_config(fleet, absent=("prefill-1",))
    async with open_router(
        config, backend_factory=fleet.backend_factory, kv_source_factory=memory_sources(publishers)
    ) as router:
        feeds = router.kv_feeds.pools["prefill"]
        assert set(feeds.subscribers) == {"prefill-0"}
        await router.add_worker("prefill", WorkerEndpoint("prefill-1", "tcp://127.0.0.1:1"))
        assert set(feeds.subscribers) == {"prefill-0", "prefill-1"}
        await generate(router, SYSTEM, 0)
        await trio.testing.wait_all_tasks_blocked()
        holder = next(w for w in ("prefill-0", "prefill-1") if feeds.index.blocks(w))
        router.remove_worker(holder)
        await trio.testing.wait_all_tasks_blocked()
        assert holder not in feeds.subscribers
        assert feeds.index.blocks(holder) == 0  # purged when its subscriber stopped
        assert feeds.state(holder) is FeedState.FALLBACK


async def test_a_worker_without_an_endpoint_is_refused_before_it_joins() -> None:
    fleet, publishers = kv_fleet()
    config = kv_config(fleet, absent=("prefill-1",))
    async with open_router(
        config, backend_factory=fleet.backend_factory, kv_source_factory=memory_sources(publishers)
    ) as router:
        with pytest.raises(ConfigError, match="no KV events endpoint"):
            await router.add_worker("prefill", WorkerEndpoint("prefill-1", "unix:/p1.sock"))
        assert [m.worker_id for m in router.pools["prefill"].members] == ["prefill-0"]
        assert "prefill-1" not in router.backends


async def test_a_source_factory_that_fails_stops_the_start_with_its_error() -> None:
    fleet, _ = kv_fleet()

    def refusing(spec: KVSourceSpec):  # type: ignore[no-untyped-def]
        raise ConfigError(f"worker {spec.worker_id!r}: no pyzmq")

    with pytest.raises(ConfigError, match="no pyzmq"):
        async with open_router(
            kv_config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=refusing
        ):
            pass


# -- kv_aware on the live index


async def test_kv_aware_follows_a_prefix_the_router_never_sent_there() -> None:
    """An engine that prefilled a prompt outside the router is found through its events."""
    fleet, publishers = kv_fleet(prefill=3)
    async with open_router(
        kv_config(fleet),
        backend_factory=fleet.backend_factory,
        kv_source_factory=memory_sources(publishers),
    ) as router:
        for n, engine in enumerate(fleet.engines.values()):  # every feed gets to exact
            if engine.prefix_cache is not None:
                engine.prefix_cache.store(list(range(1000 * n, 1000 * n + 32)))
        # prefill-2's cache gets the system prompt directly (another router, a bypass).
        ids = prompt_token_ids(Prompt(text=SYSTEM), (), 256)
        cache = fleet.engines["prefill-2"].prefix_cache
        assert cache is not None
        cache.store(ids)
        await trio.testing.wait_all_tasks_blocked()
        feeds = router.kv_feeds.pools["prefill"]
        assert all(feeds.state(w) is FeedState.EXACT for w in feeds.subscribers)
        before = fleet.engines["prefill-2"].statistics().prefill_requests
        for n in range(3, 7):
            await generate(router, SYSTEM + f" question {n}", n)
        assert fleet.engines["prefill-2"].statistics().prefill_requests == before + 4
        assert router.pools["prefill"].policy.stats.exact == 4  # type: ignore[attr-defined]
        hits = cache.counters().hit_tokens
        assert hits >= 4 * 96


class FailingOnce:
    """A source whose first receive raises (a broken socket), then a good publisher's."""

    def __init__(self, publisher: MemoryKVEventPublisher) -> None:
        self.publisher = publisher
        self.failed = False

    async def receive(self, decode):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            await trio.lowlevel.checkpoint()
            raise OSError("socket broke")
        return await self.publisher.receive(decode)

    async def replay(self, start_seq: int, decode):  # type: ignore[no-untyped-def]
        return await self.publisher.replay(start_seq, decode)


async def test_a_failing_feed_is_replaced_after_a_backoff_and_never_stops_the_router(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet, publishers = kv_fleet(prefill=1)
    built: list[str] = []

    def flaky(spec: KVSourceSpec):  # type: ignore[no-untyped-def]
        built.append(spec.worker_id)
        source = publishers[spec.worker_id]
        return contextlib.nullcontext(FailingOnce(source) if len(built) == 1 else source)

    async with open_router(
        kv_config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=flaky
    ) as router:
        feeds = router.kv_feeds.pools["prefill"]
        await trio.testing.wait_all_tasks_blocked()
        assert feeds.failures == {"prefill-0": 1}
        assert feeds.state("prefill-0") is FeedState.FALLBACK
        await generate(router, SYSTEM, 0)  # requests go on meanwhile
        await trio.sleep(1.5)  # past the first backoff: a new source
        assert built == ["prefill-0", "prefill-0"]
        await trio.testing.wait_all_tasks_blocked()
        assert feeds.state("prefill-0") is FeedState.EXACT  # caught up by replay from 0
        assert feeds.index.blocks("prefill-0") == 6


async def test_the_router_follows_real_zmq_publishers_on_loopback() -> None:
    """The default source (pyzmq): simulated engines publishing on 127.0.0.1, explicit endpoints."""
    from epd_actors.simulator.kv_events import SimKVEventPublisher

    fleet = build_sim_fleet(
        {"prefill": 2, "decode": 1}, configs={"prefill": sim_config(prefix_cache_blocks=1024)}
    )
    with contextlib.ExitStack() as stack:
        endpoints = {}
        for worker_id in ("prefill-0", "prefill-1"):
            pub = stack.enter_context(SimKVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
            cache = fleet.engines[worker_id].prefix_cache
            assert cache is not None
            cache.sink = pub
            endpoints[worker_id] = (pub.endpoint, pub.replay_endpoint)
        prefill = PoolConfig(
            "prefill",
            tuple(
                WorkerEndpoint(w, "unix:/unused", "native", e, r) for w, (e, r) in endpoints.items()
            ),
            policy="kv_aware",
            kv_events=KVEventsSettings(enabled=True),
        )
        decode = PoolConfig("decode", (WorkerEndpoint("decode-0", "tcp://127.0.0.1:1"),))
        async with open_router(
            RouterConfig((prefill, decode)), backend_factory=fleet.backend_factory
        ) as router:
            feeds = router.kv_feeds.pools["prefill"]
            n = 0
            while not any(feeds.state(w) is FeedState.EXACT for w in endpoints) and n < 200:
                await generate(router, SYSTEM + f" q{n}", n)  # a SUB still connecting loses some
                await trio.sleep(0.02)
                n += 1
            holder = next(w for w in endpoints if feeds.state(w) is FeedState.EXACT)
            await generate(router, SYSTEM + " the real question", 1000)
            await trio.sleep(0.2)
            policy = router.pools["prefill"].policy
            assert policy.stats.exact >= 1  # type: ignore[attr-defined]
            assert feeds.index.blocks(holder) >= 6


async def test_feeds_run_for_a_pool_whose_policy_does_not_read_them() -> None:
    fleet, publishers = kv_fleet(prefill=1)
    async with open_router(
        kv_config(fleet, policy="cache_aware"),
        backend_factory=fleet.backend_factory,
        kv_source_factory=memory_sources(publishers),
    ) as router:
        await generate(router, SYSTEM, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert router.kv_feeds.pools["prefill"].index.blocks("prefill-0") == 6
