"""The supervisor and stage actors over an in-process simulated fleet, on a virtual clock."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, ClassVar

import pytest
import trio
import trio.testing

from epd_actors.core.actors import BaseActor, Job, StageContext, StageOutput
from epd_actors.core.actors.registry import STAGE_ACTORS, register_stage
from epd_actors.core.config import ActorLimits, AdmissionLimits, Deadlines
from epd_actors.core.lifecycle import Phase
from epd_actors.core.retry import RetryPolicy
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import (
    ActorCrashed,
    ConfigError,
    HandoffRejected,
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    StageTimeout,
    WorkerDisconnected,
)
from epd_actors.limits import REQUEST_EVENT_BUFFER
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, SamplingParams
from epd_actors.request import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    UsageEvent,
)
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from epd_actors.backends.base import (
        BackendStatus,
        DeltaStream,
        StageBackend,
        WorkerRequirement,
    )
    from epd_actors.protocol import EncodeRequest, GenerateRequest, PrefillRequest, StageResult

# Latencies chosen so every stage boundary is a distinct, exact virtual time.
TIMED = sim_config(
    encode_item_s=0.010,
    encode_kib_s=0.0,
    prefill_token_s=0.001,
    first_token_s=0.005,
    output_token_s=0.002,
    media_tokens_per_item=10,
)

EPD = {"encode": 1, "prefill": 1, "decode": 1}


def image(tag: str) -> MediaItem:
    data = f"image-{tag}".encode()
    return MediaItem("image/png", data, hashlib.sha256(data).hexdigest())


def chat(*media: MediaItem, max_tokens: int = 5, request_id: str = "r1") -> GenerationRequest:
    parts: tuple[str | int, ...] = ("a b c d", *range(len(media)))
    return GenerationRequest(
        Prompt(messages=(ChatMessage("user", parts),)),
        media=media,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        request_id=request_id,
    )


def text(max_tokens: int = 5, request_id: str = "t1") -> GenerationRequest:
    return GenerationRequest(
        Prompt(text="a b c d"),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        request_id=request_id,
    )


async def collect(supervisor: Supervisor, request: GenerationRequest) -> list[GenerationEvent]:
    async with supervisor.generate(request) as events:
        return [event async for event in events]


async def run_one(
    fleet: SimFleet, request: GenerationRequest, **options: object
) -> tuple[Supervisor, list[GenerationEvent]]:
    supervisor = Supervisor(fleet.pools, **options)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        events = await collect(supervisor, request)
        nursery.cancel_scope.cancel()
    return supervisor, events


def output_text(events: list[GenerationEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, DeltaEvent))


def final(events: list[GenerationEvent]) -> DoneEvent | ErrorEvent:
    last = events[-1]
    assert isinstance(last, DoneEvent | ErrorEvent)
    return last


def assert_no_leaks(fleet: SimFleet) -> None:
    assert fleet.kv_handles_outstanding() == 0
    assert fleet.total("kv_handles_leaked") == 0
    assert all(m.in_flight == 0 for pool in fleet.pools.values() for m in pool.members)
    assert fleet.total("in_flight") == 0


# ---------------------------------------------------------------- topologies


@pytest.mark.parametrize(
    ("workers", "media", "stages_seen"),
    [
        (EPD, 1, {"encode": 1, "prefill": 1, "generate": 1}),
        (EPD, 0, {"encode": 0, "prefill": 1, "generate": 1}),
        ({"encode": 1, "pd": 1}, 1, {"encode": 1, "prefill": 0, "generate": 1}),
        ({"encode": 1, "pd": 1}, 0, {"encode": 0, "prefill": 0, "generate": 1}),
        ({"prefill": 1, "decode": 1}, 0, {"encode": 0, "prefill": 1, "generate": 1}),
        ({"pd": 1}, 0, {"encode": 0, "prefill": 0, "generate": 1}),
    ],
    ids=["E+P+D-image", "E+P+D-text", "E+PD-image", "E+PD-text", "P+D-text", "PD-only"],
)
async def test_each_topology_runs_the_planned_stages(
    workers: dict[str, int], media: int, stages_seen: dict[str, int]
) -> None:
    fleet = build_sim_fleet(workers)
    request = chat(*(image(str(i)) for i in range(media)))
    supervisor, events = await run_one(fleet, request)
    done = final(events)
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == 5
    assert isinstance(events[-2], UsageEvent)
    assert output_text(events)
    seen = {stage: fleet.total(f"{stage}_requests") for stage in stages_seen}
    assert seen == stages_seen
    assert_no_leaks(fleet)
    assert supervisor.statistics().requests_in_flight == 0


async def test_same_output_whichever_topology() -> None:
    """The simulator's output depends only on the prompt: stages must not change it."""
    outputs = set()
    for workers in (EPD, {"encode": 1, "pd": 1}):
        fleet = build_sim_fleet(workers)
        _, events = await run_one(fleet, chat(image("x")))
        outputs.add(output_text(events))
    assert len(outputs) == 1


