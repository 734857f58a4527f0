"""Conditional disaggregation: P is skipped when the decoder would prefill the prompt cheaply."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import prometheus_client
import pytest
import trio
import trio.testing

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.kv_settings import KVEventsSettings
from epd_actors.errors import ConfigError
from epd_actors.kv_events import FeedState
from epd_actors.program.config_file import parse_config
from epd_actors.request import DoneEvent
from epd_actors.simulator.kv_memory import MemoryKVEventPublisher
from epd_actors.simulator.prefix_cache import prompt_token_ids
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from tests.metric_families import documented, families

if TYPE_CHECKING:
    from epd_actors.core.kv_feeds import KVSourceSpec

LONG = " ".join(f"context{i}" for i in range(200))  # 200 sim tokens


def fleet_with_local_decoders() -> tuple[SimFleet, dict[str, MemoryKVEventPublisher]]:
    decoders = sim_config(local_prefill=True, prefix_cache_blocks=1024)
    fleet = build_sim_fleet({"prefill": 1, "decode": 2}, configs={"decode": decoders})
    publishers = {}
    for worker_id, engine in fleet.engines.items():
        if engine.prefix_cache is not None:
            publishers[worker_id] = MemoryKVEventPublisher()
            engine.prefix_cache.sink = publishers[worker_id]
    assert set(publishers) == {"decode-0", "decode-1"}
    return fleet, publishers


def config(fleet: SimFleet, *, threshold: int = 64, decode_policy: str = "kv_aware"):  # type: ignore[no-untyped-def]
    def endpoints(stage: str) -> tuple[WorkerEndpoint, ...]:
        members = fleet.pools[stage].members
        return tuple(WorkerEndpoint(m.worker_id, "tcp://127.0.0.1:1") for m in members)

    prefill = PoolConfig("prefill", endpoints("prefill"), local_prefill_below_tokens=threshold)
    decode = PoolConfig(
        "decode",
        endpoints("decode"),
        policy=decode_policy,
        kv_events=KVEventsSettings(enabled=True, port=5557),
    )
    return RouterConfig((prefill, decode))


def sources(publishers: dict[str, MemoryKVEventPublisher]):  # type: ignore[no-untyped-def]
    def factory(spec: KVSourceSpec):  # type: ignore[no-untyped-def]
        return contextlib.nullcontext(publishers[spec.worker_id])

    return factory


async def generate(router, text: str, n: int) -> None:  # type: ignore[no-untyped-def]
    request = GenerationRequest(
        Prompt(text=text), sampling=SamplingParams(max_tokens=2), request_id=f"r{n}"
    )
    async with router.generate(request) as events:
        final = [e async for e in events][-1]
    assert isinstance(final, DoneEvent), final


async def test_short_prompts_skip_p_and_long_ones_are_disaggregated() -> None:
    fleet, publishers = fleet_with_local_decoders()
    async with open_router(
        config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=sources(publishers)
    ) as router:
        await generate(router, "a short question", 0)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 0
        await generate(router, LONG, 1)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 1
        decoded = sum(
            fleet.engines[w].statistics().generate_requests for w in ("decode-0", "decode-1")
        )
        assert decoded == 2
        scrape = prometheus_client.generate_latest(router.metrics.registry).decode()
        assert 'epd_prefill_plans_total{plan="local",pool="prefill"} 1.0' in scrape
        assert 'epd_prefill_plans_total{plan="disaggregated",pool="prefill"} 1.0' in scrape
        live = {n: f for n, f in families(scrape).items() if n.startswith("epd_prefill_plans")}
        doc = documented("Conditional disaggregation")
        assert sorted(live) == sorted(doc)
        assert all(live[n].type == doc[n].type and live[n].labels == doc[n].labels for n in doc)


async def test_a_long_prompt_a_decoder_caches_is_prefilled_there() -> None:
    fleet, publishers = fleet_with_local_decoders()
    async with open_router(
        config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=sources(publishers)
    ) as router:
        for n, worker_id in enumerate(("decode-0", "decode-1")):  # both feeds exact
            cache = fleet.engines[worker_id].prefix_cache
            assert cache is not None
            cache.store(list(range(1000 * n, 1000 * n + 32)))
        cache = fleet.engines["decode-1"].prefix_cache
        assert cache is not None
        cache.store(prompt_token_ids(Prompt(text=LONG), (), 256))  # 192 of 200 tokens in blocks
        await trio.testing.wait_all_tasks_blocked()
        feeds = router.kv_feeds.pools["decode"]
        assert feeds.state("decode-1") is FeedState.EXACT
        await generate(router, LONG + " and a follow-up", 0)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 0
        assert fleet.engines["decode-1"].statistics().generate_requests == 1
        assert cache.counters().hit_tokens == 192


async def test_threshold_zero_disaggregates_every_request() -> None:
    """Threshold 0 is off: every request is disaggregated, whatever its length."""
    fleet, publishers = fleet_with_local_decoders()
    async with open_router(
        config(fleet, threshold=0),
        backend_factory=fleet.backend_factory,
        kv_source_factory=sources(publishers),
    ) as router:
        await generate(router, "short", 0)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 1


async def test_no_usable_decoder_means_no_local_prefill() -> None:
    fleet, publishers = fleet_with_local_decoders()
    async with open_router(
        config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=sources(publishers)
    ) as router:
        rule = router.supervisor.actors["prefill"].local_prefill  # type: ignore[attr-defined]
        for worker_id in ("decode-0", "decode-1"):
            router.drain_worker(worker_id)
        from epd_actors.core.actors.jobs import StageContext

        context = StageContext(GenerationRequest(Prompt(text="short")), "w")
        assert not rule.prefills_locally(context)
        assert rule.disaggregated == 1


async def test_the_rule_needs_a_hand_off_stage_and_an_estimating_consumer() -> None:
    fleet, publishers = fleet_with_local_decoders()
    with pytest.raises(ConfigError, match="use kv_aware there"):
        async with open_router(
            config(fleet, decode_policy="least_in_flight"),
            backend_factory=fleet.backend_factory,
            kv_source_factory=sources(publishers),
        ):
            pass
    wrong = RouterConfig(
        (
            PoolConfig("prefill", (WorkerEndpoint("prefill-0", "tcp://127.0.0.1:1"),)),
            PoolConfig(
                "decode",
                (WorkerEndpoint("decode-0", "tcp://127.0.0.1:1"),),
                local_prefill_below_tokens=10,
            ),
        )
    )
    with pytest.raises(ConfigError, match="only a stage that hands its KV"):
        async with open_router(wrong, backend_factory=fleet.backend_factory):
            pass


def test_the_file_reads_the_threshold_and_refuses_a_negative_one() -> None:
    pools = {
        "prefill": {
            "local_prefill_below_tokens": 256,
            "workers": [{"id": "p0", "address": "tcp://h:1"}],
        },
        "decode": {"policy": "kv_aware", "workers": [{"id": "d0", "address": "tcp://h:2"}]},
    }
    file = parse_config({"pools": pools})
    assert file.router.pool("prefill").local_prefill_below_tokens == 256  # type: ignore[union-attr]
    pools["prefill"]["local_prefill_below_tokens"] = -1
    with pytest.raises(ConfigError, match="local_prefill_below_tokens"):
        parse_config({"pools": pools})


async def test_a_decoder_caches_the_blocks_it_received_so_the_next_turn_stays_local() -> None:
    """Turn 1 is disaggregated; D keeps its blocks; turn 2 (a short addition) skips P."""
    fleet, publishers = fleet_with_local_decoders()
    async with open_router(
        config(fleet), backend_factory=fleet.backend_factory, kv_source_factory=sources(publishers)
    ) as router:
        for n, worker_id in enumerate(("decode-0", "decode-1")):  # both feeds exact
            cache = fleet.engines[worker_id].prefix_cache
            assert cache is not None
            cache.store(list(range(1000 * n, 1000 * n + 32)))
        await generate(router, LONG, 0)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 1
        await trio.testing.wait_all_tasks_blocked()
        await generate(router, LONG + " one more short question", 1)
        assert fleet.engines["prefill-0"].statistics().prefill_requests == 1  # no P this time
        hits = [
            fleet.engines[w].prefix_cache.counters().hit_tokens  # type: ignore[union-attr]
            for w in ("decode-0", "decode-1")
        ]
        assert sorted(hits) == [0, 192]


def test_check_config_refuses_a_consumer_that_cannot_estimate() -> None:
    from epd_actors.program.check_config import check_topology

    pools = {
        "prefill": {
            "local_prefill_below_tokens": 256,
            "workers": [{"id": "p0", "address": "tcp://h:1"}],
        },
        "decode": {"workers": [{"id": "d0", "address": "tcp://h:2"}]},
    }
    with pytest.raises(ConfigError, match="use kv_aware there"):
        check_topology(parse_config({"pools": pools}))
    pools["decode"]["policy"] = "kv_aware"
    check_topology(parse_config({"pools": pools}))
