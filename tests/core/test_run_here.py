"""``submit(run_here=True)``: a job that would not wait runs in its requester's task.

It must keep every promise a job of the actor's own task keeps: it holds a job
slot, the actor's stop cancels it, a bug in it crashes (and so restarts) the
actor (the ``prefill`` case of ``test_supervisor.py``'s crashed-actor test), and
a result its requester does not take is undone once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

import pytest
import trio
import trio.testing

from epd_actors.core.actors.decode import DecodeActor
from epd_actors.core.actors.jobs import Job, StageOutput
from epd_actors.core.actors.prefill import PrefillActor
from epd_actors.core.actors.registry import STAGE_ACTORS
from epd_actors.core.config import ActorLimits, Deadlines
from epd_actors.core.output_relay import OutputRelay
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import StageTimeout
from epd_actors.handoff import open_handoff
from epd_actors.protocol import Delta
from epd_actors.request import ErrorEvent
from epd_actors.simulator.config import SimConfig
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from tests.core.test_job_handover import context
from tests.core.test_supervisor import (
    EPD,
    TIMED,
    _timed_knobs,
    assert_no_leaks,
    collect,
    final,
    text,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.backends.base import StageBackend

pytestmark = pytest.mark.trio

INSTANT = SimConfig(prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)


class Recording(PrefillActor):
    """A prefill actor that notes the task each job ran in, and can hold a job or fail it."""

    hold: trio.Event | None = None
    bug: ClassVar[int] = 0  # jobs left to fail with a bug

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ran_in: list[trio.lowlevel.Task] = []
        self.holding = trio.Event()

    async def handle(self, job: Job, backend: StageBackend) -> None:
        self.ran_in.append(trio.lowlevel.current_task())
        if Recording.bug:
            Recording.bug -= 1
            raise RuntimeError("a bug in the stage")
        if self.hold is not None:
            # Produce the result first, then wait: a result that is not taken yet.
            kv = {"handle": job.request_id}
            job.add_compensation(self._released)
            self.holding.set()
            await self.hold.wait()
            await job.answer(StageOutput(kv_transfer_params=kv))
            return
        await super().handle(job, backend)

    released = 0

    async def _released(self) -> None:
        self.released += 1


@asynccontextmanager
async def running(
    max_jobs: int = 8, *, config: SimConfig = INSTANT
) -> AsyncIterator[tuple[SimFleet, Recording, trio.Nursery]]:
    sim = build_sim_fleet({"prefill": 1, "decode": 1}, config=config)
    actor = Recording(sim.pools["prefill"], max_jobs=max_jobs)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        yield sim, actor, nursery
        nursery.cancel_scope.cancel()


async def test_a_job_that_would_not_wait_runs_in_the_requesters_task_before_the_block() -> None:
    async with running() as (sim, actor, _):
        async with actor.submit(context("here"), None, run_here=True) as (job, replies):
            assert actor.ran_in == [trio.lowlevel.current_task()]
            assert job.finished_at is not None  # it ran before the block was entered
            event = replies.receive_nowait()  # and left its answer: no wait
            assert isinstance(event, StageOutput)
            assert event.kv_transfer_params is not None
            for compensation in job.hand_over():
                await compensation()
        assert sim.kv_handles_outstanding() == 0
        assert actor.statistics().running == 0  # its slot is free again


async def test_without_run_here_the_job_has_a_task_of_its_own() -> None:
    async with running() as (_, actor, _):
        async with actor.submit(context("there"), None) as (_, replies):
            assert isinstance(await replies.receive(), StageOutput)
        assert len(actor.ran_in) == 1
        assert actor.ran_in[0] is not trio.lowlevel.current_task()


async def test_a_job_run_here_holds_a_job_slot_while_it_runs() -> None:
    async with running(max_jobs=1) as (_, actor, nursery):
        actor.hold = trio.Event()
        seen: list[int] = []

        async def requester() -> None:
            async with actor.submit(context("held"), None, run_here=True) as (job, _):
                job.hand_over()

        nursery.start_soon(requester)
        with trio.fail_after(10):  # a job not run here is cancelled as its requester leaves
            await actor.holding.wait()
        seen.append(actor.statistics().running)
        # The only slot is taken: a second job goes through the inbox, run_here or
        # not, and waits there (or in the loop, for the slot) in a task of the actor's.
        async with actor.submit(context("queued"), None, run_here=True) as (job, replies):
            await trio.testing.wait_all_tasks_blocked()
            assert job.started_at is None
            seen.append(actor.statistics().running)
            actor.hold.set()
            assert isinstance(await replies.receive(), StageOutput)
            job.hand_over()
        assert seen == [1, 1]
        assert actor.ran_in[1] is not trio.lowlevel.current_task()


async def test_the_actors_stop_cancels_a_job_run_here_and_its_requester_sees_no_answer() -> None:
    sim = build_sim_fleet({"prefill": 1, "decode": 1}, config=INSTANT)
    actor = Recording(sim.pools["prefill"])
    actor.hold = trio.Event()
    answers: list[object] = []
    with trio.fail_after(10):  # without the cancel, the held job would wait forever
        await stop_while_held(actor, answers)
    assert answers == ["no answer"]
    assert actor.released == 1  # the result it had registered was undone


async def stop_while_held(actor: Recording, answers: list[object]) -> None:
    async with trio.open_nursery() as outer:
        actor_scope = trio.CancelScope()

        async def serve() -> None:
            with actor_scope:
                await actor.run()

        outer.start_soon(serve)
        await trio.testing.wait_all_tasks_blocked()

        async def requester() -> None:
            async with actor.submit(context("stopped"), None, run_here=True) as (job, replies):
                try:
                    answers.append(replies.receive_nowait())
                except trio.EndOfChannel:
                    answers.append("no answer")
                assert job.finished_at is not None

        outer.start_soon(requester)
        await actor.holding.wait()
        actor_scope.cancel()  # the actor stops while the job runs in the requester's task


async def test_a_requester_cancelled_while_its_job_runs_here_undoes_the_result_once() -> None:
    async with running() as (_, actor, _):
        actor.hold = trio.Event()
        with trio.CancelScope() as scope:

            async def cancel_when_held() -> None:
                await actor.holding.wait()
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_held)
                async with actor.submit(context("gone"), None, run_here=True):
                    pytest.fail("the block is never entered: the requester was cancelled")
        assert actor.released == 1
        assert actor.statistics().running == 0


async def test_a_bug_in_a_job_run_here_crashes_the_actor_and_its_requester_sees_no_answer() -> None:
    sim = build_sim_fleet({"prefill": 1, "decode": 1}, config=INSTANT)
    actor = Recording(sim.pools["prefill"])
    Recording.bug = 1
    answers: list[object] = []
    crash = pytest.RaisesExc(RuntimeError, match="a bug in the stage")
    with pytest.RaisesGroup(crash, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            async with actor.submit(context("buggy"), None, run_here=True) as (_, replies):
                assert actor.ran_in == [trio.lowlevel.current_task()]
                try:
                    answers.append(replies.receive_nowait())
                except trio.EndOfChannel:
                    answers.append("no answer")
            await trio.sleep_forever()  # the actor's crash ends this nursery
    assert answers == ["no answer"]


# ------------------------------------------------- an output job run in the requester's task


class NamingDecode(DecodeActor):
    """A decode actor that notes the name of the task each of its jobs ran in."""

    ran_in: ClassVar[list[str]] = []

    async def handle(self, job: Job, backend: StageBackend) -> None:
        NamingDecode.ran_in.append(trio.lowlevel.current_task().name)
        await super().handle(job, backend)


async def test_the_inter_token_deadline_holds_whether_the_decode_job_runs_here_or_in_its_own_task(
    autojump_clock: object,
) -> None:
    # One decode slot: the first request's job runs in its request task (and watches
    # its inter-token deadline itself); the second one's waits for the slot and
    # runs in a task of the actor's (the supervisor watches).  Both decoders stall.
    NamingDecode.ran_in = []
    fleet = build_sim_fleet(EPD, config=TIMED)
    fleet.engines["decode-0"].config = sim_config(**{**_timed_knobs(), "stall_after_tokens": 2})
    supervisor = Supervisor(
        fleet.pools,
        registry={**STAGE_ACTORS, "decode": NamingDecode},
        limits=ActorLimits(max_jobs=1),
        deadlines=Deadlines(inter_token_timeout_s=0.5),
    )
    finals: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)

        async def one(request_id: str) -> None:
            finals[request_id] = final(await collect(supervisor, text(request_id=request_id)))

        async with trio.open_nursery() as requests:
            for request_id in ("first", "second"):
                requests.start_soon(one, request_id)
        nursery.cancel_scope.cancel()
    for failed in finals.values():
        assert isinstance(failed, ErrorEvent)
        assert isinstance(failed.error, StageTimeout)
        assert failed.error.phase == "inter_token"
    assert sorted(name.partition(":")[0] for name in NamingDecode.ran_in) == ["decode", "request"]
    assert fleet.total("aborts", "decode") == 2
    # Each stall counts against the worker, whichever task watched it.
    assert fleet.pools["decode"].members[0].failures == 2
    assert_no_leaks(fleet)


class Trickle:
    """A stream whose deltas go to the sink at the times given, then nothing (a stall)."""

    def __init__(self, relay: OutputRelay, at: list[float]) -> None:
        self.relay = relay
        self.at = at

    async def receive(self) -> Delta:
        for when in self.at:
            await trio.sleep_until(when)
            self.relay.sink(Delta("r", (1,), "x"))
        self.at = []
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_watched_times_out_one_inter_token_timeout_after_the_last_delta(
    autojump_clock: object,
) -> None:
    send, receive = open_handoff(64)
    relay = OutputRelay(send, Progress(), inter_token_s=0.5)
    start = trio.current_time()
    stream = Trickle(relay, [start + 0.25 * n for n in range(1, 7)])
    with pytest.raises(StageTimeout, match=r"no inter token within 0\.5s"):
        await relay.watched(stream.receive)
    assert trio.current_time() - start == pytest.approx(1.5 + 0.5)
    assert relay.watch is None
    receive.close()


async def test_watched_waits_for_the_first_delta_without_a_deadline(
    autojump_clock: object,
) -> None:
    # Before the first delta the attempt's first-token deadline is the one that applies.
    send, receive = open_handoff(64)
    relay = OutputRelay(send, Progress(), inter_token_s=0.5)
    with trio.move_on_after(100.0) as outer:
        await relay.watched(Trickle(relay, []).receive)
    assert outer.cancelled_caught
    receive.close()


class Progress:
    first_token_at: float | None = None
    completion_tokens = 0