async def test_stage_timings_on_the_virtual_clock(autojump_clock: object) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    start = trio.current_time()
    _, events = await run_one(fleet, chat(image("x")))
    done = final(events)
    assert isinstance(done, DoneEvent)
    timings = done.timings
    assert timings.stages == pytest.approx({"encode": 0.010, "prefill": 0.014, "decode": 0.013})
    assert timings.ttft_s == pytest.approx(0.010 + 0.014 + 0.005)
    assert timings.total_s == pytest.approx(0.037)
    assert trio.current_time() - start == pytest.approx(0.037)
    assert timings.workers == {
        "encode": ("encode-0",),
        "prefill": ("prefill-0",),
        "decode": ("decode-0",),
    }
    assert timings.queue_wait_s == 0


async def test_media_items_fan_out_concurrently_once_per_distinct_item(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet({"encode": 3, "prefill": 1, "decode": 1}, config=TIMED)
    request = chat(image("a"), image("b"), image("a"), image("c"))
    _, events = await run_one(fleet, request)
    done = final(events)
    assert isinstance(done, DoneEvent)
    # Three distinct items on three encoders: one item's time, not three.
    assert done.timings.stages["encode"] == pytest.approx(0.010)
    assert sorted(done.timings.workers["encode"]) == ["encode-0", "encode-1", "encode-2"]
    assert fleet.total("encode_requests") == 3
    assert fleet.total("ec_entries_written") == 3


async def test_consistent_hash_sends_an_image_to_the_same_encoder() -> None:
    fleet = build_sim_fleet(
        {"encode": 4, "prefill": 1, "decode": 1}, policies={"encode": "consistent_hash"}
    )
    supervisor = Supervisor(fleet.pools)
    chosen = set()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for n in range(6):
            events = await collect(supervisor, chat(image("same"), request_id=f"r{n}"))
            done = final(events)
            assert isinstance(done, DoneEvent)
            chosen.add(done.timings.workers["encode"])
        nursery.cancel_scope.cancel()
    assert len(chosen) == 1


async def test_round_robin_spreads_decoders() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 3})
    supervisor = Supervisor(fleet.pools)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for n in range(6):
            await collect(supervisor, text(request_id=f"t{n}"))
        nursery.cancel_scope.cancel()
    assert [c.generate_requests for c in fleet.counters("decode").values()] == [2, 2, 2]


async def test_concurrent_requests_all_complete() -> None:
    fleet = build_sim_fleet({"encode": 2, "prefill": 2, "decode": 2})
    supervisor = Supervisor(fleet.pools)
    results: list[GenerationEvent] = []

    async def one(n: int) -> None:
        request = chat(image(str(n % 3)), request_id=f"r{n}") if n % 2 else text(request_id=f"t{n}")
        events = await collect(supervisor, request)
        results.append(final(events))

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with trio.open_nursery() as clients:
            for n in range(40):
                clients.start_soon(one, n)
        nursery.cancel_scope.cancel()
    assert len(results) == 40
    assert all(isinstance(r, DoneEvent) for r in results)
    assert_no_leaks(fleet)


# ---------------------------------------------------------------- cancellation


