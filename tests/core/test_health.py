"""Circuit breakers: the pure state machine, and how pools and actors feed it."""

from __future__ import annotations

import pytest
import trio

from epd_actors.core.health import BreakerState, CircuitBreaker, HealthPolicy
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import ConfigError
from epd_actors.protocol import Prompt, SamplingParams
from epd_actors.request import DoneEvent, GenerationRequest
from epd_actors.testing import build_sim_fleet, sim_config

POLICY = HealthPolicy(failure_threshold=2, success_threshold=2, open_cooldown_s=10.0)


def test_breaker_walk_through() -> None:
    breaker = CircuitBreaker(POLICY)
    assert breaker.allows(0.0)
    breaker.record_failure(1.0)
    assert breaker.state == BreakerState.CLOSED
    breaker.record_success()  # a success resets the consecutive count
    breaker.record_failure(2.0)
    assert breaker.state == BreakerState.CLOSED
    breaker.record_failure(3.0)
    assert breaker.state == BreakerState.OPEN
    assert breaker.trips == 1
    assert not breaker.allows(12.9)
    assert breaker.allows(13.0)
    breaker.on_dispatch(13.0)
    assert breaker.state == BreakerState.HALF_OPEN
    assert not breaker.allows(13.0)  # one probe at a time
    breaker.record_success()
    assert breaker.state == BreakerState.HALF_OPEN
    assert breaker.allows(13.5)
    breaker.on_dispatch(13.5)
    breaker.record_success()
    assert breaker.state == BreakerState.CLOSED


def test_failed_probe_reopens_for_a_full_cooldown() -> None:
    breaker = CircuitBreaker(POLICY)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    breaker.on_dispatch(10.0)
    breaker.record_failure(11.0)
    assert breaker.state == BreakerState.OPEN
    assert not breaker.allows(20.9)
    assert breaker.allows(21.0)
    assert breaker.trips == 2


def test_a_probe_without_verdict_frees_the_probe_slot() -> None:
    breaker = CircuitBreaker(POLICY)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    breaker.on_dispatch(10.0)
    assert not breaker.allows(10.0)
    breaker.release_probe()
    assert breaker.allows(10.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"failure_threshold": 0}, {"success_threshold": 0}, {"open_cooldown_s": 0.0}],
    ids=["failures", "successes", "cooldown"],
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        HealthPolicy(**kwargs)  # type: ignore[arg-type]


def text(n: int) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"q {n}"), sampling=SamplingParams(max_tokens=2), request_id=f"t{n}"
    )


async def test_a_failing_worker_is_taken_out_and_probed_back(autojump_clock: object) -> None:
    fleet = build_sim_fleet({"prefill": 2, "decode": 1})
    for pool in fleet.pools.values():
        pool.health = POLICY
        for member in pool.members:
            member.breaker = CircuitBreaker(POLICY)
    bad = fleet.engines["prefill-0"]
    bad.config = sim_config(prefill_error_rate=1.0)
    supervisor = Supervisor(fleet.pools)
    pool = fleet.pools["prefill"]
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for n in range(6):
            async with supervisor.generate(text(n)) as events:
                assert isinstance([e async for e in events][-1], DoneEvent)
        breaker = pool.get("prefill-0").breaker  # type: ignore[union-attr]
        assert breaker.state == BreakerState.OPEN
        failures_before = bad.statistics().errors_injected
        assert failures_before == 2
        # While open, no request reaches the bad worker.
        for n in range(6, 10):
            async with supervisor.generate(text(n)) as events:
                assert isinstance([e async for e in events][-1], DoneEvent)
        assert bad.statistics().errors_injected == failures_before
        # The worker recovers; after the cooldown a probe goes through and it rejoins.
        bad.config = sim_config()
        await trio.sleep(10.0)
        for n in range(10, 20):
            async with supervisor.generate(text(n)) as events:
                assert isinstance([e async for e in events][-1], DoneEvent)
        assert breaker.state == BreakerState.CLOSED
        assert bad.statistics().prefill_requests > failures_before
        nursery.cancel_scope.cancel()


async def test_client_errors_never_count_against_a_worker() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    from epd_actors.protocol import ChatMessage, MediaItem

    supervisor = Supervisor(fleet.pools)
    image = MediaItem.from_bytes(b"img", "image/png")
    request = GenerationRequest(
        Prompt(messages=(ChatMessage("user", ("look", 0)),)), media=(image,)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for _ in range(5):  # strict P refuses the unencoded image: not the worker's fault
            async with supervisor.generate(request) as events:
                [e async for e in events]
        nursery.cancel_scope.cancel()
    assert fleet.pools["prefill"].get("prefill-0").breaker.state == BreakerState.CLOSED  # type: ignore[union-attr]


async def test_token_timeouts_count_against_the_worker(autojump_clock: object) -> None:
    from epd_actors.core.config import Deadlines

    fleet = build_sim_fleet({"prefill": 1, "decode": 2})
    for pool in fleet.pools.values():
        pool.health = POLICY
        for member in pool.members:
            member.breaker = CircuitBreaker(POLICY)
    fleet.engines["decode-0"].config = sim_config(stall_s=100.0)
    supervisor = Supervisor(fleet.pools, deadlines=Deadlines(first_token_timeout_s=1.0))
    breaker = fleet.pools["decode"].get("decode-0").breaker  # type: ignore[union-attr]
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for n in range(4):
            async with supervisor.generate(text(n)) as events:
                [e async for e in events]
        nursery.cancel_scope.cancel()
    # Round robin sent two requests to the stalled decoder; both timed out.
    assert breaker.state == BreakerState.OPEN
    assert fleet.engines["decode-0"].statistics().aborts == 2
