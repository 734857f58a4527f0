"""Faults on native worker connections, seen through a whole router.

Rows of the fault matrix in docs/reliability.md.  The router runs over
:mod:`tests.faults.wire_fleet`: real worker runtimes and simulated engines at
the far end of memory streams, on the virtual clock.  The per-connection
mechanics (each bad frame closes the connection, reconnect backoff, pongs) are
proven in ``tests/backends/test_native_backend.py``; these tests check what a *router*
promises: only the faulty connection's requests fail, with a typed error, the
other workers keep serving, the connection comes back and is used again, the
workers see their aborts and nothing leaks.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import pytest
import trio

from epd_actors import (
    ChatMessage,
    DoneEvent,
    GenerationRequest,
    MediaItem,
    Prompt,
    SamplingParams,
    StageTimeout,
)
from epd_actors.core.config import Deadlines
from epd_actors.core.health import HealthPolicy
from epd_actors.core.retry import RetryPolicy
from epd_actors.errors import AttemptTimeout, ConnectionLost, WorkerDisconnected
from epd_actors.protocol import (
    PROTOCOL_VERSION,
    Delta,
    GenerateRequest,
    Hello,
    Ping,
    Pong,
    Welcome,
    WorkerStats,
)
from epd_actors.protocol.codec import HEADER
from epd_actors.simulator.engine import SimConfig
from epd_actors.transport.framed import FramedStream

from .polling import wait_until
from .streams import Seen, consume, run_one
from .wire_fleet import SETTINGS, WireFleet, open_wire_router

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from epd_actors.backends.native.backend import NativeBackend
    from epd_actors.core.router import Router

GUARD_S = 600.0  # virtual seconds


def text(max_tokens: int = 4, tag: str = "q") -> GenerationRequest:
    return GenerationRequest(Prompt(text=f"about {tag}"), sampling=SamplingParams(max_tokens))


IMAGE = MediaItem.from_bytes(b"picture", "image/png")


def with_image(max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(
        Prompt(messages=(ChatMessage("user", ("look", 0)),)),
        media=(IMAGE,),
        sampling=SamplingParams(max_tokens),
    )


async def assert_no_leaks(fleet: WireFleet, router: Router) -> float:
    """Wait for cleanups still running (an abort waits for its ``Aborted``; bounded
    by ``abort_timeout_s``) and check nothing is left; returns the virtual wait."""
    start = trio.current_time()

    def busy() -> bool:
        pools = router.statistics().pools.values()
        backends = [cast("NativeBackend", b).statistics() for b in router.backends.values()]
        return any(m.in_flight for members in pools for m in members) or any(
            b.in_flight for b in backends
        )

    with trio.fail_after(5.0):
        await wait_until(lambda: not busy())
    stats = router.statistics()
    assert stats.supervisor.requests_in_flight == 0
    assert all(m.in_flight == 0 for members in stats.pools.values() for m in members)
    assert fleet.total("kv_handles_outstanding") == 0
    assert fleet.total("kv_handles_leaked") == 0
    assert fleet.total("in_flight") == 0
    for backend in router.backends.values():
        assert cast("NativeBackend", backend).statistics().in_flight == 0
    return trio.current_time() - start


# ---------------------------------------------------------------- a worker speaking nonsense

IDLE = WorkerStats(running=0, queued=0, draining=False, engine_ready=True)


async def serve_as_decoder(
    stream: trio.abc.Stream,
    worker_id: str,
    on_generate: Callable[[trio.abc.Stream, FramedStream, GenerateRequest], Awaitable[bool]],
) -> None:
    """Welcome the router as decode worker ``worker_id``, answer its pings, and hand
    each generate request to ``on_generate`` (True: hang up)."""
    framed = FramedStream(stream, peer="router")
    try:
        assert isinstance(await framed.receive(), Hello)
        await framed.send(Welcome(PROTOCOL_VERSION, worker_id, "decode", "sim-model"))
        while (message := await framed.receive()) is not None:
            if isinstance(message, Ping):
                await framed.send(Pong(message.nonce, IDLE))
            elif isinstance(message, GenerateRequest) and await on_generate(
                stream, framed, message
            ):
                return
    except (ConnectionLost, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await framed.aclose()


class BadWorker:
    """Welcomes, answers pings, holds the first generate request and answers the
    second with ``fault`` (raw bytes, or a message written with the codec)."""

    def __init__(self, fault: bytes | Callable[[], object]) -> None:
        self.fault = fault
        self.held = 0

    async def serve(self, stream: trio.abc.Stream) -> None:
        await serve_as_decoder(stream, "bad", self._on_generate)

    async def _on_generate(
        self, stream: trio.abc.Stream, framed: FramedStream, message: GenerateRequest
    ) -> bool:
        self.held += 1
        if self.held == 2:
            if isinstance(self.fault, bytes):
                await stream.send_all(self.fault)
            else:
                await framed.send(self.fault())  # type: ignore[arg-type]
        return False


FAULTS: dict[str, bytes | Callable[[], object]] = {
    "garbage-bytes": HEADER.pack(3) + b"\xc1\xc1\xc1",
    "oversized-frame-header": HEADER.pack(1 << 31),
    "wrong-type-message": lambda: Hello(PROTOCOL_VERSION, "x", "confused-worker"),
}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
async def test_a_bad_connection_fails_only_its_own_requests(
    autojump_clock: object, fault: bytes | Callable[[], object]
) -> None:
    bad = BadWorker(fault)
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            {"prefill": ["p0"], "decode": ["bad", "d1"]},
            configs={"d1": SimConfig(output_token_s=0.25)},
            first={"bad": [bad.serve]},
        ) as (fleet, router):
            seen = [Seen() for _ in range(4)]
            async with trio.open_nursery() as nursery:
                for n, outcome in enumerate(seen):
                    nursery.start_soon(consume, router, text(8, f"r{n}"), outcome)
            failed = [s for s in seen if s.error is not None]
            # least-in-flight put two on each decoder; both on the bad one fail,
            # typed, and nothing was retried (max_attempts=1 here).
            assert len(failed) == 2
            assert all(isinstance(s.error, WorkerDisconnected) for s in failed)
            assert all(s.tokens == 0 for s in failed)
            done = [s for s in seen if isinstance(s.final, DoneEvent)]
            assert len(done) == 2
            assert all(s.tokens == 8 for s in done)
            # The failed requests' prefilled KV handles were released on p0.
            assert fleet.counter("p0", "releases_found") == 2

            # The backend reconnects (now to a well-behaved runtime) and is used again.
            backend = cast("NativeBackend", router.backends["bad"])
            await backend.wait_ready()
            assert backend.statistics().connects == 2
            assert fleet.workers["bad"].connections == 2
            router.drain_worker("d1")
            again = await run_one(router, text(4))
            assert isinstance(again.final, DoneEvent)
            assert again.final.timings.workers["decode"] == ("bad",)
            await assert_no_leaks(fleet, router)


# ---------------------------------------------------------------- heartbeats and stalls


async def test_heartbeats_stop_while_data_flows(autojump_clock: object) -> None:
    """Every frame from the worker proves it alive, not only a Pong: a stream keeps
    its connection up while Pings go unanswered; once the data stops too, the
    connection is declared dead one timeout after the last frame."""
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            {"prefill": ["p0"], "decode": ["d0"]},
            configs={"d0": SimConfig(output_token_s=0.25)},
        ) as (fleet, router):
            d0 = fleet.workers["d0"].server
            backend = cast("NativeBackend", router.backends["d0"])
            timeout = backend.settings.heartbeat_timeout_s
            seen = Seen(first_token=trio.Event())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, router, text(400), seen)
                await seen.first_token.wait()  # type: ignore[union-attr]
                # From now on the worker ignores every Ping; tokens keep coming.
                d0.config = replace(d0.config, heartbeat_drop=True)
            # 100 s of tokens, far past the heartbeat timeout, on the same connection.
            assert isinstance(seen.final, DoneEvent)
            assert seen.tokens == 400
            assert backend.statistics().disconnects == 0
            last_frame_at = seen.ended_at
            await wait_until(lambda: backend.statistics().disconnects == 1)
            # Silent now: declared dead one timeout after its last frame.
            waited = trio.current_time() - last_frame_at
            assert abs(waited - timeout) < 0.01
            assert fleet.counter("d0", "aborts") == 0
            d0.config = replace(d0.config, heartbeat_drop=False)
            await backend.wait_ready()
            again = await run_one(router, text(4))
            assert isinstance(again.final, DoneEvent)
            assert backend.statistics().connects == 2
            await assert_no_leaks(fleet, router)


async def test_data_stalls_while_heartbeats_flow(autojump_clock: object) -> None:
    """The worker answers every Ping (slowly: 2 s of a 3 s budget) while its stream
    hangs: the connection is not declared dead, the breaker stays closed, and
    the request's own inter-token deadline ends it with an abort to the worker."""
    deadlines = Deadlines(inter_token_timeout_s=8.0)
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            {"prefill": ["p0"], "decode": ["d0"]},
            configs={"d0": SimConfig(output_token_s=0.25, stall_after_tokens=3)},
            worker_overrides={"d0": {"heartbeat_delay_s": 2.0}},
            deadlines=deadlines,
        ) as (fleet, router):
            backend = cast("NativeBackend", router.backends["d0"])
            seen = await run_one(router, text(40))
            assert isinstance(seen.error, StageTimeout)
            assert seen.error.phase == "inter_token"
            assert seen.tokens == 3
            stats = backend.statistics()
            assert (stats.connects, stats.disconnects) == (1, 0)
            assert backend.status().ready
            member = router.pools["decode"].get("d0")
            assert member is not None
            assert member.breaker.state.value == "closed"
            await assert_no_leaks(fleet, router)
            assert fleet.counter("d0", "aborts") == 1
            assert backend.statistics().aborts_sent == 1