async def cancel_after(fleet: SimFleet, request: GenerationRequest, delay: float) -> Supervisor:
    supervisor = Supervisor(fleet.pools)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        with trio.move_on_after(delay):
            await collect(supervisor, request)
        # Let the actors' shielded cleanups (aborts, releases) finish.
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    return supervisor


@pytest.mark.parametrize("workers", [EPD, {"encode": 1, "pd": 1}], ids=["E+P+D", "E+PD"])
async def test_cancellation_at_every_point_leaves_nothing_behind(
    workers: dict[str, int], autojump_clock: object
) -> None:
    """Cancel the caller at each millisecond of a request's life (and in between)."""
    for step in range(0, 40):
        delay = step * 0.001 + 0.0005 * (step % 2)
        fleet = build_sim_fleet(workers, config=TIMED)
        supervisor = await cancel_after(fleet, chat(image("x"), max_tokens=5), delay)
        assert_no_leaks(fleet)
        stats = supervisor.statistics()
        assert stats.requests_in_flight == 0
        assert stats.requests_total == 1


async def test_cancel_between_prefill_and_decode_releases_the_kv_handle(
    autojump_clock: object,
) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    # Decode is slow to start: cancel while it waits for its first token.
    fleet.engines["decode-0"].config = sim_config(**{**_timed_knobs(), "stall_s": 1.0})
    supervisor = await cancel_after(fleet, chat(image("x")), 0.030)
    assert fleet.total("kv_handles_created") == 1
    assert fleet.total("releases_found") + fleet.total("kv_handles_aborted") <= 1
    assert fleet.total("aborts", "decode") == 1
    assert_no_leaks(fleet)
    assert supervisor.statistics().compensations_run == 1


def _timed_knobs() -> dict[str, object]:
    return {
        "encode_item_s": 0.010,
        "encode_kib_s": 0.0,
        "prefill_token_s": 0.001,
        "first_token_s": 0.005,
        "output_token_s": 0.002,
        "media_tokens_per_item": 10,
    }


@pytest.mark.parametrize(
    ("delay", "stage"),
    [(0.005, "encode"), (0.015, "prefill"), (0.030, "decode")],
    ids=["during-encode", "during-prefill", "during-decode"],
)
async def test_cancellation_aborts_the_running_stage(
    delay: float, stage: str, autojump_clock: object
) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    await cancel_after(fleet, chat(image("x")), delay)
    assert fleet.total("aborts", stage) == 1
    assert_no_leaks(fleet)


# ---------------------------------------------------------------- deadlines and errors


async def test_request_deadline_expires_with_a_typed_error(autojump_clock: object) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    request = GenerationRequest(Prompt(text="a b"), request_id="slow", timeout_s=0.012)
    fleet.engines["prefill-0"].config = sim_config(**{**_timed_knobs(), "stall_s": 5.0})
    start = trio.current_time()
    _, events = await run_one(fleet, request)
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, StageTimeout)
    assert failed.error.phase == "request"
    assert trio.current_time() - start == pytest.approx(0.012)
    assert fleet.total("aborts", "prefill") == 1
    assert_no_leaks(fleet)


@pytest.mark.parametrize(
    ("deadlines", "knobs", "phase"),
    [
        (Deadlines(first_token_timeout_s=0.5), {"stall_s": 3.0}, "first_token"),
        (Deadlines(inter_token_timeout_s=0.5), {"stall_after_tokens": 2}, "inter_token"),
    ],
    ids=["first-token", "inter-token"],
)
async def test_token_timeouts(
    deadlines: Deadlines, knobs: dict[str, object], phase: str, autojump_clock: object
) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    fleet.engines["decode-0"].config = sim_config(**{**_timed_knobs(), **knobs})
    _, events = await run_one(fleet, text(max_tokens=8), deadlines=deadlines)
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, StageTimeout)
    assert failed.error.phase == phase
    assert fleet.total("aborts", "decode") == 1
    assert_no_leaks(fleet)


