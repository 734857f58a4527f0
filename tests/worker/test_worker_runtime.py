"""The worker runtime over in-memory streams, with a scripted engine and a virtual clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.errors import EngineCrashed
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
    Goodbye,
    Hello,
    MediaItem,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    Prompt,
    Release,
    Released,
    Role,
    StageResult,
    Welcome,
)
from epd_actors.protocol.codec import HEADER, encode
from epd_actors.transport.framed import FramedStream
from epd_actors.worker.runtime import WorkerConfig, WorkerServer
from tests.fakes import ENGINE_FAILURES, ScriptedEngine, engine_crash, engine_error

if TYPE_CHECKING:
    from collections.abc import Callable

TOKEN = "s3cret"
GUARD_S = 10


def make_server(engine: ScriptedEngine | None = None, **overrides: object) -> WorkerServer:
    options: dict[str, object] = {"worker_id": "w1", "auth_token": TOKEN}
    options.update(overrides)
    return WorkerServer(engine or ScriptedEngine(), WorkerConfig(**options))  # type: ignore[arg-type]


async def connect(
    nursery: trio.Nursery,
    server: WorkerServer,
    *,
    token: str = TOKEN,
    pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] = trio.testing.memory_stream_pair,
) -> FramedStream:
    client_stream, server_stream = pair()
    nursery.start_soon(server.handle_stream, server_stream)
    client = FramedStream(client_stream, peer="test-client")
    await client.send(Hello(PROTOCOL_VERSION, token, "tester"))
    return client


async def welcomed(
    nursery: trio.Nursery,
    server: WorkerServer,
    pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] = trio.testing.memory_stream_pair,
) -> FramedStream:
    client = await connect(nursery, server, pair=pair)
    welcome = await client.receive()
    assert isinstance(welcome, Welcome)
    return client


async def receive(client: FramedStream) -> Message:
    message = await client.receive()
    assert message is not None
    return message


async def collect_stream(client: FramedStream, request_id: str) -> list[Delta]:
    deltas: list[Delta] = []
    while True:
        message = await receive(client)
        if isinstance(message, Delta) and message.request_id == request_id:
            deltas.append(message)
            if message.finish_reason is not None:
                return deltas


def generate(request_id: str, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(request_id, Prompt(text="hello"))


def image() -> MediaItem:
    return MediaItem("image/png", b"\x89PNG", "ab" * 32)


# ---------------------------------------------------------------- handshake


async def test_handshake_announces_worker() -> None:
    server = make_server(ScriptedEngine(model="tiny"), max_concurrency=7)
    async with trio.open_nursery() as nursery:
        client = await connect(nursery, server)
        welcome = await receive(client)
        assert welcome == Welcome(
            PROTOCOL_VERSION, "w1", "decode", "tiny", (TRACEPARENT_CAPABILITY,), 7
        )
        await client.aclose()


@pytest.mark.parametrize(
    ("hello", "code"),
    [
        (Hello(PROTOCOL_VERSION, "wrong", "c"), ErrorCode.UNAUTHORIZED),
        (Hello(PROTOCOL_VERSION + 1, TOKEN, "c"), ErrorCode.UNSUPPORTED_VERSION),
        (Ping(1), ErrorCode.PROTOCOL_ERROR),
    ],
    ids=["bad-token", "bad-version", "not-hello"],
)
async def test_handshake_refusals_close_the_connection(hello: Message, code: str) -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_stream, server_stream)
        client = FramedStream(client_stream)
        await client.send(hello)
        reply = await receive(client)
        assert isinstance(reply, ErrorReply)
        assert reply.code == code
        assert await client.receive() is None


async def test_no_auth_token_accepts_any_token() -> None:
    server = make_server(auth_token=None)
    async with trio.open_nursery() as nursery:
        client = await connect(nursery, server, token="anything")
        assert isinstance(await receive(client), Welcome)
        await client.aclose()


async def test_silent_client_is_dropped_after_handshake_timeout(autojump_clock: object) -> None:
    server = make_server(handshake_timeout_s=3.0)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_stream, server_stream)
        assert await FramedStream(client_stream).receive() is None
    assert trio.current_time() - start == 3.0


# ---------------------------------------------------------------- stages


async def test_each_stage_answers_on_one_connection() -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(EncodeRequest("e1", (image(),)))
        encoded = await receive(client)
        assert isinstance(encoded, StageResult)
        assert encoded.ec_transfer_params == {"ab" * 32: {"by": "fake"}}
        await client.send(PrefillRequest("p1", Prompt(text="hi")))
        prefilled = await receive(client)
        assert prefilled == StageResult("p1", kv_transfer_params={"handle": "p1"}, prompt_tokens=5)
        await client.send(generate("g1"))
        deltas = await collect_stream(client, "g1")
        assert "".join(d.text for d in deltas) == "t0 t1 t2 "
        assert deltas[-1].finish_reason == "length"
        await client.aclose()


async def test_concurrent_generations_are_multiplexed(autojump_clock: object) -> None:
    server = make_server(ScriptedEngine(tokens=4, token_delay=1.0))
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        start = trio.current_time()
        await client.send(generate("a"))
        await client.send(generate("b"))
        texts: dict[str, str] = {"a": "", "b": ""}
        finished: set[str] = set()
        while finished != {"a", "b"}:
            message = await receive(client)
            assert isinstance(message, Delta)
            texts[message.request_id] += message.text
            if message.finish_reason:
                finished.add(message.request_id)
        assert texts == {"a": "t0 t1 t2 t3 ", "b": "t0 t1 t2 t3 "}
        assert trio.current_time() - start == 4.0
        await client.aclose()


async def test_queued_deltas_are_merged_into_one_frame() -> None:
    server = make_server(ScriptedEngine(tokens=20))
    async with trio.open_nursery() as nursery:
        # A lockstep stream blocks the worker's writes until the client reads,
        # so the engine runs ahead and its deltas pile up behind the pump.
        client = await welcomed(nursery, server, trio.testing.lockstep_stream_pair)
        await client.send(generate("g"))
        await trio.testing.wait_all_tasks_blocked()
        deltas = await collect_stream(client, "g")
        assert sum(len(d.token_ids) for d in deltas) == 20
        assert len(deltas) < 5
        await client.aclose()


@pytest.mark.parametrize(("failure", "code", "retryable"), ENGINE_FAILURES)
async def test_engine_failures_become_error_replies(
    failure: BaseException, code: str, retryable: bool
) -> None:
    server = make_server(ScriptedEngine(fail_with=failure))
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(PrefillRequest("p", Prompt(text="x")))
        reply = await receive(client)
        assert reply == ErrorReply("p", code, reply.message, retryable)  # type: ignore[union-attr]
        # The connection keeps serving.
        server.engine.fail_with = None  # type: ignore[attr-defined]
        await client.send(PrefillRequest("p2", Prompt(text="x")))
        assert isinstance(await receive(client), StageResult)
        await client.aclose()


async def test_error_mid_stream_follows_the_deltas_already_sent() -> None:
    server = make_server(ScriptedEngine(tokens=4, fail_after_tokens=engine_error()))
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("g"))
        messages = [await receive(client), await receive(client)]
        assert isinstance(messages[0], Delta)
        assert messages[0].text == "t0 "
        assert isinstance(messages[1], ErrorReply)
        assert messages[1].code == ErrorCode.ENGINE_ERROR
        await client.aclose()


async def test_duplicate_request_id_is_refused() -> None:
    gate = trio.Event()
    server = make_server(ScriptedEngine(gate=gate))
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("same"))
        await client.send(generate("same"))
        reply = await receive(client)
        assert isinstance(reply, ErrorReply)
        assert reply.code == ErrorCode.DUPLICATE_REQUEST
        gate.set()
        deltas = await collect_stream(client, "same")
        assert deltas[-1].finish_reason == "length"
        await client.aclose()


@pytest.mark.parametrize("one_write", [False, True], ids=["frame-by-frame", "one-write"])
async def test_full_worker_refuses_quickly_and_queues_up_to_the_limit(one_write: bool) -> None:
    """With one write, the three frames are decoded in one read, before any job task runs:
    admission must count the first two at once, or the third is let in."""
    gate = trio.Event()
    server = make_server(ScriptedEngine(gate=gate), max_concurrency=1, max_queued=1)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await _fill_a_worker_of_two(nursery, server, gate, one_write)


async def _fill_a_worker_of_two(
    nursery: trio.Nursery, server: WorkerServer, gate: trio.Event, one_write: bool
) -> None:
    client = await welcomed(nursery, server)
    requests = [PrefillRequest(request_id, Prompt(text="x")) for request_id in ("r1", "r2", "r3")]
    if one_write:
        await client.send_encoded(b"".join(encode(request) for request in requests), 3)
    else:
        for request in requests:
            await client.send(request)
    refused = await receive(client)
    assert isinstance(refused, ErrorReply)
    assert (refused.request_id, refused.code, refused.retryable) == ("r3", "overloaded", True)
    stats = server.statistics()
    assert (stats.running, stats.queued, stats.refused_total) == (1, 1, 1)
    gate.set()
    done = {(await receive(client)).request_id for _ in range(2)}
    assert done == {"r1", "r2"}
    await client.aclose()


# ---------------------------------------------------------------- abort, release, ping


async def test_abort_cancels_the_job_and_answers_after_the_engine_abort() -> None:
    engine = ScriptedEngine(gate=trio.Event())
    server = make_server(engine)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("g"))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.started == ["g"]
        await client.send(Abort("g"))
        assert await receive(client) == Aborted("g")
        assert engine.aborted == ["g"]
        assert server.statistics().running == 0
        await client.aclose()


async def test_abort_of_unknown_request_is_answered() -> None:
    engine = ScriptedEngine()
    server = make_server(engine)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(Abort("never-seen"))
        assert await receive(client) == Aborted("never-seen")
        assert engine.aborted == ["never-seen"]
        await client.aclose()


async def test_release_is_answered() -> None:
    engine = ScriptedEngine(role=Role.PREFILL)
    server = make_server(engine)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(Release("r", {"handle": "h1"}))
        assert await receive(client) == Released("r", True)
        await client.send(Release("r2", {}))
        assert await receive(client) == Released("r2", False)
        assert engine.released == [{"handle": "h1"}, {}]
        await client.aclose()


async def test_ping_is_answered_while_the_engine_is_saturated() -> None:
    gate = trio.Event()
    server = make_server(ScriptedEngine(gate=gate), max_concurrency=1)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("busy"))
        await client.send(generate("waiting"))
        await trio.testing.wait_all_tasks_blocked()
        await client.send(Ping(42))
        pong = await receive(client)
        assert isinstance(pong, Pong)
        assert pong.nonce == 42
        assert (pong.stats.running, pong.stats.queued, pong.stats.engine_ready) == (1, 1, True)
        gate.set()
        await client.aclose()


async def test_heartbeat_faults_delay_or_drop_pongs(autojump_clock: object) -> None:
    server = make_server(heartbeat_delay_s=2.5)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        start = trio.current_time()
        await client.send(Ping(1))
        assert isinstance(await receive(client), Pong)
        assert trio.current_time() - start == 2.5
        await client.aclose()
    server = make_server(heartbeat_drop=True)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(Ping(1))
        with trio.move_on_after(60) as scope:
            await client.receive()
        assert scope.cancelled_caught
        await client.aclose()


# ---------------------------------------------------------------- bad input, disconnects


async def test_garbage_closes_only_that_connection() -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        good = await welcomed(nursery, server)
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_stream, server_stream)
        bad = FramedStream(client_stream)
        await bad.send(Hello(PROTOCOL_VERSION, TOKEN, "bad"))
        assert isinstance(await receive(bad), Welcome)
        await client_stream.send_all(HEADER.pack(3) + b"\xc1\xc1\xc1")
        reply = await receive(bad)
        assert isinstance(reply, ErrorReply)
        assert reply.code == ErrorCode.PROTOCOL_ERROR
        assert await bad.receive() is None
        await good.send(generate("still-fine"))
        deltas = await collect_stream(good, "still-fine")
        assert deltas[-1].finish_reason == "length"
        assert server.statistics().protocol_errors_total == 1
        await good.aclose()


async def test_oversized_frame_is_refused_before_its_body() -> None:
    server = make_server(max_frame_bytes=1024)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client._stream.send_all(HEADER.pack(10_000_000))  # header only
        reply = await receive(client)
        assert isinstance(reply, ErrorReply)
        assert "exceeds the limit" in reply.message
        assert await client.receive() is None


async def test_message_a_client_may_not_send_closes_the_connection() -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(Aborted("x"))
        reply = await receive(client)
        assert isinstance(reply, ErrorReply)
        assert reply.code == ErrorCode.PROTOCOL_ERROR
        assert await client.receive() is None


async def test_disconnect_aborts_every_job_of_the_connection() -> None:
    engine = ScriptedEngine(gate=trio.Event())
    server = make_server(engine)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("a"))
        await client.send(PrefillRequest("b", Prompt(text="x")))
        await trio.testing.wait_all_tasks_blocked()
        await client.aclose()
    assert sorted(engine.aborted) == ["a", "b"]
    stats = server.statistics()
    assert (stats.running, stats.queued, stats.connections) == (0, 0, 0)


async def test_engine_crash_takes_the_worker_down() -> None:
    server = make_server(ScriptedEngine(fail_with=engine_crash()))
    with pytest.RaisesGroup(EngineCrashed, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            client = await welcomed(nursery, server)
            await client.send(generate("g"))


# ---------------------------------------------------------------- drain


async def test_drain_says_goodbye_refuses_new_work_and_finishes_in_flight(
    autojump_clock: object,
) -> None:
    server = make_server(ScriptedEngine(tokens=3, token_delay=1.0))
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("in-flight"))
        await trio.testing.wait_all_tasks_blocked()
        server.begin_drain("test")
        assert await receive(client) == Goodbye("test")
        await client.send(generate("late"))
        refused = await receive(client)
        assert isinstance(refused, ErrorReply)
        assert (refused.request_id, refused.code) == ("late", "draining")
        deltas = await collect_stream(client, "in-flight")
        assert deltas[-1].finish_reason == "length"
        await server.finish_drain()
        assert await client.receive() is None


async def test_drain_deadline_cancels_stragglers_with_a_retryable_error(
    autojump_clock: object,
) -> None:
    engine = ScriptedEngine(gate=trio.Event())
    server = make_server(engine, drain_timeout_s=7.0)
    async with trio.open_nursery() as nursery:
        client = await welcomed(nursery, server)
        await client.send(generate("stuck"))
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        server.begin_drain()
        await server.finish_drain()
        assert trio.current_time() - start == 7.0
        assert isinstance(await receive(client), Goodbye)
        reply = await receive(client)
        assert reply == ErrorReply(
            "stuck", "draining", "worker shut down before the request finished", True
        )
        assert engine.aborted == ["stuck"]
        assert await client.receive() is None


async def test_serve_accepts_until_drained() -> None:
    server = make_server()
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        bound = await nursery.start(server.serve, listeners)
        port = bound[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = FramedStream(stream)
        await client.send(Hello(PROTOCOL_VERSION, TOKEN, "tcp"))
        assert isinstance(await receive(client), Welcome)
        server.begin_drain()
        assert isinstance(await receive(client), Goodbye)
        assert await client.receive() is None
        await client.aclose()