STALLS = [
    # (stalled stage, layout, request, deadline that fires, its phase)
    ("encode", {"encode": ["e0"], "prefill": ["p0"], "decode": ["d0"]}, "image", "request"),
    ("prefill", {"prefill": ["p0"], "decode": ["d0"]}, "text", "request"),
    ("decode", {"prefill": ["p0"], "decode": ["d0"]}, "text", "first_token"),
    ("pd", {"pd": ["pd0"]}, "text", "first_token"),
]


@pytest.mark.parametrize(
    ("stage", "layout", "kind", "phase"), STALLS, ids=[f"stall-{s[0]}" for s in STALLS]
)
async def test_a_stalled_worker_is_cut_off_by_the_deadline_and_sees_the_abort(
    autojump_clock: object, stage: str, layout: dict[str, list[str]], kind: str, phase: str
) -> None:
    deadlines = Deadlines(request_timeout_s=16.0, first_token_timeout_s=4.0)
    stalled = layout[stage][0]
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            layout, configs={stalled: SimConfig(stall_s=math.inf)}, deadlines=deadlines
        ) as (fleet, router):
            start = trio.current_time()
            seen = await run_one(router, with_image() if kind == "image" else text())
            assert isinstance(seen.error, StageTimeout)
            assert seen.error.phase == phase
            expected = 16.0 if phase == "request" else None
            if expected is not None:
                assert seen.ended_at - start == expected
            else:
                # first-token deadline: counted from the output job's start
                assert seen.ended_at - start == pytest.approx(4.0, abs=0.05)
            await assert_no_leaks(fleet, router)
            assert fleet.counter(stalled, "aborts") == 1