async def test_the_inter_token_timeout_counts_from_the_last_delta(
    autojump_clock: object,
) -> None:
    """The deltas bypass the supervisor's task; their relay still moves its deadline."""
    fleet = build_sim_fleet(EPD, config=TIMED)
    knobs = {**_timed_knobs(), "output_token_s": 0.25, "stall_after_tokens": 6}
    fleet.engines["decode-0"].config = sim_config(**knobs)
    supervisor = Supervisor(fleet.pools, deadlines=Deadlines(inter_token_timeout_s=0.5))
    seen: list[tuple[float, GenerationEvent]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(text(max_tokens=8)) as events:
            seen.extend([(trio.current_time(), event) async for event in events])
        nursery.cancel_scope.cancel()
    times = [t for t, e in seen if isinstance(e, DeltaEvent)]
    assert len(times) == 6  # 1.25 s of tokens: the 0.5 s timeout never counted from the start
    failed = seen[-1][1]
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, StageTimeout)
    assert failed.error.phase == "inter_token"
    assert seen[-1][0] - times[-1] == pytest.approx(0.5)
    assert_no_leaks(fleet)


async def test_a_slow_reader_is_not_an_inter_token_timeout(autojump_clock: object) -> None:
    """While the caller's event buffer is full the worker is not the one stalling."""
    fleet = build_sim_fleet(EPD, config=TIMED)
    supervisor = Supervisor(fleet.pools, deadlines=Deadlines(inter_token_timeout_s=0.5))
    tokens = REQUEST_EVENT_BUFFER + 8
    received: list[GenerationEvent] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(text(max_tokens=tokens)) as events:
            await trio.sleep(2.0)  # the buffer fills and the decode job waits
            async for event in events:
                received.append(event)
                await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    done = final(received)
    assert isinstance(done, DoneEvent)
    assert sum(len(e.token_ids) for e in received if isinstance(e, DeltaEvent)) == tokens
    assert_no_leaks(fleet)


@pytest.mark.parametrize("stage", ["encode", "prefill", "decode"])
async def test_worker_error_in_each_stage_is_typed(stage: str) -> None:
    fleet = build_sim_fleet(EPD)
    knob = {
        "encode": "encode_error_rate",
        "prefill": "prefill_error_rate",
        "decode": "generate_error_rate",
    }[stage]
    fleet.engines[f"{stage}-0"].config = sim_config(**{knob: 1.0})
    _, events = await run_one(fleet, chat(image("x")))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert failed.error.code == "engine_error"
    assert failed.error.stage == stage
    assert failed.error.worker_id == f"{stage}-0"
    assert_no_leaks(fleet)


async def test_decode_failure_releases_the_prefilled_handle() -> None:
    fleet = build_sim_fleet(EPD)
    fleet.engines["decode-0"].config = sim_config(generate_error_rate=1.0)
    supervisor, _ = await run_one(fleet, text())
    assert fleet.total("releases_found") == 1
    assert supervisor.statistics().compensations_run == 1
    assert_no_leaks(fleet)


async def test_no_connected_worker_is_refused_at_once() -> None:
    fleet = build_sim_fleet(EPD)
    fleet.backends["decode-0"].disconnect()
    _, events = await run_one(fleet, text())
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, NoHealthyWorker)
    assert_no_leaks(fleet)


@pytest.mark.parametrize("timeout_s", [None, 0, 0.0])
async def test_a_request_timeout_of_zero_uses_the_configured_one(
    autojump_clock: object, timeout_s: float | None
) -> None:
    fleet = build_sim_fleet(EPD, config=TIMED)
    request = GenerationRequest(
        Prompt(text="a b c d"), sampling=SamplingParams(max_tokens=5), timeout_s=timeout_s
    )
    _, events = await run_one(fleet, request, deadlines=Deadlines(request_timeout_s=8.0))
    assert isinstance(final(events), DoneEvent)
    assert_no_leaks(fleet)


