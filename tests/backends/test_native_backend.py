"""The native backend against a real WorkerServer (and hand-written fakes) over memory streams.

Every test runs on ``autojump_clock``; waits are powers of two so virtual times
add up exactly.  The backend's ``connect`` is a :class:`WorkerLink`, which opens
a ``trio.testing.memory_stream_pair`` per attempt and serves the far end with a
real ``WorkerServer.handle_stream`` or a :class:`RawWorker` that speaks the
codec by hand (for faults a well-behaved worker never commits).
"""

from __future__ import annotations

import errno
import logging
import math
import random
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.addresses import Address
from epd_actors.backends.base import BackendStatus
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.errors import (
    ConfigError,
    ConnectionLost,
    LocalProtocolError,
    RemoteWorkerError,
    StreamOverrun,
    WorkerDisconnected,
)
from epd_actors.protocol import (
    PROTOCOL_VERSION,
    TRACEPARENT_CAPABILITY,
    Abort,
    Aborted,
    Delta,
    EncodeRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Hello,
    MediaItem,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    Prompt,
    Role,
    StageResult,
    Usage,
    Welcome,
    WorkerStats,
)
from epd_actors.protocol.codec import HEADER, FrameDecoder, encode
from epd_actors.transport.framed import FramedStream
from epd_actors.worker.runtime import WorkerConfig, WorkerServer
from tests.fakes import ENGINE_FAILURES, ScriptedEngine, engine_error

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    Serve = Callable[[trio.abc.Stream], Awaitable[None]]
    Script = Callable[[Message], list[Message | bytes]]

TOKEN = "s3cret"
ADDRESS = Address("tcp", host="worker.invalid", port=7000)  # never dialled: tests pass connect=
FAST = NativeSettings(
    reconnect_backoff_start_s=0.25, reconnect_backoff_max_s=1.0, reconnect_jitter=0.0
)
GUARD_S = 600.0  # virtual seconds: a hung test fails instead of spinning the autojump clock
LOGGER = "epd_actors.backends.native.backend"


def make_server(engine: ScriptedEngine | None = None, **overrides: object) -> WorkerServer:
    options: dict[str, object] = {"worker_id": "w1", "auth_token": TOKEN}
    options.update(overrides)
    return WorkerServer(engine or ScriptedEngine(), WorkerConfig(**options))  # type: ignore[arg-type]


def prefill(request_id: str) -> PrefillRequest:
    return PrefillRequest(request_id, Prompt(text="hi"))


def generate(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, Prompt(text="hello"))


def log_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


class WorkerLink:
    """The backend's ``connect``: one memory stream pair per attempt, far end served here.

    ``first`` serves the first connections (one each), then ``serve`` every
    later one.  ``refuse`` / ``hang`` make that many upcoming attempts fail with
    ECONNREFUSED / never return; ``down`` refuses every attempt.  ``attempts``
    holds the virtual time of each attempt, relative to the link's creation.
    """

    def __init__(
        self, serve: Serve, *, first: tuple[Serve, ...] = (), refuse: int = 0, hang: int = 0
    ) -> None:
        self.serve = serve
        self.first = list(first)
        self.refuse = refuse
        self.hang = hang
        self.down = False
        self.nursery: trio.Nursery | None = None
        self.attempts: list[float] = []
        self.worker_ends: list[trio.abc.Stream] = []
        self.client_ends: list[RecordingStream] = []
        self._t0 = trio.current_time()

    async def connect(self) -> trio.abc.Stream:
        self.attempts.append(trio.current_time() - self._t0)
        if self.hang:
            self.hang -= 1
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        if self.down or self.refuse:
            self.refuse = max(0, self.refuse - 1)
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")
        client_end, worker_end = trio.testing.memory_stream_pair()
        serve = self.first.pop(0) if self.first else self.serve
        assert self.nursery is not None
        self.nursery.start_soon(serve, worker_end)
        self.worker_ends.append(worker_end)
        recording = RecordingStream(client_end)
        self.client_ends.append(recording)
        return recording

    async def cut(self) -> None:
        """Close the worker's end of the latest connection."""
        await self.worker_ends[-1].aclose()