INSTANT = SimConfig(
    encode_item_s=0.0, encode_kib_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0
)
HANGS = [
    ("encode", {"encode": ["e0", "e1"], "prefill": ["p0"], "decode": ["d0"]}, "encode_timeout_s"),
    ("prefill", {"prefill": ["p0", "p1"], "decode": ["d0"]}, "prefill_timeout_s"),
    ("decode", {"prefill": ["p0"], "decode": ["d0", "d1"]}, "first_token_timeout_s"),
    ("pd", {"pd": ["pd0", "pd1"]}, "first_token_timeout_s"),
]


@pytest.mark.parametrize(
    ("stage", "layout", "deadline"), HANGS, ids=[f"hang-{h[0]}" for h in HANGS]
)
async def test_a_hung_worker_is_aborted_charged_and_its_job_moves_to_another(
    autojump_clock: object, stage: str, layout: dict[str, list[str]], deadline: str
) -> None:
    """A stage deadline missed before any output is a worker failure, not the request's end."""
    hung, spare = layout[stage]
    configs = {w: INSTANT for ids in layout.values() for w in ids} | {
        hung: replace(INSTANT, stall_s=math.inf)
    }
    deadlines = replace(Deadlines(request_timeout_s=100.0), **{deadline: 4.0})
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            layout,
            configs=configs,
            deadlines=deadlines,
            retries=RetryPolicy(max_attempts=2, backoff_start_s=0.0, jitter=0.0),
            health=HealthPolicy(failure_threshold=1),
        ) as (fleet, router):
            seen = await run_one(router, with_image() if stage == "encode" else text())
            assert isinstance(seen.final, DoneEvent), seen.final
            assert seen.final.timings.workers[stage] == (spare,)
            assert seen.final.timings.stages[stage] == 4.0  # the deadline, then an instant retry
            assert fleet.counter(hung, "aborts") == 1
            breakers = {m.worker_id: m.breaker for m in router.statistics().pools[stage]}
            assert breakers == {hung: "open", spare: "closed"}
            assert router.statistics().actors[stage].retries_total == 1
            await assert_no_leaks(fleet, router)