@pytest.mark.parametrize("down", ["encode-0", "prefill-0", "decode-0"])
async def test_a_stage_without_a_usable_worker_fails_before_any_stage_runs(down: str) -> None:
    fleet = build_sim_fleet(EPD)
    fleet.backends[down].disconnect()
    supervisor, events = await run_one(fleet, chat(image("a")))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, NoHealthyWorker)
    assert failed.error.retry_after == 1.0
    assert str(failed.error) == f"no healthy {down.split('-')[0]} worker"
    assert (fleet.total("encode_requests"), fleet.total("prefill_requests")) == (0, 0)
    assert fleet.total("generate_requests") == 0
    assert supervisor.statistics().compensations_run == 0
    assert_no_leaks(fleet)


async def test_busy_workers_still_take_requests(autojump_clock: object) -> None:
    """A pool at its per-worker limit is not 'no usable worker': requests wait for a slot."""
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=TIMED, max_in_flight_per_worker=1)
    supervisor = Supervisor(fleet.pools)
    outcomes: list[GenerationEvent] = []

    async def one(request_id: str) -> None:
        outcomes.append(final(await collect(supervisor, text(request_id=request_id))))

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with trio.open_nursery() as requests:
            for i in range(4):
                requests.start_soon(one, f"t{i}")
        nursery.cancel_scope.cancel()
    assert all(isinstance(outcome, DoneEvent) for outcome in outcomes)
    assert len(outcomes) == 4
    assert fleet.total("generate_requests") == 4
    assert_no_leaks(fleet)


@pytest.mark.parametrize(
    "workers",
    [{"encode": 1}, {"prefill": 1}, {"decode": 1}, {"prefill": 1, "decode": 1, "pd": 1}],
    ids=["encode-only", "prefill-only", "decode-without-prefill", "two-output-stages"],
)
def test_invalid_topologies_are_refused(workers: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="pools"):
        Supervisor(build_sim_fleet(workers).pools)


# ---------------------------------------------------------------- extension and supervision


class Checkpoint(BaseActor):
    """A toy stage between prefill and decode: asks the prefill worker to do nothing."""

    stage = "checkpoint"
    phase = Phase.PREFILLING
    order = 25
    seen: ClassVar[list[str]] = []

    async def handle(self, job: Job, backend: StageBackend) -> None:
        self.seen.append(job.request_id)
        await trio.lowlevel.checkpoint()
        await job.reply.send(StageOutput(ec_transfer_params={"checkpoint": job.request_id}))


async def test_a_new_stage_is_one_class_and_one_registry_line() -> None:
    registry = dict(STAGE_ACTORS)
    register_stage(Checkpoint, registry)
    fleet = build_sim_fleet(EPD)
    # The toy stage borrows the prefill workers' backends for its pool.
    from epd_actors.core.pool import WorkerPool
    from epd_actors.core.routing import make_policy

    pool = WorkerPool("checkpoint", make_policy("round_robin"), max_in_flight_per_worker=8)
    pool.add(fleet.backends["prefill-0"])
    supervisor = Supervisor({**fleet.pools, "checkpoint": pool}, registry=registry)
    assert supervisor.topology == ("encode", "prefill", "checkpoint", "decode")
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        events = await collect(supervisor, text(request_id="toy"))
        nursery.cancel_scope.cancel()
    assert isinstance(final(events), DoneEvent)
    # Workers see the request id with a unique suffix.
    assert [seen.rpartition(".")[0] for seen in Checkpoint.seen] == ["toy"]


class Fragile(BaseActor):
    """A decode-like stage whose first job hits a bug."""

    stage = "decode"
    phase = Phase.DECODING
    order = 30
    produces_output = True
    requires = ("prefill",)
    crashes_left: ClassVar[int] = 1

    async def handle(self, job: Job, backend: StageBackend) -> None:
        if Fragile.crashes_left:
            Fragile.crashes_left -= 1
            raise RuntimeError("a bug in the actor")
        await STAGE_ACTORS["decode"].handle(self, job, backend)


class FragilePrefill(BaseActor):
    """A prefill stage whose first job hits a bug (a job run in its requester's task)."""

    stage = "prefill"
    phase = Phase.PREFILLING
    order = 20
    requires = ("decode",)
    crashes_left: ClassVar[int] = 1

    async def handle(self, job: Job, backend: StageBackend) -> None:
        if FragilePrefill.crashes_left:
            FragilePrefill.crashes_left -= 1
            raise RuntimeError("a bug in the actor")
        await STAGE_ACTORS["prefill"].handle(self, job, backend)


