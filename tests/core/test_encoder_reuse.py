"""No media item encoded twice: the supervisor with encoder-output reuse, on the simulator.

The in-process simulated fleet (``build_sim_fleet``) shares one encoder-cache
store between its engines, like vLLM's shared-storage connector; a store of
small capacity stands for a worker that evicts entries.  The simulator's P and
PD are strict: a media item whose entry is missing is refused with
``missing_encoder_cache``, so a router that trusted a stale entry without
re-encoding would fail the request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.core.encoder_cache import EncoderCache, EncoderReuse
from epd_actors.core.router import open_router
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import ConfigError, RemoteWorkerError
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, Role, SamplingParams
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import (
    MemoryEncoderCacheStore,
    MemoryKVStore,
    SimStores,
)
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from epd_actors.request import GenerationEvent

EPD = {"encode": 1, "prefill": 1, "decode": 1}
EPD_PD = {"encode": 1, "pd": 1}
TTL = EncoderReuse(mode="ttl", ttl_s=60.0)


def image(tag: str) -> MediaItem:
    return MediaItem.from_bytes(f"image-{tag}".encode() * 16, "image/png")


def turn(*media: MediaItem, history: int = 0, request_id: str = "r") -> GenerationRequest:
    """A chat whose first user turn shows ``media``; ``history`` more turns after it."""
    messages = [ChatMessage("user", (*range(len(media)), "what is this?"))]
    for n in range(history):
        messages += [ChatMessage("assistant", (f"answer {n}",)), ChatMessage("user", ("more?",))]
    return GenerationRequest(
        Prompt(messages=tuple(messages)),
        media=media,
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
        request_id=request_id,
    )


def caches(reuse: EncoderReuse = TTL) -> dict[str, EncoderCache]:
    return {"encode": EncoderCache(reuse)}


def small_store(capacity: int) -> SimStores:
    """Stores whose encoder cache keeps ``capacity`` entries (LRU): a worker that evicts."""
    return SimStores(MemoryEncoderCacheStore(capacity), MemoryKVStore())


async def run_all(
    fleet: SimFleet,
    requests: Sequence[GenerationRequest],
    encoder_caches: dict[str, EncoderCache] | None,
) -> tuple[Supervisor, list[list[GenerationEvent]]]:
    supervisor = Supervisor(fleet.pools, encoder_caches=encoder_caches)
    results = []
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for request in requests:
            async with supervisor.generate(request) as events:
                results.append([event async for event in events])
        nursery.cancel_scope.cancel()
    return supervisor, results


def final(events: list[GenerationEvent]) -> DoneEvent | ErrorEvent:
    last = events[-1]
    assert isinstance(last, DoneEvent | ErrorEvent)
    return last


def text_of(events: list[GenerationEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, DeltaEvent))


def stats(cache: EncoderCache) -> tuple[int, int, int]:
    s = cache.statistics()
    return s.hits, s.media_bytes_reused, s.found_missing


# ---------------------------------------------------------------- reuse


@pytest.mark.parametrize("workers", [EPD, EPD_PD], ids=["E+P+D", "E+PD"])
async def test_a_two_turn_conversation_with_one_image_makes_one_encoder_call(
    workers: dict[str, int],
) -> None:
    fleet = build_sim_fleet(workers)
    memory = caches()
    picture = image("cat")
    _, (first, second) = await run_all(fleet, [turn(picture), turn(picture, history=1)], memory)
    assert isinstance(final(first), DoneEvent)
    assert isinstance(final(second), DoneEvent)
    assert fleet.total("encode_requests") == 1
    consumer = "prefill" if "prefill" in workers else "pd"
    assert fleet.total("ec_entries_read", consumer) == 2  # both turns found E's entry
    assert fleet.total("recomputed_items") == 0
    assert stats(memory["encode"]) == (1, len(picture.data), 0)
    # A turn whose items were all remembered runs no encode stage at all.
    assert "encode" in final(first).timings.stages
    assert "encode" not in final(second).timings.stages


async def test_the_same_request_gives_the_same_output_with_reuse_and_without() -> None:
    picture = image("dog")
    with_reuse = build_sim_fleet(EPD)
    _, (_, reused) = await run_all(with_reuse, [turn(picture), turn(picture)], caches())
    without = build_sim_fleet(EPD)
    _, (plain,) = await run_all(without, [turn(picture)], None)
    assert text_of(reused) == text_of(plain) != ""


async def test_with_reuse_off_every_turn_is_encoded() -> None:
    fleet = build_sim_fleet(EPD)
    memory = caches(EncoderReuse(mode="off"))
    picture = image("cat")
    _, results = await run_all(fleet, [turn(picture, history=n) for n in range(3)], memory)
    assert all(isinstance(final(events), DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 3
    assert stats(memory["encode"]) == (0, 0, 0)


async def test_without_a_memory_every_turn_is_encoded() -> None:
    fleet = build_sim_fleet(EPD)
    picture = image("cat")
    _, results = await run_all(fleet, [turn(picture), turn(picture, history=1)], None)
    assert all(isinstance(final(events), DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 2


async def test_only_the_items_not_remembered_are_encoded() -> None:
    fleet = build_sim_fleet(EPD)
    memory = caches()
    a, b = image("a"), image("b")
    _, results = await run_all(fleet, [turn(a), turn(a, b)], memory)
    assert all(isinstance(final(events), DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 2  # a once, b once
    assert stats(memory["encode"])[0] == 1


async def test_an_entry_past_its_ttl_is_encoded_again(autojump_clock: object) -> None:
    fleet = build_sim_fleet(EPD)
    memory = caches(EncoderReuse(mode="ttl", ttl_s=10.0))
    picture = image("cat")
    supervisor = Supervisor(fleet.pools, encoder_caches=memory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for pause in (0.0, 5.0, 11.0):
            await trio.sleep(pause)
            async with supervisor.generate(turn(picture)) as events:
                assert isinstance(final([e async for e in events]), DoneEvent)
        nursery.cancel_scope.cancel()
    # t=0 encodes, t~5 reuses, t~16 is past the TTL of the entry written at t~0.
    assert fleet.total("encode_requests") == 2
    assert memory["encode"].statistics().expired == 1


@pytest.mark.parametrize(("scope", "encodes"), [("worker", 2), ("shared", 1)])
async def test_the_worker_scope_forgets_an_entry_whose_producer_left(
    scope: str, encodes: int
) -> None:
    fleet = build_sim_fleet({"encode": 2, "prefill": 1, "decode": 1})
    memory = caches(EncoderReuse(mode="ttl", scope=scope))
    picture = image("cat")
    supervisor = Supervisor(fleet.pools, encoder_caches=memory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(turn(picture)) as events:
            first = final([e async for e in events])
        assert isinstance(first, DoneEvent)
        (producer,) = first.timings.workers["encode"]
        fleet.pools["encode"].drain(producer)
        async with supervisor.generate(turn(picture, history=1)) as events:
            assert isinstance(final([e async for e in events]), DoneEvent)
        nursery.cancel_scope.cancel()
    assert fleet.total("encode_requests") == encodes


# ---------------------------------------------------------------- the entry turned out gone


@pytest.mark.parametrize("workers", [EPD, EPD_PD], ids=["E+P+D", "E+PD"])
async def test_an_entry_the_worker_evicted_is_encoded_again_and_the_request_succeeds(
    workers: dict[str, int],
) -> None:
    fleet = build_sim_fleet(workers, stores=small_store(1))
    memory = caches()
    a, b = image("a"), image("b")
    # b's entry pushes a's out of the workers' cache; the router still trusts a's.
    supervisor, results = await run_all(fleet, [turn(a), turn(b), turn(a, history=1)], memory)
    assert all(isinstance(final(events), DoneEvent) for events in results), results[-1][-1]
    consumer = "prefill" if "prefill" in workers else "pd"
    calls = "prefill_requests" if consumer == "prefill" else "generate_requests"
    assert fleet.total("encode_requests") == 3  # a, b, and a again after the refusal
    assert fleet.total(calls, consumer) == 4  # the refused attempt, then once more
    assert stats(memory["encode"]) == (1, len(a.data), 1)
    assert supervisor.statistics().requests_failed == 0
    # The re-encoded entry is remembered again: the next turn needs no E.
    _, (again,) = await run_all(fleet, [turn(a, history=2)], memory)
    assert isinstance(final(again), DoneEvent)


async def test_exactly_the_missing_items_are_encoded_again() -> None:
    fleet = build_sim_fleet(EPD, stores=small_store(2))
    memory = caches()
    a, b, c = image("a"), image("b"), image("c")
    # After turn(a, b) the workers hold a and b (b most recent); c evicts a only.
    _, results = await run_all(fleet, [turn(a, b), turn(c), turn(a, b, history=1)], memory)
    assert all(isinstance(final(events), DoneEvent) for events in results)
    # a, b, c, then a again: not b, whose entry was still there.
    assert fleet.total("encode_requests") == 4
    assert memory["encode"].statistics().found_missing == 1
    assert memory["encode"].recall(b.content_hash, trio.current_time()) is not None


async def test_a_stage_that_refuses_again_after_the_re_encode_fails_the_request() -> None:
    fleet = build_sim_fleet(EPD)
    memory = caches()
    picture = image("cat")
    supervisor = Supervisor(fleet.pools, encoder_caches=memory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(turn(picture)) as events:
            assert isinstance(final([e async for e in events]), DoneEvent)
        # The prefill worker comes back with a storage of its own: it never
        # finds what the encoders write, however often they do.
        pool = fleet.pools["prefill"]
        pool.remove("prefill-0")
        stranger = SimEngine(
            Role.PREFILL,
            worker_id="prefill-9",
            config=sim_config(),
            ec_store=MemoryEncoderCacheStore(),
            kv_store=fleet.stores.kv,
        )
        pool.add(InProcessBackend("prefill-9", stranger, stage="prefill"))
        async with supervisor.generate(turn(picture, history=1)) as events:
            failed = final([e async for e in events])
        nursery.cancel_scope.cancel()
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert failed.error.code == "missing_encoder_cache"
    assert stranger.statistics().prefill_requests == 2  # retried once, not more
    assert fleet.total("encode_requests", "encode") == 2  # the first turn and the re-encode


async def test_a_refusal_without_remembered_items_is_the_request_s() -> None:
    # P+D with strict P and no encoders: nothing was remembered, nothing is redone.
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    _, (events,) = await run_all(fleet, [turn(image("x"))], None)
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert fleet.total("prefill_requests") == 1


async def test_other_failures_are_not_redone() -> None:
    fleet = build_sim_fleet(EPD)
    memory = caches()
    picture = image("cat")
    supervisor = Supervisor(fleet.pools, encoder_caches=memory)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(turn(picture)) as events:
            assert isinstance(final([e async for e in events]), DoneEvent)
        fleet.engines["decode-0"].config = sim_config(generate_error_rate=1.0)
        async with supervisor.generate(turn(picture, history=1)) as events:
            failed = final([e async for e in events])
        nursery.cancel_scope.cancel()
    assert isinstance(failed, ErrorEvent)
    assert fleet.total("encode_requests") == 1
    assert memory["encode"].statistics().found_missing == 0


# ---------------------------------------------------------------- configuration and metrics


def test_only_a_stage_that_produces_encoder_outputs_takes_a_memory() -> None:
    fleet = build_sim_fleet(EPD)
    with pytest.raises(ConfigError, match=r"pools\.prefill\.reuse"):
        Supervisor(fleet.pools, encoder_caches={"prefill": EncoderCache(TTL)})
    with pytest.raises(ConfigError, match="no such pool"):
        Supervisor(fleet.pools, encoder_caches={"encode@other": EncoderCache(TTL)})


async def test_the_router_counts_skipped_calls_reused_bytes_and_missing_entries() -> None:
    fleet = build_sim_fleet(EPD, stores=small_store(1))
    config = fleet.router_config()
    pools = tuple(
        replace(pool, encoder_reuse=TTL) if pool.stage == "encode" else pool
        for pool in config.pools
    )
    config = replace(config, pools=pools)
    a, b = image("a"), image("b")
    async with open_router(config, backend_factory=fleet.backend_factory) as router:
        for request in (turn(a), turn(a, history=1), turn(b), turn(a, history=2)):
            async with router.generate(request) as events:
                assert isinstance(final([e async for e in events]), DoneEvent)
        text = router.metrics.render().decode()
    # Turn 2 reused a; turn 4 trusted a, found it evicted by b, and encoded it again.
    assert 'epd_encoder_calls_skipped_total{pool="encode"} 2.0' in text
    assert f'epd_encoder_media_bytes_reused_total{{pool="encode"}} {2.0 * len(a.data)}' in text
    assert 'epd_encoder_cache_entries_missing_total{pool="encode"} 1.0' in text
    assert 'epd_encoder_cache_entries{pool="encode"} 2.0' in text
    assert fleet.total("encode_requests") == 3