async def test_a_hung_prefill_on_the_last_worker_left_is_a_prefill_timeout(
    autojump_clock: object,
) -> None:
    """With nowhere to move, the client sees the stage's own timeout, not the request's."""
    configs = {"p0": replace(INSTANT, stall_s=math.inf), "d0": INSTANT}
    deadlines = Deadlines(request_timeout_s=100.0, prefill_timeout_s=4.0)
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            {"prefill": ["p0"], "decode": ["d0"]},
            configs=configs,
            deadlines=deadlines,
            retries=RetryPolicy(max_attempts=3, backoff_start_s=0.0, jitter=0.0),
        ) as (fleet, router):
            start = trio.current_time()
            seen = await run_one(router, text())
            assert isinstance(seen.error, AttemptTimeout)
            assert (seen.error.phase, seen.error.worker_id) == ("prefill", "p0")
            assert seen.ended_at - start == 4.0
            assert fleet.counter("p0", "aborts") == 1
            assert fleet.counter("d0", "generate_requests") == 0
            await assert_no_leaks(fleet, router)


async def test_a_worker_whose_engine_goes_down_loses_its_waiting_requests_at_once(
    autojump_clock: object,
) -> None:
    """The connection stays up, but a ``Pong`` says the engine is not ready: its
    requests move to another worker then, not at the first-token deadline."""
    layout = {"prefill": ["p0"], "decode": ["d0", "d1"]}
    configs = {"p0": INSTANT, "d0": replace(INSTANT, stall_s=math.inf), "d1": INSTANT}
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            layout,
            configs=configs,
            retries=RetryPolicy(max_attempts=2, backoff_start_s=0.0, jitter=0.0),
        ) as (fleet, router):
            seen = Seen()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, router, text(), seen)
                await wait_until(lambda: fleet.counter("d0", "in_flight") == 1)
                wedged_at = trio.current_time()
                fleet.workers["d0"].engine.wedge()
            assert isinstance(seen.final, DoneEvent), seen.final
            assert seen.final.timings.workers["decode"] == ("d1",)
            # The next heartbeat's Pong carries the news.
            assert seen.ended_at - wedged_at <= SETTINGS.heartbeat_interval_s
            assert fleet.counter("d0", "aborts") == 1
            assert fleet.workers["d0"].connections == 1  # no reconnect: the link was fine
            await assert_no_leaks(fleet, router)


async def three_tokens_then_hang_up(stream: trio.abc.Stream) -> None:
    """A decode worker that streams three tokens of its first request and then vanishes."""

    async def three_tokens(
        stream: trio.abc.Stream, framed: FramedStream, message: GenerateRequest
    ) -> bool:
        for n in range(3):
            await trio.sleep(0.25)
            await framed.send(Delta(message.request_id, token_ids=(n,), text=f"t{n} "))
        return True

    await serve_as_decoder(stream, "dies", three_tokens)


async def test_a_stream_that_dies_after_tokens_handed_straight_to_the_caller_is_not_retried(
    autojump_clock: object,
) -> None:
    """The native reader gives the deltas to the caller itself; they still count as output."""
    with trio.fail_after(GUARD_S):
        async with open_wire_router(
            {"prefill": ["p0"], "decode": ["d0", "d1"]},
            first={"d0": [three_tokens_then_hang_up], "d1": [three_tokens_then_hang_up]},
            retries=RetryPolicy(max_attempts=3),
        ) as (fleet, router):
            seen = await run_one(router, text(8))
            assert seen.tokens == 3
            assert isinstance(seen.error, WorkerDisconnected)
            assert router.statistics().actors["decode"].retries_total == 0
            await assert_no_leaks(fleet, router)