@pytest.mark.parametrize("fragile", [Fragile, FragilePrefill], ids=["decode", "prefill"])
async def test_a_crashed_actor_fails_its_jobs_and_is_restarted(
    fragile: type[Fragile | FragilePrefill], autojump_clock: object
) -> None:
    fragile.crashes_left = 1
    registry = {**STAGE_ACTORS, fragile.stage: fragile}
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    supervisor = Supervisor(
        fleet.pools, registry=registry, limits=ActorLimits(restart_backoff_start_s=0.25)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        failed = final(await collect(supervisor, text(request_id="unlucky")))
        assert isinstance(failed, ErrorEvent)
        assert isinstance(failed.error, ActorCrashed)
        start = trio.current_time()
        recovered = final(await collect(supervisor, text(request_id="lucky")))
        assert isinstance(recovered, DoneEvent)
        # The second request waited in the inbox for the restart.
        assert trio.current_time() - start >= 0.25
        nursery.cancel_scope.cancel()
    restarted = {"prefill": 0, "decode": 0, fragile.stage: 1}
    assert supervisor.statistics().actor_restarts == restarted
    assert_no_leaks(fleet)


# ---------------------------------------------------------------- retries


@pytest.mark.parametrize(
    ("stage", "knob"),
    [
        ("encode", "encode_error_rate"),
        ("prefill", "prefill_error_rate"),
        ("decode", "generate_error_rate"),
    ],
)
async def test_a_failing_worker_is_retried_on_another(stage: str, knob: str) -> None:
    fleet = build_sim_fleet({"encode": 2, "prefill": 2, "decode": 2})
    fleet.engines[f"{stage}-0"].config = sim_config(**{knob: 1.0})
    supervisor, events = await run_one(fleet, chat(image("x")))
    done = final(events)
    assert isinstance(done, DoneEvent)
    assert done.timings.workers[stage] == (f"{stage}-1",)
    requests = "generate_requests" if stage == "decode" else f"{stage}_requests"
    assert fleet.engines[f"{stage}-0"].statistics().errors_injected == 1
    assert fleet.engines[f"{stage}-1"].statistics().__getattribute__(requests) == 1
    assert supervisor.actors[stage].statistics().retries_total == 1
    assert_no_leaks(fleet)


async def test_output_stage_is_not_retried_after_its_first_token() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 2})
    fleet.engines["decode-0"].config = sim_config(
        crash_after_tokens=3, output_token_s=0.0, tokens_per_delta=1
    )
    supervisor, events = await run_one(fleet, text(max_tokens=8))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, WorkerDisconnected)
    assert output_text(events)
    assert fleet.engines["decode-1"].statistics().generate_requests == 0
    assert supervisor.actors["decode"].statistics().retries_total == 0
    assert_no_leaks(fleet)


async def test_client_class_errors_are_never_retried() -> None:
    # P+D without encoders: the strict simulator refuses the image (not retryable).
    fleet = build_sim_fleet({"prefill": 2, "decode": 1})
    supervisor, events = await run_one(fleet, chat(image("x")))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert failed.error.code == "missing_encoder_cache"
    assert fleet.total("prefill_requests") == 1
    assert supervisor.actors["prefill"].statistics().retries_total == 0


async def test_attempts_are_bounded(autojump_clock: object) -> None:
    fleet = build_sim_fleet({"prefill": 4, "decode": 1})
    for n in range(4):
        fleet.engines[f"prefill-{n}"].config = sim_config(prefill_error_rate=1.0)
    supervisor, events = await run_one(
        fleet, text(), retry=RetryPolicy(max_attempts=3, backoff_start_s=0.1, jitter=0.0)
    )
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert fleet.total("prefill_requests") == 3
    assert supervisor.actors["prefill"].statistics().retries_total == 2


