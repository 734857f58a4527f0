"""A job's reply is its one final event; a delta on it is an actor bug (InternalError)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from epd_actors.core.actors.decode import DecodeActor
from epd_actors.core.actors.registry import STAGE_ACTORS
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import InternalError
from epd_actors.openai.errors import error_response
from epd_actors.protocol import Delta, Prompt, SamplingParams
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationEvent, GenerationRequest
from epd_actors.testing import SimFleet, build_sim_fleet

if TYPE_CHECKING:
    import pytest

    from epd_actors.backends.base import StageBackend
    from epd_actors.core.actors import Job


def text(request_id: str) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text="a b c d"),
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
        request_id=request_id,
    )


async def serve(
    fleet: SimFleet, registry: dict[str, type[DecodeActor]], *request_ids: str
) -> tuple[Supervisor, list[list[GenerationEvent]]]:
    supervisor = Supervisor(fleet.pools, registry={**STAGE_ACTORS, **registry})
    answers: list[list[GenerationEvent]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for request_id in request_ids:
            async with supervisor.generate(text(request_id)) as events:
                answers.append([event async for event in events])
        nursery.cancel_scope.cancel()
    return supervisor, answers


class DeltaOnReply(DecodeActor):
    """A decode stage with the bug: its last delta goes on the reply, not the relay."""

    async def handle(self, job: Job, backend: StageBackend) -> None:
        await job.reply.send(Delta(job.request_id, token_ids=(7,), text="x", finish_reason="stop"))


class NoRelay(DecodeActor):
    """A decode stage whose job lost its output relay."""

    async def handle(self, job: Job, backend: StageBackend) -> None:
        job.output = None
        await super().handle(job, backend)


def assert_internal_error(events: list[GenerationEvent]) -> InternalError:
    last = events[-1]
    assert isinstance(last, ErrorEvent), events
    assert isinstance(last.error, InternalError)
    assert not any(isinstance(event, DeltaEvent | DoneEvent) for event in events[:-1])
    return last.error


async def test_a_delta_on_a_reply_fails_the_request_with_an_internal_error(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    supervisor, (events,) = await serve(fleet, {"decode": DeltaOnReply}, "buggy")
    error = assert_internal_error(events)
    assert "decode actor replied to request buggy" in str(error)
    assert "Delta" in str(error)
    # An actor bug, not the worker's: a 500, no retry, no restart, nothing left behind.
    answer = error_response(error)
    assert answer is not None
    assert (answer.status, answer.body["error"]["type"]) == (500, "internal_error")
    assert supervisor.actors["decode"].statistics().retries_total == 0
    assert supervisor.statistics().actor_restarts == {"prefill": 0, "decode": 0}
    assert fleet.kv_handles_outstanding() == 0  # prefill's handle was released
    assert [r.levelname for r in caplog.records if "deltas go on the output path" in r.message] == [
        "ERROR"
    ]


async def test_the_actor_serves_on_after_the_bad_reply(autojump_clock: object) -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    supervisor, answers = await serve(fleet, {"decode": DeltaOnReply}, "one", "two")
    for events in answers:
        assert_internal_error(events)
    assert supervisor.statistics().actor_restarts == {"prefill": 0, "decode": 0}


async def test_streaming_without_an_output_relay_is_an_internal_error(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    supervisor, (events,) = await serve(fleet, {"decode": NoRelay}, "lost")
    error = assert_internal_error(events)
    assert "decode job of lost" in str(error)
    assert "no output relay" in str(error)
    # Refused before the worker was asked, and not retried elsewhere.
    assert fleet.engines["decode-0"].statistics().generate_requests == 0
    assert supervisor.actors["decode"].statistics().retries_total == 0
    assert fleet.kv_handles_outstanding() == 0
