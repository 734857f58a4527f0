"""A job's result is undone once, by whichever of job and requester ends last, and never under
a requester that is still to take it -- whatever order the scheduler runs the two tasks in."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.core.actors.jobs import StageContext, StageOutput
from epd_actors.core.actors.prefill import PrefillActor
from epd_actors.protocol import Prompt, SamplingParams
from epd_actors.request import GenerationRequest
from epd_actors.simulator.config import SimConfig
from epd_actors.testing import SimFleet, build_sim_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.trio


def context(request_id: str) -> StageContext:
    request = GenerationRequest(
        Prompt(text="one two three four"),
        sampling=SamplingParams(max_tokens=2, temperature=0.0),
        request_id=request_id,
    )
    return StageContext(request, f"{request_id}.1")


@asynccontextmanager
async def running_prefill() -> AsyncIterator[tuple[SimFleet, PrefillActor]]:
    """A prefill actor serving in a nursery, over one simulated worker with no simulated time
    (a job ends as soon as its requester lets the scheduler run it)."""
    instant = SimConfig(prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)
    sim = build_sim_fleet({"prefill": 1, "decode": 1}, config=instant)
    actor = PrefillActor(sim.pools["prefill"])
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        yield sim, actor
        nursery.cancel_scope.cancel()


async def test_a_result_waiting_in_the_reply_channel_is_not_undone_under_its_requester() -> None:
    # The job ends -- every task blocked, its reply buffered -- before the
    # requester reads it; the handle must still be there for the requester.
    async with running_prefill() as (sim, actor):
        async with actor.submit(context("waits"), None) as (job, replies):
            await trio.testing.wait_all_tasks_blocked()
            assert job.finished_at is not None  # the job's task has ended
            assert sim.kv_handles_outstanding() == 1  # ... and left its handle alone
            event = await replies.receive()
            assert isinstance(event, StageOutput)
            assert event.kv_transfer_params is not None
            taken = job.hand_over()
        assert len(taken) == 1  # the requester holds the release now
        assert sim.kv_handles_outstanding() == 1
        await taken[0]()
        assert sim.kv_handles_outstanding() == 0


async def test_a_requester_that_leaves_an_ended_jobs_result_untaken_undoes_it_once() -> None:
    async with running_prefill() as (sim, actor):
        async with actor.submit(context("untaken"), None) as (job, _):
            await trio.testing.wait_all_tasks_blocked()
            assert job.finished_at is not None
            assert sim.kv_handles_outstanding() == 1
        assert sim.kv_handles_outstanding() == 0  # released as the requester left
        assert job.handed_over
        assert not job.compensations
        await trio.testing.wait_all_tasks_blocked()
        assert sim.total("kv_handles_released", "prefill") == 1


async def test_a_job_that_ends_after_its_requester_left_undoes_its_result_itself() -> None:
    async with running_prefill() as (sim, actor):
        async with actor.submit(context("left"), None) as (job, _):
            assert job.finished_at is None  # the job has not run yet
        # Leaving cancelled the job; had it produced a handle, its task released it.
        await trio.testing.wait_all_tasks_blocked()
        assert job.finished_at is not None
        assert sim.kv_handles_outstanding() == 0