async def test_when_every_worker_failed_the_last_error_is_reported() -> None:
    fleet = build_sim_fleet({"prefill": 2, "decode": 1})
    for n in range(2):
        fleet.engines[f"prefill-{n}"].config = sim_config(prefill_error_rate=1.0)
    _, events = await run_one(fleet, text(), retry=RetryPolicy(max_attempts=5, jitter=0.0))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, RemoteWorkerError)
    assert fleet.total("prefill_requests") == 2


class LosesItsHandles:
    """A prefill worker that frees each KV handle as soon as it answered (a bad P).

    Speaks the real backend interface over a real simulated engine; counts the
    releases the router sends it.
    """

    def __init__(self, inner: StageBackend) -> None:
        self.inner = inner
        self.worker_id = inner.worker_id
        self.releases: list[dict[str, object]] = []

    def status(self) -> BackendStatus:
        return self.inner.status()

    def expect(self, requirement: WorkerRequirement) -> None:
        self.inner.expect(requirement)

    async def run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        result = await self.inner.run_stage(request)
        assert result.kv_transfer_params is not None
        await self.inner.release(result.kv_transfer_params)
        return result

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[DeltaStream]:
        return self.inner.open_stream(request)

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        self.releases.append(kv_transfer_params)
        return await self.inner.release(kv_transfer_params)


def with_a_bad_prefill_worker(fleet: SimFleet) -> LosesItsHandles:
    """Replace ``prefill-0`` by a :class:`LosesItsHandles`, still the first one chosen."""
    pool = fleet.pools["prefill"]
    good = [pool.remove(m.worker_id).backend for m in pool.members]
    bad = LosesItsHandles(good[0])
    for backend in [bad, *good[1:]]:
        pool.add(backend)
    return bad


async def test_a_refused_kv_handle_is_blamed_on_its_prefill_worker_and_prefill_moves() -> None:
    """D refusing P's handle is P's failure: P's breaker is charged, the refused
    handle released once, and P runs again on another worker, then D."""
    fleet = build_sim_fleet({"prefill": 2, "decode": 1})
    bad = with_a_bad_prefill_worker(fleet)
    supervisor, events = await run_one(fleet, text(), retry=RetryPolicy(jitter=0.0))
    done = final(events)
    assert isinstance(done, DoneEvent), done
    assert done.timings.workers == {"prefill": ("prefill-1",), "decode": ("decode-0",)}
    assert fleet.engines["decode-0"].statistics().generate_requests == 2
    assert len(bad.releases) == 1  # the refused handle, once; nothing else
    bad_member = fleet.pools["prefill"].get("prefill-0")
    assert bad_member is not None
    assert repr(bad_member.breaker) == "<CircuitBreaker closed failures=1>"
    decoder = fleet.pools["decode"].get("decode-0")
    assert decoder is not None
    assert repr(decoder.breaker) == "<CircuitBreaker closed failures=0>"
    assert supervisor.actors["decode"].statistics().retries_total == 0
    assert_no_leaks(fleet)


async def test_refused_hand_offs_are_bounded_by_the_retry_policy() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    bad = with_a_bad_prefill_worker(fleet)
    _, events = await run_one(fleet, text(), retry=RetryPolicy(max_attempts=3, jitter=0.0))
    failed = final(events)
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, HandoffRejected)  # a 502, not a client error
    assert failed.error.cause.code == "unknown_kv_handle"
    assert fleet.engines["decode-0"].statistics().generate_requests == 1  # no other P
    assert len(bad.releases) == 1
    assert_no_leaks(fleet)


# ---------------------------------------------------------------- admission


