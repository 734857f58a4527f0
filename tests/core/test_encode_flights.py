"""No concurrent double encode: a request waits for another's encode of the same item.

The in-process simulated fleet with encoder-output reuse on; requests run
concurrently under the autojump clock.  A subclass of the simulator's engine
fails, or hangs in, its first encode, to inject a leader that does not deliver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.core.config import Deadlines
from epd_actors.core.encode_flights import EncodeFlights
from epd_actors.core.encoder_cache import EncoderCache, EncoderReuse
from epd_actors.core.pool import WorkerPool
from epd_actors.core.retry import RetryPolicy
from epd_actors.core.routing import make_policy
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import EngineError
from epd_actors.protocol import ErrorCode, Role
from epd_actors.request import DoneEvent, ErrorEvent
from epd_actors.simulator.engine import SimEngine
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from tests.core.test_encoder_reuse import EPD, EPD_PD, TTL, image, turn

if TYPE_CHECKING:
    from epd_actors.protocol import EncodeRequest, StageResult
    from epd_actors.request import GenerationEvent, GenerationRequest

SLOW_E = sim_config(encode_item_s=1.0)


class FirstEncodeGoesWrong(SimEngine):
    """Its first encode fails after ``delay`` (``hang``: never answers); later ones work."""

    mode = "fail"
    delay = 0.5
    first_done = False

    async def encode(self, request: EncodeRequest) -> StageResult:
        if not self.first_done:
            self.first_done = True
            if self.mode == "hang":
                await trio.sleep_forever()
            await trio.sleep(self.delay)
            raise EngineError(ErrorCode.INVALID_REQUEST, "injected failure", retryable=False)
        return await super().encode(request)


def with_encoder(fleet: SimFleet, mode: str) -> dict[str, WorkerPool]:
    """``fleet``'s pools, its one encoder replaced by a :class:`FirstEncodeGoesWrong`."""
    engine = FirstEncodeGoesWrong(
        Role.ENCODE,
        worker_id="encode-x",
        config=SLOW_E,
        ec_store=fleet.stores.ec,
        kv_store=fleet.stores.kv,
    )
    engine.mode = mode
    pool = WorkerPool("encode", make_policy("round_robin"), max_in_flight_per_worker=8)
    pool.add(InProcessBackend("encode-x", engine, stage="encode"))
    return {**fleet.pools, "encode": pool}


async def run_together(
    supervisor: Supervisor, requests: list[tuple[float, GenerationRequest]]
) -> tuple[list[list[GenerationEvent]], list[str]]:
    """Start each request after its delay; their events, and the order they ended in."""
    results: list[list[GenerationEvent]] = [[] for _ in requests]
    ended: list[str] = []

    async def one(slot: int, delay: float, request: GenerationRequest) -> None:
        await trio.sleep(delay)
        async with supervisor.generate(request) as events:
            results[slot] = [event async for event in events]
        ended.append(request.request_id)

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with trio.open_nursery() as clients:
            for slot, (delay, request) in enumerate(requests):
                clients.start_soon(one, slot, delay, request)
        nursery.cancel_scope.cancel()
    return results, ended


def flights_of(supervisor: Supervisor) -> EncodeFlights:
    flights = getattr(supervisor.actors["encode"], "flights", None)
    assert isinstance(flights, EncodeFlights)
    return flights


