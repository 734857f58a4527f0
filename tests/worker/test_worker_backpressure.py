"""A full worker is back-pressure, not a failure.

Native workers are real ``WorkerServer``s over memory streams (``memory_fleet``),
on ``autojump_clock``.  A worker is made full the way it happens in a
deployment: another router (another client of the same server) holds its only
slot (``max_concurrency=1, max_queued=0``), so it refuses this router's jobs
with ``overloaded``.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from epd_actors.core.health import is_backpressure
from epd_actors.core.retry import RetryPolicy, counts_against_worker
from epd_actors.core.router import open_router
from epd_actors.errors import (
    EpdError,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    WorkerDisconnected,
)
from epd_actors.openai.errors import error_response
from epd_actors.protocol import ErrorCode, GenerateRequest, Prompt, Role
from epd_actors.request import DoneEvent, ErrorEvent
from tests.fakes import ScriptedEngine
from tests.memory_fleet import MemoryFleet, final_event, worker

GUARD_S = 600.0  # virtual seconds


def remote(code: str) -> RemoteWorkerError:
    return RemoteWorkerError(code, "x", retryable=True, worker_id="w", stage="pd", request_id="r")


@pytest.mark.parametrize(
    ("error", "backpressure"),
    [
        (remote(ErrorCode.OVERLOADED), True),  # also vLLM's HTTP 429 and 503
        (remote(ErrorCode.DRAINING), True),
        (remote(ErrorCode.ENGINE_ERROR), False),
        (WorkerDisconnected("gone"), False),
    ],
    ids=["overloaded", "draining", "engine-error", "disconnected"],
)
def test_only_real_faults_count_against_a_worker(error: EpdError, backpressure: bool) -> None:
    assert is_backpressure(error) is backpressure
    assert counts_against_worker(error) is not backpressure


def gated_pd() -> ScriptedEngine:
    return ScriptedEngine(role=Role.PD, gate=trio.Event())


async def fill(fleet: MemoryFleet, worker_id: str, stack: AsyncExitStack) -> None:
    """Take ``worker_id``'s only slot from another router; held until ``stack`` closes."""
    other = fleet.client(worker_id, client_id="another-router")
    await fleet.nursery.start(other.run)
    await other.wait_ready()
    await stack.enter_async_context(
        other.open_stream(GenerateRequest(f"other-{worker_id}", Prompt(text="x")))
    )
    await trio.testing.wait_all_tasks_blocked()


async def test_a_full_worker_passes_the_job_on_without_spending_a_retry_or_its_health(
    autojump_clock: object,
) -> None:
    full, free = gated_pd(), ScriptedEngine(role=Role.PD)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            servers = {
                "pd-a": worker(full, "pd-a", max_concurrency=1, max_queued=0),
                "pd-b": worker(free, "pd-b"),
            }
            fleet = MemoryFleet(nursery, servers)
            await fill(fleet, "pd-a", stack)
            config = fleet.config("pd", retries=RetryPolicy(max_attempts=1))
            async with open_router(config, backend_factory=fleet.backend) as router:
                await router.wait_ready()
                await trio.testing.wait_all_tasks_blocked()
                # Round robin asks pd-a first every time (its last pick was pd-b):
                # eight refusals, more than the breaker's failure threshold (3).
                for n in range(8):
                    final = await final_event(router, n)
                    assert isinstance(final, DoneEvent), final
                pd_a = router.statistics().pools["pd"][0]
                assert (pd_a.worker_id, pd_a.breaker, pd_a.usable) == ("pd-a", "closed", True)
                assert router.statistics().actors["pd"].retries_total == 0
                assert len(free.started) == 8
                assert servers["pd-a"].statistics().refused_total == 8
                full.gate.set()  # type: ignore[union-attr]
                await stack.aclose()
            nursery.cancel_scope.cancel(reason="test finished")


async def test_a_pool_of_full_workers_answers_429_with_retry_after(autojump_clock: object) -> None:
    engines = {"pd-a": gated_pd(), "pd-b": gated_pd()}
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            servers = {
                worker_id: worker(engine, worker_id, max_concurrency=1, max_queued=0)
                for worker_id, engine in engines.items()
            }
            fleet = MemoryFleet(nursery, servers)
            for worker_id in servers:
                await fill(fleet, worker_id, stack)
            async with open_router(fleet.config("pd"), backend_factory=fleet.backend) as router:
                await router.wait_ready()
                await trio.testing.wait_all_tasks_blocked()
                start = trio.current_time()
                final = await final_event(router, 0)
                assert trio.current_time() == start  # no backoff between the two workers
                assert isinstance(final, ErrorEvent)
                assert type(final.error) is Overloaded
                assert final.error.retry_after == 1.0
                answer = error_response(final.error)
                assert answer is not None
                assert (answer.status, answer.headers) == (429, (("retry-after", "1"),))
                # Each worker was asked once; both are still in service.
                assert [s.statistics().refused_total for s in servers.values()] == [1, 1]
                stats = router.statistics().pools["pd"]
                assert [(m.breaker, m.usable) for m in stats] == [("closed", True)] * 2
                final = await final_event(router, 1)
                assert isinstance(final, ErrorEvent)
                assert not isinstance(final.error, NoHealthyWorker)
                for engine in engines.values():
                    engine.gate.set()  # type: ignore[union-attr]
                await stack.aclose()
            nursery.cancel_scope.cancel(reason="test finished")


@pytest.mark.parametrize(
    ("pool_limit", "announced", "limit"),
    [(256, 2, 2), (1, 2, 1)],
    ids=["worker-announces-less", "pool-allows-less"],
)
async def test_a_worker_gets_no_more_jobs_than_it_runs_at_once(
    autojump_clock: object, pool_limit: int, announced: int, limit: int
) -> None:
    engine = gated_pd()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            servers = {"pd-0": worker(engine, "pd-0", max_concurrency=announced)}
            fleet = MemoryFleet(nursery, servers)
            config = fleet.config("pd", max_in_flight_per_worker=pool_limit)
            async with open_router(config, backend_factory=fleet.backend) as router:
                await router.wait_ready()
                finals: list[object] = []

                async def run(n: int) -> None:
                    finals.append(await final_event(router, n))

                async with trio.open_nursery() as requests:
                    for n in range(3):
                        requests.start_soon(run, n)
                    await trio.testing.wait_all_tasks_blocked()
                    member = router.statistics().pools["pd"][0]
                    assert len(engine.started) == member.in_flight == limit  # the rest wait here
                    assert member.limit == limit
                    engine.gate.set()  # type: ignore[union-attr]
                assert all(isinstance(final, DoneEvent) for final in finals)
            nursery.cancel_scope.cancel(reason="test finished")