async def test_a_burst_past_the_in_flight_limit_is_refused_at_once(autojump_clock: object) -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=TIMED)
    supervisor = Supervisor(fleet.pools, admission=AdmissionLimits(max_requests_in_flight=4))
    outcomes: dict[str, tuple[GenerationEvent, float]] = {}

    async def one(n: int) -> None:
        start = trio.current_time()
        events = await collect(supervisor, text(request_id=f"b{n}"))
        outcomes[f"b{n}"] = (final(events), trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with trio.open_nursery() as burst:
            for n in range(20):
                burst.start_soon(one, n)
        nursery.cancel_scope.cancel()
    refused = [(e, t) for e, t in outcomes.values() if isinstance(e, ErrorEvent)]
    done = [e for e, _ in outcomes.values() if isinstance(e, DoneEvent)]
    assert len(done) == 4
    assert len(refused) == 16
    for event, elapsed in refused:
        assert isinstance(event, ErrorEvent)
        assert isinstance(event.error, Overloaded)
        assert event.error.retry_after == 1.0
        assert elapsed == 0
    assert supervisor.statistics().requests_refused == 16
    assert_no_leaks(fleet)


async def test_a_caller_leaving_a_stalled_stream_does_not_crash_the_actor() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=sim_config(output_token_s=0.0))
    supervisor = Supervisor(fleet.pools)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(text(max_tokens=4000, request_id="stalled")) as events:
            await events.receive()
            # Stop reading: every buffer between the worker and us fills up.
            await trio.testing.wait_all_tasks_blocked()
        after = await collect(supervisor, text(request_id="after"))
        assert isinstance(final(after), DoneEvent)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert supervisor.statistics().actor_restarts == {"prefill": 0, "decode": 0}
    assert fleet.total("aborts", "decode") == 1
    assert_no_leaks(fleet)


async def test_priority_decides_who_is_admitted_near_the_limit(autojump_clock: object) -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=TIMED)
    limits = AdmissionLimits(
        max_requests_in_flight=10, low_priority_share=0.5, high_priority_reserve=0.2
    )
    supervisor = Supervisor(fleet.pools, admission=limits)
    assert [limits.limit_for(p) for p in ("high", "normal", "low")] == [10, 8, 5]
    outcomes: dict[str, list[type]] = {"high": [], "normal": [], "low": []}

    async def one(priority: str, n: int) -> None:
        request = GenerationRequest(
            Prompt(text="a b"), request_id=f"{priority}{n}", priority=priority
        )
        outcomes[priority].append(type(final(await collect(supervisor, request))))

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with trio.open_nursery() as burst:
            for n in range(4):  # 4 normal requests in flight first
                burst.start_soon(one, "normal", n)
            await trio.testing.wait_all_tasks_blocked()
            for n in range(3):  # low: admitted while fewer than 5 are in flight
                burst.start_soon(one, "low", n)
            await trio.testing.wait_all_tasks_blocked()
            for n in range(4):  # normal: up to 8
                burst.start_soon(one, "normal", 10 + n)
            await trio.testing.wait_all_tasks_blocked()
            for n in range(3):  # high: up to 10
                burst.start_soon(one, "high", n)
        nursery.cancel_scope.cancel()
    assert outcomes["low"].count(DoneEvent) == 1
    assert outcomes["normal"].count(DoneEvent) == 4 + 3
    assert outcomes["high"].count(DoneEvent) == 2
    assert_no_leaks(fleet)


def test_an_unknown_priority_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="priority"):
        GenerationRequest(Prompt(text="x"), priority="urgent")


async def test_prompt_affinity_is_computed_only_for_policies_that_read_it() -> None:
    fleet = build_sim_fleet(
        {"prefill": 4, "decode": 1},
        policies={"prefill": "consistent_hash", "decode": "least_in_flight"},
    )
    supervisor = Supervisor(fleet.pools)
    prefill, decode = supervisor.actors["prefill"], supervisor.actors["decode"]
    context = StageContext(text(request_id="k"), "k.1")
    job_key = prefill.route_key(Job(context, None, trio.open_memory_channel(1)[0], 0.0))
    assert job_key.affinity is not None
    assert (
        decode.route_key(Job(context, None, trio.open_memory_channel(1)[0], 0.0)).affinity is None
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        chosen = set()
        for n in range(5):
            done = final(await collect(supervisor, text(request_id=f"same{n}")))
            assert isinstance(done, DoneEvent)
            chosen.add(done.timings.workers["prefill"])
        nursery.cancel_scope.cancel()
    assert len(chosen) == 1  # the same prompt prefix goes to the same prefill worker