class RecordingStream(trio.abc.Stream):
    """The router's end of a connection, recording every ``send_all`` as the
    messages it carried.  ``stall``: while set, a ``send_all`` waits for it
    before writing anything; ``delay``: each ``send_all`` first sleeps this long."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes: list[list[Message]] = []
        self.stall: trio.Event | None = None
        self.delay = 0.0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(FrameDecoder().feed_all(data))
        if self.stall is not None:
            await self.stall.wait()
        if self.delay:
            await trio.sleep(self.delay)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


IDLE = WorkerStats(running=0, queued=0, draining=False, engine_ready=True)
WELCOME = Welcome(PROTOCOL_VERSION, "raw", Role.PREFILL.value, "raw-model")


class RawWorker:
    """A worker spoken by hand: welcomes, answers pings, and answers every other
    message with what ``script`` returns (messages, or raw bytes written as they are)."""

    def __init__(self, script: Script, *, pongs: bool = True) -> None:
        self.script = script
        self.pongs = pongs
        self.received: list[Message] = []

    async def serve(self, stream: trio.abc.Stream) -> None:
        framed = FramedStream(stream, peer="router")
        try:
            assert isinstance(await framed.receive(), Hello)
            await framed.send(WELCOME)
            while (message := await framed.receive()) is not None:
                if isinstance(message, Ping):
                    if self.pongs:
                        await framed.send(Pong(message.nonce, IDLE))
                    continue
                self.received.append(message)
                for reply in self.script(message):
                    if isinstance(reply, bytes):
                        await stream.send_all(reply)
                    else:
                        await framed.send(reply)
        except ConnectionLost:
            pass
        finally:
            await framed.aclose()


async def silent(stream: trio.abc.Stream) -> None:
    """A worker that accepts and never says a word."""
    async with stream:
        await trio.sleep_forever()


@asynccontextmanager
async def harness(
    link: WorkerLink,
    *,
    settings: NativeSettings = FAST,
    auth_token: str = TOKEN,
    rng: random.Random | None = None,
    connected: bool = True,
) -> AsyncIterator[NativeBackend]:
    backend = NativeBackend(
        "w1", ADDRESS, auth_token=auth_token, settings=settings, connect=link.connect, rng=rng
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            link.nursery = nursery
            await nursery.start(backend.run)
            if connected:
                await backend.wait_connected()
            yield backend
            nursery.cancel_scope.cancel(reason="test finished")


async def enter(context: AbstractAsyncContextManager[object]) -> None:
    async with context:
        pass


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("connect_timeout_s", 0.0),
        ("abort_timeout_s", math.inf),
        ("heartbeat_timeout_s", 0.5),
        ("reconnect_backoff_max_s", 0.01),
        ("reconnect_jitter", 1.5),
        ("request_buffer", 0),
        ("max_frame_bytes", -1),
    ],
    ids=lambda v: str(v),
)
def test_invalid_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        NativeSettings(**{field: value})  # type: ignore[arg-type]


# ---------------------------------------------------------------- handshake


async def run_on_an_engine_that_goes_down(backend: NativeBackend, request_id: str) -> None:
    with pytest.raises(WorkerDisconnected, match="engine not ready"):
        await backend.run_stage(prefill(request_id))


async def test_handshake_stores_welcome_and_heartbeats_report_load(autojump_clock: object) -> None:
    engine = ScriptedEngine(model="tiny", gate=trio.Event())
    server = make_server(engine, max_concurrency=7)
    async with harness(WorkerLink(server.handle_stream)) as backend:
        assert backend.welcome == Welcome(
            PROTOCOL_VERSION, "w1", "decode", "tiny", (TRACEPARENT_CAPABILITY,), 7
        )
        await trio.testing.wait_all_tasks_blocked()
        assert backend.status() == BackendStatus(
            connected=True, draining=False, ready=True, worker_aborts=0, max_concurrency=7
        )

        async with trio.open_nursery() as nursery:
            for request_id in ("a", "b"):
                nursery.start_soon(run_on_an_engine_that_goes_down, backend, request_id)
            await trio.sleep(1.5)  # the ping at 1.0 reports both requests
            assert backend.status().worker_load == 2
            engine.ready = False
            await trio.sleep(1.0)
            assert backend.status().ready is False
        assert sorted(engine.aborted) == ["a", "b"]  # the requests were aborted there
        stats = backend.statistics()
        assert (stats.connects, stats.role, stats.model, stats.last_rtt_s) == (
            1,
            "decode",
            "tiny",
            0.0,
        )
        assert repr(backend) == f"<NativeBackend w1 {ADDRESS} connected in_flight=0>"
        with pytest.raises(trio.BusyResourceError):
            await backend.run()


async def test_rejected_handshake_is_logged_and_retried_at_the_longest_backoff(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server()
    link = WorkerLink(server.handle_stream)
    async with harness(link, auth_token="wrong", connected=False) as backend:
        await trio.sleep(1.5)
        assert link.attempts == [0.0, 1.0]
        assert backend.statistics().handshake_rejections == 2
        with pytest.raises(WorkerDisconnected):
            await backend.run_stage(prefill("p"))
        server.config = replace(server.config, auth_token="wrong")  # the operator fixes it
        await backend.wait_connected()
        assert link.attempts == [0.0, 1.0, 2.0]
    errors = log_records(caplog, logging.ERROR)
    assert len(errors) == 2
    assert all("rejected our hello: unauthorized" in message for message in errors)
    assert all("wrong" not in message for message in errors)


@pytest.mark.parametrize(
    ("stall", "expected"), [("dial", 4.0 + 0.25), ("handshake", 2.0 + 0.25)], ids=str
)
async def test_stalled_attempts_are_abandoned_after_their_timeout(
    autojump_clock: object, stall: str, expected: float
) -> None:
    settings = replace(FAST, connect_timeout_s=4.0, handshake_timeout_s=2.0)
    server = make_server()
    if stall == "dial":
        link = WorkerLink(server.handle_stream, hang=1)
    else:
        link = WorkerLink(server.handle_stream, first=(silent,))
    async with harness(link, settings=settings, connected=False) as backend:
        assert backend.status().connected is False  # run() reported started at once
        await backend.wait_connected()
        assert link.attempts == [0.0, expected]
        assert backend.statistics().connect_failures == 1


class HalfRandom(random.Random):
    """An rng whose every draw is 0.5, so jittered waits are exact."""

    def random(self) -> float:
        return 0.5


async def test_reconnect_waits_double_with_jitter_up_to_the_limit(autojump_clock: object) -> None:
    link = WorkerLink(make_server().handle_stream, refuse=4)
    settings = replace(FAST, reconnect_jitter=0.5)
    async with harness(link, settings=settings, rng=HalfRandom()) as backend:
        # Waits of 0.25, 0.5, 1.0, 1.0 (the limit), each times (1 - 0.5 * 0.5).
        assert link.attempts == [0.0, 0.1875, 0.5625, 1.3125, 2.0625]
        assert backend.statistics().connect_failures == 4


async def test_not_connected_fails_at_once() -> None:
    backend = NativeBackend("w1", ADDRESS, auth_token=TOKEN)
    with pytest.raises(WorkerDisconnected) as info:
        await backend.run_stage(prefill("p"))
    assert info.value.retryable
    with pytest.raises(WorkerDisconnected):
        await enter(backend.open_stream(generate("g")))
    with pytest.raises(WorkerDisconnected):
        await backend.release({"handle": "h"})
    assert backend.status() == BackendStatus(connected=False, draining=False, ready=False)
    assert backend.statistics().in_flight == 0
    assert "disconnected" in repr(backend)


# ---------------------------------------------------------------- requests


async def test_run_stage_returns_each_stage_result(autojump_clock: object) -> None:
    async with harness(WorkerLink(make_server().handle_stream)) as backend:
        media = MediaItem("image/png", b"\x89PNG", "ab" * 32)
        encoded = await backend.run_stage(EncodeRequest("e1", (media,)))
        assert encoded.ec_transfer_params == {"ab" * 32: {"by": "fake"}}
        prefilled = await backend.run_stage(prefill("p1"))
        assert prefilled == StageResult("p1", kv_transfer_params={"handle": "p1"}, prompt_tokens=5)
        assert backend.statistics().in_flight == 0


@pytest.mark.parametrize(("failure", "code", "retryable"), ENGINE_FAILURES)
async def test_error_replies_become_typed_remote_errors(
    autojump_clock: object, failure: BaseException, code: str, retryable: bool
) -> None:
    server = make_server(ScriptedEngine(fail_with=failure))
    async with harness(WorkerLink(server.handle_stream)) as backend:
        with pytest.raises(RemoteWorkerError) as info:
            await backend.run_stage(prefill("p"))
        error = info.value
        assert (error.code, error.retryable) == (code, retryable)
        assert (error.worker_id, error.stage, error.request_id) == ("w1", "prefill", "p")
        assert backend.statistics().in_flight == 0


async def test_stream_yields_deltas_then_end_of_channel(autojump_clock: object) -> None:
    engine = ScriptedEngine(tokens=3, token_delay=1.0)
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        start = trio.current_time()
        async with backend.open_stream(generate("g")) as stream:
            deltas = [await stream.receive()]
            while deltas[-1].finish_reason is None:
                deltas.append(await stream.receive())
            with pytest.raises(trio.EndOfChannel):
                await stream.receive()
        # The worker may merge the last token into the terminal delta.
        assert "".join(d.text for d in deltas) == "t0 t1 t2 "
        assert deltas[-1].usage == Usage(prompt_tokens=5, completion_tokens=3)
        assert trio.current_time() - start == 3.0
        async with backend.open_stream(generate("g")) as stream:
            texts = [delta.text async for delta in stream]
        assert "".join(texts) == "t0 t1 t2 "
        assert engine.aborted == []
        assert backend.statistics().aborts_sent == 0


async def test_a_sink_takes_deltas_directly_and_never_out_of_order(
    autojump_clock: object,
) -> None:
    """A refused delta is queued, and so is every later one until the reader catches up."""
    engine = ScriptedEngine(tokens=8, token_delay=1.0)
    offered: list[str] = []
    taken: list[str] = []

    def sink(delta: Delta) -> bool:
        offered.append(delta.text)
        if delta.text == "t2 ":
            return False  # as a relay whose caller's buffer is full
        taken.append(delta.text)
        return True

    async with (
        harness(WorkerLink(make_server(engine).handle_stream)) as backend,
        backend.open_stream(generate("g")) as stream,
    ):
        stream.set_sink(sink)
        received = [await stream.receive()]  # t2: t0 and t1 went to the sink
        await trio.sleep(2.5)  # t3 and t4 arrive while this reader is behind
        while received[-1].finish_reason is None:
            received.append(await stream.receive())
    texts = [d.text for d in received]
    assert offered[:5] == ["t0 ", "t1 ", "t2 ", "t5 ", "t6 "]  # not t3, t4: queued behind t2
    assert taken[:4] == ["t0 ", "t1 ", "t5 ", "t6 "]  # caught up, the sink takes deltas again
    assert texts[:3] == ["t2 ", "t3 ", "t4 "]
    # t7 comes last either way: alone, or merged by the worker into the terminal delta.
    assert "".join(taken[:2] + texts[:3] + taken[2:] + texts[3:]) == "t0 t1 t2 t3 t4 t5 t6 t7 "
    assert received[-1].finish_reason == "length"  # the terminal delta is always queued
    assert backend.statistics().in_flight == 0


async def stream_one_read(
    frames: list[Delta], *, sink_takes: bool
) -> tuple[list[Delta], list[Delta]]:
    """Stream a request whose worker answers with ``frames`` (their request ids set)
    in one write, through a sink that takes (or refuses) every delta it is offered.

    Returns what the sink was offered and what the stream's reader received.
    """

    def one_write(message: Message) -> list[Message | bytes]:
        rid = message.request_id
        return [b"".join(encode(replace(frame, request_id=rid)) for frame in frames)]

    offered: list[Delta] = []

    def sink(delta: Delta) -> bool:
        offered.append(delta)
        return sink_takes

    async with (
        harness(WorkerLink(RawWorker(one_write).serve)) as backend,
        backend.open_stream(generate("g")) as stream,
    ):
        stream.set_sink(sink)
        received = [delta async for delta in stream]
    return offered, received


@pytest.mark.parametrize("sink_takes", [True, False], ids=["taken", "refused"])
async def test_the_deltas_of_one_read_reach_the_sink_merged_and_before_the_end(
    autojump_clock: object, sink_takes: bool
) -> None:
    deltas = [Delta("", token_ids=(n,), text=f"t{n} ") for n in range(3)]
    end = Delta("", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3))
    offered, received = await stream_one_read([*deltas, end], sink_takes=sink_takes)
    assert [(d.token_ids, d.text) for d in offered] == [((0, 1, 2), "t0 t1 t2 ")]
    expected = [] if sink_takes else offered  # refused: queued ahead of the end
    assert received[:-1] == expected
    assert received[-1].finish_reason == "stop"


async def test_deltas_of_one_read_are_not_merged_when_that_would_drop_logprobs(
    autojump_clock: object,
) -> None:
    frames = [
        Delta("", token_ids=(0,), text="a", logprobs=(-0.5,)),
        Delta("", token_ids=(1,), text="b"),
        Delta("", finish_reason="stop"),
    ]
    offered, _ = await stream_one_read(frames, sink_takes=True)
    assert [(d.text, d.logprobs) for d in offered] == [("a", (-0.5,)), ("b", None)]


async def test_error_mid_stream_is_raised_after_the_deltas_before_it(
    autojump_clock: object,
) -> None:
    engine = ScriptedEngine(tokens=4, token_delay=1.0, fail_after_tokens=engine_error())
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        async with backend.open_stream(generate("g")) as stream:
            assert (await stream.receive()).text == "t0 "
            with pytest.raises(RemoteWorkerError) as info:
                await stream.receive()
        assert (info.value.code, info.value.stage) == ("engine_error", "generate")
        assert backend.statistics().in_flight == 0


async def test_many_requests_are_multiplexed_on_one_connection(autojump_clock: object) -> None:
    server = make_server(ScriptedEngine(tokens=4, token_delay=1.0))
    link = WorkerLink(server.handle_stream)
    results: dict[str, object] = {}
    async with harness(link) as backend:

        async def stream_one(request_id: str) -> None:
            async with backend.open_stream(generate(request_id)) as stream:
                results[request_id] = "".join([delta.text async for delta in stream])

        async def stage_one(request_id: str) -> None:
            results[request_id] = (await backend.run_stage(prefill(request_id))).kv_transfer_params

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(stream_one, f"g{i}")
                nursery.start_soon(stage_one, f"p{i}")
            await trio.testing.wait_all_tasks_blocked()
            assert backend.statistics().in_flight == 40  # the prefills are done already
        assert trio.current_time() - start == 4.0
        assert results == {f"g{i}": "t0 t1 t2 t3 " for i in range(40)} | {
            f"p{i}": {"handle": f"p{i}"} for i in range(40)
        }
        assert len(link.attempts) == 1
        assert backend.statistics().in_flight == 0
        assert server.statistics().requests_total == 80


async def test_duplicate_request_id_is_refused_locally(autojump_clock: object) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        async with backend.open_stream(generate("same")):
            with pytest.raises(LocalProtocolError):
                await backend.run_stage(prefill("same"))
            assert backend.statistics().in_flight == 1
        assert backend.statistics().in_flight == 0


async def test_release_round_trip(autojump_clock: object) -> None:
    engine = ScriptedEngine(role=Role.PREFILL)
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        assert await backend.release({"handle": "h1"}) is True
        assert await backend.release({}) is False
        assert engine.released == [{"handle": "h1"}, {}]
        assert backend.statistics().in_flight == 0


# ---------------------------------------------------------------- cancellation and abort


async def test_cancelled_run_stage_aborts_on_the_worker(autojump_clock: object) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        start = trio.current_time()
        with trio.move_on_after(4.0) as scope:
            await backend.run_stage(prefill("p"))
        assert scope.cancelled_caught
        assert trio.current_time() - start == 4.0  # Aborted came back at once
        assert engine.aborted == ["p"]
        stats = backend.statistics()
        assert (stats.in_flight, stats.aborts_sent) == (0, 1)
        engine.gate.set()  # type: ignore[union-attr]
        assert (await backend.run_stage(prefill("p"))).prompt_tokens == 5  # the id is free again


@pytest.mark.parametrize("cancel_after", [0.0, 0.5, 2.5], ids=lambda t: f"after-{t}s")
async def test_cancelled_stream_aborts_and_unregisters(
    autojump_clock: object, cancel_after: float
) -> None:
    engine = ScriptedEngine(tokens=8, token_delay=1.0)
    server = make_server(engine)
    async with harness(WorkerLink(server.handle_stream)) as backend:
        received: list[Delta] = []
        with trio.move_on_after(cancel_after):
            async with backend.open_stream(generate("g")) as stream:
                async for delta in stream:
                    received.append(delta)
        assert len(received) == int(cancel_after)
        assert engine.aborted == ["g"]
        assert server.statistics().aborts_total == 1
        assert backend.statistics().in_flight == 0


async def test_leaving_a_stream_context_early_aborts(autojump_clock: object) -> None:
    engine = ScriptedEngine(tokens=8, token_delay=1.0)
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        async with backend.open_stream(generate("g")) as stream:
            assert (await stream.receive()).text == "t0 "
        assert engine.aborted == ["g"]
        assert backend.statistics().in_flight == 0


async def test_abort_waits_for_aborted_at_most_abort_timeout(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    raw = RawWorker(lambda message: [])  # answers nothing, not even Abort
    async with harness(WorkerLink(raw.serve)) as backend:
        start = trio.current_time()
        with trio.move_on_after(1.0):
            await backend.run_stage(prefill("p"))
        assert trio.current_time() - start == 1.0 + FAST.abort_timeout_s
        assert raw.received == [prefill("p"), Abort("p")]
        assert backend.statistics().in_flight == 0
    assert any("did not confirm the abort" in m for m in log_records(caplog, logging.WARNING))


async def test_slow_consumer_overruns_only_its_own_stream(autojump_clock: object) -> None:
    engine = ScriptedEngine(tokens=12, token_delay=1.0)
    server = make_server(engine)
    link = WorkerLink(server.handle_stream)
    fast: list[Delta] = []
    async with harness(link, settings=replace(FAST, request_buffer=4)) as backend:

        async def read_fast() -> None:
            async with backend.open_stream(generate("fast")) as stream:
                fast.extend([delta async for delta in stream])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_fast)
            async with backend.open_stream(generate("slow")) as slow:
                await trio.sleep(4.5)  # four deltas fill the buffer of four
                assert backend.statistics().overruns == 0
                await trio.sleep(1.0)  # the fifth overruns it
                assert backend.statistics().overruns == 1
                assert engine.aborted == ["slow"]
                with pytest.raises(StreamOverrun):
                    await slow.receive()
        assert "".join(delta.text for delta in fast) == "".join(f"t{i} " for i in range(12))
        assert fast[-1].finish_reason == "length"
        assert server.statistics().aborts_total == 1
        stats = backend.statistics()
        assert (stats.overruns, stats.aborts_sent, stats.in_flight) == (1, 1, 0)
        assert len(link.attempts) == 1


# ---------------------------------------------------------------- connection failures


async def test_connection_loss_fails_in_flight_then_reconnects_with_backoff(
    autojump_clock: object,
) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    link = WorkerLink(make_server(engine).handle_stream)
    async with harness(link) as backend:
        async with backend.open_stream(generate("g")) as stream:
            await trio.testing.wait_all_tasks_blocked()
            link.refuse = 2
            cut_at = trio.current_time()
            await link.cut()
            with pytest.raises(WorkerDisconnected):
                await stream.receive()
        assert backend.status().connected is False
        await backend.wait_connected()
        assert [t - cut_at for t in link.attempts[1:]] == [0.25, 0.75, 1.75]
        engine.gate.set()  # type: ignore[union-attr]
        assert (await backend.run_stage(prefill("p"))).prompt_tokens == 5
        # The backoff starts over after a connection that was welcomed.
        cut_at = trio.current_time()
        await link.cut()
        await trio.testing.wait_all_tasks_blocked()
        await backend.wait_connected()
        assert link.attempts[-1] - cut_at == 0.25
        stats = backend.statistics()
        assert (stats.connects, stats.disconnects, stats.connect_failures) == (3, 2, 2)


async def test_missed_pongs_declare_the_connection_dead(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(ScriptedEngine(gate=trio.Event()), heartbeat_drop=True)
    async with harness(WorkerLink(server.handle_stream)) as backend:
        connected_at = trio.current_time()
        async with backend.open_stream(generate("g")) as stream:
            with pytest.raises(WorkerDisconnected, match=r"no pong for 3\.0 s"):
                await stream.receive()
        assert trio.current_time() - connected_at == FAST.heartbeat_timeout_s
        assert backend.statistics().disconnects == 1
    assert any("no pong" in m for m in log_records(caplog, logging.ERROR))


async def test_slow_pongs_within_the_timeout_keep_the_connection(autojump_clock: object) -> None:
    link = WorkerLink(make_server(heartbeat_delay_s=2.5).handle_stream)
    async with harness(link) as backend:
        await trio.sleep(32.0)
        stats = backend.statistics()
        assert (stats.disconnects, stats.last_rtt_s) == (0, 2.5)
        assert len(link.attempts) == 1


async def test_goodbye_drains_until_a_new_connection(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    server = make_server(engine)
    link = WorkerLink(server.handle_stream)
    async with harness(link) as backend:
        async with backend.open_stream(generate("in-flight")) as stream:
            await trio.testing.wait_all_tasks_blocked()
            server.begin_drain("maintenance")
            link.down = True
            await trio.testing.wait_all_tasks_blocked()
            assert backend.status().draining
            with pytest.raises(RemoteWorkerError) as info:
                await backend.run_stage(prefill("late"))
            assert (info.value.code, info.value.retryable) == ("draining", True)
            assert engine.started == ["in-flight"]
            assert await backend.release({"handle": "h"}) is True  # releases still go through
            engine.gate.set()  # type: ignore[union-attr]
            deltas = [delta async for delta in stream]
            assert deltas[-1].finish_reason == "length"
        await trio.testing.wait_all_tasks_blocked()  # the drained worker hangs up
        assert backend.status() == BackendStatus(connected=False, draining=True, ready=False)
        link.serve = make_server().handle_stream
        link.down = False
        await backend.wait_connected()
        assert backend.status().draining is False
        assert "connected" in repr(backend)
    assert log_records(caplog, logging.ERROR) == []  # an expected hang-up


def _garbage(message: Message) -> list[Message | bytes]:
    return [HEADER.pack(3) + b"\xc1\xc1\xc1"]


@pytest.mark.parametrize(
    "script",
    [
        _garbage,
        lambda message: [HEADER.pack(1 << 30)],
        lambda message: [Ping(7)],
        lambda message: [WELCOME],
        lambda message: [Delta(message.request_id, text="?")],
        lambda message: [ErrorReply("", ErrorCode.INTERNAL, "confused")],
    ],
    ids=[
        "garbage",
        "oversized-frame",
        "client-only-message",
        "second-welcome",
        "wrong-reply-kind",
        "connection-error",
    ],
)
async def test_worker_faults_close_the_connection_and_reconnect(
    autojump_clock: object, caplog: pytest.LogCaptureFixture, script: Script
) -> None:
    raw = RawWorker(script)
    link = WorkerLink(make_server().handle_stream, first=(raw.serve,))
    async with harness(link) as backend:
        with pytest.raises(WorkerDisconnected):
            await backend.run_stage(prefill("p"))
        await backend.wait_connected()
        assert (await backend.run_stage(prefill("p"))).prompt_tokens == 5
        assert link.attempts == [0.0, 0.25]
    assert len(log_records(caplog, logging.ERROR)) == 1


async def test_replies_for_unknown_requests_are_ignored(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)

    def script(message: Message) -> list[Message | bytes]:
        return [
            Aborted("ghost"),
            StageResult("nobody"),
            Delta("gone", text="?"),
            StageResult(message.request_id, prompt_tokens=9),
        ]

    link = WorkerLink(RawWorker(script).serve)
    async with harness(link) as backend:
        assert (await backend.run_stage(prefill("p"))).prompt_tokens == 9
        assert backend.status().connected
        assert len(link.attempts) == 1
    ignored = [m for m in log_records(caplog, logging.DEBUG) if "ignoring" in m]
    assert len(ignored) == 3


async def test_cancelling_run_closes_the_connection_and_fails_in_flight(
    autojump_clock: object,
) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    server = make_server(engine)
    link = WorkerLink(server.handle_stream)
    backend = NativeBackend("w1", ADDRESS, auth_token=TOKEN, settings=FAST, connect=link.connect)
    run_scope = trio.CancelScope()

    async def run_backend() -> None:
        with run_scope:
            await backend.run()

    async with trio.open_nursery() as nursery:
        link.nursery = nursery
        nursery.start_soon(run_backend)
        await backend.wait_connected()
        async with backend.open_stream(generate("g")) as stream:
            await trio.testing.wait_all_tasks_blocked()
            run_scope.cancel(reason="router shutting down")
            with pytest.raises(WorkerDisconnected):
                await stream.receive()
        assert backend.status().connected is False
        await trio.testing.wait_all_tasks_blocked()
        assert engine.aborted == ["g"]
        assert server.statistics().connections == 0
        nursery.cancel_scope.cancel(reason="test finished")


# ---------------------------------------------------------------- the connection's writer


def kinds(write: list[Message]) -> list[str]:
    return [message.TAG for message in write]


async def test_a_burst_of_requests_is_written_in_few_writes(autojump_clock: object) -> None:
    link = WorkerLink(make_server(max_concurrency=1000).handle_stream)
    async with harness(link) as backend:
        await trio.testing.wait_all_tasks_blocked()
        stream = link.client_ends[-1]
        before = len(stream.writes)
        results: dict[str, int] = {}

        async def one(request_id: str) -> None:
            results[request_id] = (await backend.run_stage(prefill(request_id))).prompt_tokens

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, f"p{i}")
        assert results == {f"p{i}": 5 for i in range(1000)}
        burst = stream.writes[before:]
        assert [kinds(write) for write in burst] == [["prefill"] * 1000]
        stats = backend.statistics()
        assert (stats.writes, stats.frames_written) == (len(stream.writes) - 1, 1001)  # + a ping


async def test_a_full_write_queue_makes_requests_wait_for_room(autojump_clock: object) -> None:
    link = WorkerLink(make_server(max_concurrency=1000).handle_stream)
    async with harness(link, settings=replace(FAST, write_queue_frames=100)) as backend:
        await trio.testing.wait_all_tasks_blocked()
        stream = link.client_ends[-1]
        before = len(stream.writes)
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(backend.run_stage, prefill(f"p{i}"))
        burst = [write for write in stream.writes[before:] if "ping" not in kinds(write)]
        assert [len(write) for write in burst] == [100] * 10
        written = [message.request_id for write in burst for message in write]  # type: ignore[attr-defined]
        assert sorted(written) == sorted(f"p{i}" for i in range(1000))  # each once
        assert backend.statistics().in_flight == 0


async def test_a_ping_is_written_ahead_of_a_full_data_queue(autojump_clock: object) -> None:
    settings = replace(FAST, write_queue_frames=4)
    link = WorkerLink(make_server().handle_stream)
    async with harness(link, settings=settings) as backend:
        await trio.testing.wait_all_tasks_blocked()  # the first ping is answered
        stream = link.client_ends[-1]
        stream.stall = trio.Event()  # the worker stops reading
        done: list[str] = []

        async def one(request_id: str) -> None:
            await backend.run_stage(prefill(request_id))
            done.append(request_id)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, f"p{i}")
            await trio.sleep(1.5)  # the second ping is due at 1.0, behind 4 + 4 queued requests
            assert backend.statistics().in_flight == 20
            assert kinds(stream.writes[-1]) == ["prefill"] * 4  # the write that is stuck
            stream.stall.set()
        assert sorted(done) == sorted(f"p{i}" for i in range(20))
        # The next write after the stuck one: the ping first, then the next four requests.
        ping_write = next(w for w in stream.writes if Ping(2) in w)
        assert kinds(ping_write) == ["ping"] + ["prefill"] * 4
        stats = backend.statistics()
        assert (stats.disconnects, stats.last_rtt_s) == (0, 0.5)
        assert len(link.attempts) == 1


async def test_a_stalled_worker_trips_the_write_timeout(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    settings = replace(FAST, write_timeout_s=2.0, heartbeat_timeout_s=8.0)
    link = WorkerLink(make_server().handle_stream)
    async with harness(link, settings=settings) as backend:
        await trio.testing.wait_all_tasks_blocked()
        link.client_ends[-1].stall = trio.Event()  # never set: the worker reads no more
        errors: list[BaseException] = []
        start = trio.current_time()

        async def one(request_id: str) -> None:
            try:
                await backend.run_stage(prefill(request_id))
            except WorkerDisconnected as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, f"p{i}")
        assert trio.current_time() - start == 2.0
        assert len(errors) == 3
        assert all("took over 2.0 s" in str(error) for error in errors)
        assert all(isinstance(error, WorkerDisconnected) and error.retryable for error in errors)
        assert backend.statistics().in_flight == 0
        await backend.wait_connected()  # a fresh connection, not stalled
        assert (await backend.run_stage(prefill("p"))).prompt_tokens == 5
        assert backend.statistics().disconnects == 1
    assert any("took over 2.0 s" in m for m in log_records(caplog, logging.ERROR))


async def test_time_queued_does_not_count_against_the_write_timeout(
    autojump_clock: object,
) -> None:
    settings = replace(FAST, write_timeout_s=2.0, heartbeat_timeout_s=8.0)
    link = WorkerLink(make_server().handle_stream)
    async with harness(link, settings=settings) as backend:
        await trio.testing.wait_all_tasks_blocked()
        link.client_ends[-1].delay = 1.5  # every write takes 1.5 s: slow, within the limit
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend.run_stage, prefill("first"))
            await trio.sleep(0.25)
            # Queued behind the first write for 1.25 s, then written in 1.5 s.
            result = await backend.run_stage(prefill("second"))
        assert result.prompt_tokens == 5
        assert trio.current_time() - start == 3.0
        assert backend.statistics().disconnects == 0


async def test_a_request_cancelled_while_the_queue_is_full_sends_nothing(
    autojump_clock: object,
) -> None:
    settings = replace(FAST, write_queue_frames=1)
    raw = RawWorker(lambda message: [StageResult(message.request_id, prompt_tokens=1)])
    link = WorkerLink(raw.serve)
    async with harness(link, settings=settings) as backend:
        await trio.testing.wait_all_tasks_blocked()
        stream = link.client_ends[-1]
        stream.stall = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend.run_stage, prefill("written"))  # taken, write stuck
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(backend.run_stage, prefill("queued"))  # fills the queue
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5) as scope:
                await backend.run_stage(prefill("waiting"))  # finds the queue full
            assert scope.cancelled_caught
            assert backend.statistics().in_flight == 2
            stream.stall.set()
        assert raw.received == [prefill("written"), prefill("queued")]
        assert backend.statistics().aborts_sent == 0


async def test_an_abort_follows_a_request_still_queued(autojump_clock: object) -> None:
    settings = replace(FAST, write_queue_frames=1)

    def script(message: Message) -> list[Message | bytes]:
        if isinstance(message, Abort):
            return [Aborted(message.request_id)]
        return [StageResult(message.request_id)] if message.request_id == "written" else []

    raw = RawWorker(script)
    link = WorkerLink(raw.serve)
    async with harness(link, settings=settings) as backend:
        await trio.testing.wait_all_tasks_blocked()
        stream = link.client_ends[-1]
        stream.stall = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend.run_stage, prefill("written"))  # taken, write stuck
            await trio.testing.wait_all_tasks_blocked()

            async def give_up() -> None:
                with trio.move_on_after(0.5):
                    await backend.run_stage(prefill("queued"))  # queued, then given up

            nursery.start_soon(give_up)
            await trio.sleep(0.75)
            assert backend.statistics().aborts_sent == 1
            stream.stall.set()
        assert raw.received == [prefill("written"), prefill("queued"), Abort("queued")]
        assert [prefill("queued"), Abort("queued")] in stream.writes  # one write, in order
        assert backend.statistics().in_flight == 0


# ---------------------------------------------------------------- liveness


async def test_a_worker_streaming_data_is_alive_though_its_pongs_are_late(
    autojump_clock: object,
) -> None:
    engine = ScriptedEngine(tokens=16, token_delay=1.0)
    link = WorkerLink(make_server(engine, heartbeat_delay_s=5.0).handle_stream)
    async with harness(link) as backend:  # heartbeat_timeout_s is 3 s: every pong is late
        async with backend.open_stream(generate("g")) as stream:
            texts = [delta.text async for delta in stream]
        assert "".join(texts) == "".join(f"t{i} " for i in range(16))
        stats = backend.statistics()
        assert (stats.disconnects, stats.last_rtt_s) == (0, 5.0)
        assert len(link.attempts) == 1


# ---------------------------------------------------------------- the framed stream


async def test_receive_nowait_hands_out_the_frames_of_one_read() -> None:
    left, right = trio.testing.memory_stream_pair()
    sender, receiver = FramedStream(left), FramedStream(right)
    with pytest.raises(trio.WouldBlock):
        receiver.receive_nowait()  # nothing read yet; no I/O is attempted
    await sender.send_many([Ping(1), Ping(2), Ping(3)])
    assert await receiver.receive() == Ping(1)
    assert [receiver.receive_nowait(), receiver.receive_nowait()] == [Ping(2), Ping(3)]
    with pytest.raises(trio.WouldBlock):
        receiver.receive_nowait()
    assert receiver.frames_received == 3
    await sender.aclose()
    with pytest.raises(trio.WouldBlock):
        receiver.receive_nowait()  # the end of the stream is for receive() to report
    assert await receiver.receive() is None