@pytest.mark.parametrize("workers", [EPD, EPD_PD], ids=["E+P+D", "E+PD"])
async def test_two_requests_in_flight_for_one_unseen_item_encode_it_once(
    workers: dict[str, int],
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(workers, configs={"encode": SLOW_E})
    memory = EncoderCache(TTL)
    supervisor = Supervisor(fleet.pools, encoder_caches={"encode": memory})
    picture = image("cat")
    requests = [(0.0, turn(picture, request_id="a")), (0.3, turn(picture, request_id="b"))]
    results, _ = await run_together(supervisor, requests)
    assert all(isinstance(events[-1], DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 1
    assert memory.statistics().hits == 1  # the waiter read the first one's entry
    flights = flights_of(supervisor)
    assert flights.statistics().joins == 1
    assert len(flights) == 0  # every claim ended


async def test_with_reuse_off_concurrent_requests_encode_each(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD, configs={"encode": SLOW_E})
    supervisor = Supervisor(
        fleet.pools, encoder_caches={"encode": EncoderCache(EncoderReuse(mode="off"))}
    )
    picture = image("cat")
    requests = [(0.0, turn(picture, request_id="a")), (0.3, turn(picture, request_id="b"))]
    results, _ = await run_together(supervisor, requests)
    assert all(isinstance(events[-1], DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 2


async def test_a_waiter_encodes_its_own_items_while_it_waits(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD, configs={"encode": SLOW_E})
    supervisor = Supervisor(fleet.pools, encoder_caches={"encode": EncoderCache(TTL)})
    shared, own = image("shared"), image("own")
    requests = [
        (0.0, turn(shared, request_id="a")),
        (0.3, turn(shared, own, request_id="b")),
        (0.4, turn(own, shared, request_id="c")),  # waits for both
    ]
    results, _ = await run_together(supervisor, requests)
    assert all(isinstance(events[-1], DoneEvent) for events in results)
    assert fleet.total("encode_requests") == 2  # each item once
    assert flights_of(supervisor).statistics().joins == 3


async def test_when_the_first_encode_fails_the_waiter_encodes_the_item_itself(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD)
    memory = EncoderCache(TTL)
    supervisor = Supervisor(with_encoder(fleet, "fail"), encoder_caches={"encode": memory})
    picture = image("cat")
    requests = [(0.0, turn(picture, request_id="a")), (0.1, turn(picture, request_id="b"))]
    (first, second), _ = await run_together(supervisor, requests)
    assert isinstance(first[-1], ErrorEvent)
    assert isinstance(second[-1], DoneEvent)
    assert memory.statistics().hits == 0
    assert flights_of(supervisor).statistics().joins == 1


async def test_when_the_first_request_is_cancelled_the_waiter_encodes_the_item_itself(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD, configs={"encode": SLOW_E})
    supervisor = Supervisor(fleet.pools, encoder_caches={"encode": EncoderCache(TTL)})
    picture = image("cat")
    outcome: list[GenerationEvent] = []

    async def leaves_early(scope: trio.CancelScope) -> None:
        with scope:
            async with supervisor.generate(turn(picture, request_id="a")) as events:
                async for _ in events:
                    pass

    async def waiter() -> None:
        await trio.sleep(0.1)
        async with supervisor.generate(turn(picture, request_id="b")) as events:
            outcome.extend([event async for event in events])

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        scope = trio.CancelScope()
        async with trio.open_nursery() as clients:
            clients.start_soon(leaves_early, scope)
            clients.start_soon(waiter)
            await trio.sleep(0.5)  # both are in E: the first encoding, the second waiting
            scope.cancel()
        nursery.cancel_scope.cancel()
    assert isinstance(outcome[-1], DoneEvent)
    assert fleet.total("encode_requests") == 2
    assert fleet.total("ec_entries_written") == 1  # the cancelled encode wrote nothing
    assert flights_of(supervisor).statistics().joins == 1


async def test_a_cancelled_waiter_leaves_the_first_encode_alone(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD, configs={"encode": SLOW_E})
    supervisor = Supervisor(fleet.pools, encoder_caches={"encode": EncoderCache(TTL)})
    picture = image("cat")
    outcome: list[GenerationEvent] = []

    async def first() -> None:
        async with supervisor.generate(turn(picture, request_id="a")) as events:
            outcome.extend([event async for event in events])

    async def leaves_while_waiting(scope: trio.CancelScope) -> None:
        await trio.sleep(0.1)
        with scope:
            async with supervisor.generate(turn(picture, request_id="b")) as events:
                async for _ in events:
                    pass

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        scope = trio.CancelScope()
        async with trio.open_nursery() as clients:
            clients.start_soon(first)
            clients.start_soon(leaves_while_waiting, scope)
            await trio.sleep(0.5)
            scope.cancel()
        nursery.cancel_scope.cancel()
    assert isinstance(outcome[-1], DoneEvent)
    assert fleet.total("encode_requests") == 1
    assert len(flights_of(supervisor)) == 0


async def test_a_waiter_stops_waiting_at_the_encode_timeout(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD)
    supervisor = Supervisor(
        with_encoder(fleet, "hang"),
        encoder_caches={"encode": EncoderCache(TTL)},
        deadlines=Deadlines(encode_timeout_s=2.0),
        # The first request's retry comes long after the waiter's bound has passed.
        retry=RetryPolicy(backoff_start_s=30.0, backoff_max_s=30.0, jitter=0.0),
    )
    picture = image("cat")
    requests = [(0.0, turn(picture, request_id="a")), (1.0, turn(picture, request_id="b"))]
    results, ended = await run_together(supervisor, requests)
    assert isinstance(results[1][-1], DoneEvent)
    assert ended == ["b", "a"]  # the waiter did not wait for the first one's retry
    assert flights_of(supervisor).statistics().expired == 1


async def test_a_wait_returns_false_at_its_deadline_and_true_once_released(
    autojump_clock: object,
) -> None:
    flights = EncodeFlights()
    event = flights.claim("k")
    assert event is not None
    assert flights.claim("k") is None
    assert not await flights.wait([event], trio.current_time() + 1.0)
    flights.release("k", event)
    assert await flights.wait([event], trio.current_time() + 1.0)
    assert flights.in_flight("k") is None
    assert flights.statistics().expired == 1
