"""The WebSocket front end: real trio-websocket clients on loopback, a simulated fleet behind.

Timing is never asserted.  Where a test needs "everything has settled" (aborts
delivered, a slow connection fully stalled) it waits with
``wait_all_tasks_blocked``: the unpaced simulator never sleeps, so once every
task is blocked a stalled stream is stalled by backpressure, not by a timer.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    open_websocket_url,
    wrap_client_stream,
)

from epd_actors.core.router import open_router
from epd_actors.errors import (
    ActorCrashed,
    ConfigError,
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    RequestCancelled,
    StageTimeout,
    Unauthorized,
)
from epd_actors.frontends.ws import WsServer, WsSettings, serve_ws
from epd_actors.frontends.ws_messages import (
    CancelMessage,
    GenerateMessage,
    PingMessage,
    WsMessageError,
    error_payload,
    parse_client_message,
)
from epd_actors.openai.body_checks import unknown_model
from epd_actors.program.config_file import FileConfig, ServerConfig
from epd_actors.program.serve import serve_router
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio_websocket import WebSocketConnection

    from epd_actors.simulator.engine import SimConfig

EPD = {"encode": 1, "prefill": 1, "decode": 1}
GUARD_S = 10.0
LONG = 100_000  # tokens: at the simulator's default pace, never finishes within a test
CONTEXT = 1 << 21  # the simulated model's context, so that LONG and bigger fit

Message = dict[str, Any]  # one decoded server message


@dataclass
class Served:
    fleet: SimFleet
    server: WsServer

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}/v1/ws"


@asynccontextmanager
async def serving(
    settings: WsSettings | None = None, *, sim: SimConfig | None = None
) -> AsyncIterator[Served]:
    fleet = build_sim_fleet(EPD, config=sim or sim_config(max_model_len=CONTEXT))
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        async with trio.open_nursery() as nursery:
            start = partial(serve_ws, router, "127.0.0.1", 0, settings=settings or WsSettings())
            server = await nursery.start(start)
            yield Served(fleet, server)
            nursery.cancel_scope.cancel(reason="test over")


def generate(client_id: str, max_tokens: int = 8, **body: object) -> dict[str, object]:
    request = {"model": "sim-model", "prompt": "hello world", "max_tokens": max_tokens, **body}
    return {"type": "generate", "id": client_id, "kind": "completion", "request": request}


def chat(client_id: str, max_tokens: int = 8, **body: object) -> dict[str, object]:
    request = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": max_tokens,
        **body,
    }
    return {"type": "generate", "id": client_id, "kind": "chat", "request": request}


async def send(ws: WebSocketConnection, message: object) -> None:
    await ws.send_message(json.dumps(message))


async def receive(ws: WebSocketConnection) -> Message:
    message = json.loads(await ws.get_message())
    assert isinstance(message, dict)
    return message


async def until_terminal(
    ws: WebSocketConnection, *ids: str, streaming: tuple[str, ...] = ()
) -> dict[str, list[Message]]:
    """Every message of ``ids`` up to and including each one's terminal message.

    Deltas of the ``streaming`` ids (other live generations) are skipped.
    """
    seen: dict[str, list[Message]] = {client_id: [] for client_id in ids}
    open_ids = set(ids)
    while open_ids:
        message = await receive(ws)
        client_id = message["id"]
        assert isinstance(client_id, str)
        if client_id in streaming and message["type"] == "delta":
            continue
        assert client_id in open_ids, message
        seen[client_id].append(message)
        if message["type"] in ("done", "error", "cancelled"):
            open_ids.discard(client_id)
    return seen


def tokens(messages: list[Message]) -> list[int]:
    return [t for m in messages if m["type"] == "delta" for t in m["token_ids"]]


# ---------------------------------------------------------------- sans-IO parts


@pytest.mark.parametrize(
    ("data", "code", "client_id"),
    [
        ("not json", "invalid_json", None),
        ('{"type": "ping", "x": NaN}', "invalid_json", None),
        ("[1, 2]", "invalid_message", None),
        (b'{"type": "ping"}', "invalid_message", None),
        ('{"type": "bogus"}', "unknown_type", None),
        ('{"type": "generate", "kind": "chat", "request": {}}', "invalid_message", None),
        ('{"type": "cancel", "id": ""}', "invalid_message", None),
        ('{"type": "generate", "id": "g", "kind": "edit", "request": {}}', "invalid_message", "g"),
    ],
    ids=["not-json", "nan", "array", "binary", "unknown-type", "no-id", "empty-id", "bad-kind"],
)
def test_parse_client_message_refusals(data: str | bytes, code: str, client_id: str | None) -> None:
    with pytest.raises(WsMessageError) as caught:
        parse_client_message(data)
    assert caught.value.code == code
    assert caught.value.client_id == client_id


def test_parse_client_message_accepts_the_three_types() -> None:
    assert parse_client_message('{"type": "ping"}') == PingMessage()
    assert parse_client_message('{"type": "cancel", "id": "a"}') == CancelMessage("a")
    parsed = parse_client_message('{"type": "generate", "id": "a", "kind": "chat", "request": {}}')
    assert parsed == GenerateMessage("a", "chat", {})


@pytest.mark.parametrize(
    ("exc", "kind", "code"),
    [
        (InvalidRequest("bad", param="top_p"), "invalid_request_error", None),
        (Unauthorized("no"), "authentication_error", "invalid_api_key"),
        (Overloaded("busy"), "rate_limit_error", "overloaded"),
        (NoHealthyWorker("none"), "service_unavailable_error", "no_healthy_worker"),
        (StageTimeout("slow", phase="first_token"), "timeout_error", "first_token"),
        (
            RemoteWorkerError("engine_error", "boom", retryable=False),
            "upstream_error",
            "engine_error",
        ),
        (ActorCrashed("crash"), "upstream_error", "ActorCrashed"),
        (RequestCancelled("shutdown"), "cancelled", "cancelled"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None,
)
def test_error_payload_uses_the_http_mapping(exc: Exception, kind: str, code: str | None) -> None:
    payload = error_payload(exc)
    assert payload["type"] == kind
    assert payload["code"] == code
    assert payload["message"] == str(exc)
    assert payload["param"] == (exc.param if isinstance(exc, InvalidRequest) else None)


@pytest.mark.parametrize(
    "bad",
    [{"path": "v1/ws"}, {"max_generations": 0}, {"outgoing_buffer": 0}, {"idle_timeout_s": 0.0}],
    ids=["relative-path", "no-generations", "no-buffer", "zero-idle"],
)
def test_settings_refuse_unusable_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        WsSettings(**bad)


# ---------------------------------------------------------------- over sockets


async def test_concurrent_generations_share_one_socket() -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await send(ws, generate("a", 12))
            await send(ws, chat("b", 5, logprobs=True))
            await send(ws, generate("c", 3))
            seen = await until_terminal(ws, "a", "b", "c")
    for client_id, count in (("a", 12), ("b", 5), ("c", 3)):
        *deltas, done = seen[client_id]
        assert {m["type"] for m in deltas} == {"delta"}
        assert done["type"] == "done"
        assert done["finish_reason"] == "length"
        assert len(tokens(deltas)) == count
        assert done["usage"]["completion_tokens"] == count
        assert set(done["timings"]) == {"queue_wait_s", "stages", "ttft_s", "total_s", "workers"}
        assert set(done["timings"]["workers"]) == set(done["timings"]["stages"])
        assert str(done["request_id"]).startswith("req-")
    assert all(len(m["logprobs"]) == len(m["token_ids"]) for m in seen["b"][:-1])
    assert all("logprobs" not in m for m in seen["a"])


async def test_cancel_stops_one_generation_and_aborts_its_worker() -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await send(ws, generate("long", LONG))
            await send(ws, generate("short", 40))
            early = [await receive(ws)]
            while early[-1]["id"] != "long":
                early.append(await receive(ws))
            await send(ws, {"type": "cancel", "id": "long"})
            seen = await until_terminal(ws, "long", "short")
            await send(ws, {"type": "cancel", "id": "long"})  # no longer live: ignored
            await send(ws, {"type": "ping"})
            assert await receive(ws) == {"type": "pong"}
            await trio.testing.wait_all_tasks_blocked()
            assert served.fleet.total("aborts", "decode") == 1
    assert seen["long"][-1] == {"type": "cancelled", "id": "long"}
    assert [m["type"] for m in seen["long"][:-1]] == ["delta"] * (len(seen["long"]) - 1)
    assert seen["short"][-1]["type"] == "done"
    assert len(tokens([m for m in early if m["id"] == "short"] + seen["short"])) == 40


async def test_invalid_messages_are_answered_and_the_connection_stays_open() -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await ws.send_message("{oops")
            invalid_json = await receive(ws)
            await send(ws, {"type": "subscribe"})
            unknown = await receive(ws)
            await ws.send_message(b"\x00\x01")
            binary = await receive(ws)
            await send(
                ws,
                {"type": "generate", "id": "x", "kind": "completion", "request": {"prompt": "hi"}},
            )
            no_model = await receive(ws)
            await send(ws, generate("y", 4, temperature=9))
            bad_field = await receive(ws)
            await send(ws, generate("z", 2))
            ok = await until_terminal(ws, "z")
    assert invalid_json["id"] is None
    assert invalid_json["error"]["code"] == "invalid_json"
    assert unknown["error"] == {
        "message": "type must be one of generate, cancel, ping",
        "type": "invalid_request_error",
        "param": "type",
        "code": "unknown_type",
    }
    assert binary["id"] is None
    assert binary["error"]["code"] == "invalid_message"
    assert no_model["id"] == "x"
    assert no_model["error"]["param"] == "model"
    assert bad_field["id"] == "y"
    assert bad_field["error"]["param"] == "temperature"
    assert ok["z"][-1]["type"] == "done"


async def test_duplicate_live_id_is_refused_and_the_first_continues() -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await send(ws, generate("a", LONG))
            assert (await receive(ws))["type"] == "delta"
            await send(ws, generate("a", 2))
            message = await receive(ws)
            while message["type"] == "delta":
                message = await receive(ws)
            assert message["id"] == "a"
            assert message["error"]["code"] == "duplicate_id"
            assert (await receive(ws))["type"] == "delta"  # the first one still streams
            await send(ws, {"type": "cancel", "id": "a"})
            assert (await until_terminal(ws, "a"))["a"][-1]["type"] == "cancelled"
            await send(ws, generate("a", 2))  # an id is free again once it ended
            assert (await until_terminal(ws, "a"))["a"][-1]["type"] == "done"


async def test_generation_limit_per_connection() -> None:
    settings = WsSettings(max_generations=2)
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served, open_websocket_url(served.url) as ws:
            await send(ws, generate("a", LONG))
            await send(ws, generate("b", LONG))
            await send(ws, generate("c", 2))
            message = await receive(ws)
            while message["type"] == "delta":
                message = await receive(ws)
            assert message["id"] == "c"
            assert message["error"]["code"] == "overloaded"
            async with open_websocket_url(served.url) as other:  # the limit is per connection
                await send(other, generate("c", 2))
                assert (await until_terminal(other, "c"))["c"][-1]["type"] == "done"
            await send(ws, {"type": "cancel", "id": "a"})
            assert (await until_terminal(ws, "a", streaming=("b",)))["a"][-1]["type"] == "cancelled"
            await send(ws, generate("c", 2))
            assert (await until_terminal(ws, "c", streaming=("b",)))["c"][-1]["type"] == "done"


async def test_closing_the_socket_aborts_its_generations() -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served:
            async with open_websocket_url(served.url) as ws:
                await send(ws, generate("a", LONG))
                await send(ws, chat("b", LONG))
                await until_first_delta(ws, "a", "b")
                assert served.server.statistics().connections[0].generations == 2
            await trio.testing.wait_all_tasks_blocked()
            assert served.fleet.total("aborts", "decode") == 2
            assert served.server.statistics().connections == ()
            assert served.fleet.total("in_flight") == 0


async def until_first_delta(ws: WebSocketConnection, *ids: str) -> None:
    waiting = set(ids)
    while waiting:
        message = await receive(ws)
        assert message["type"] == "delta"
        waiting.discard(str(message["id"]))


async def test_a_slow_reader_stalls_only_its_own_connection() -> None:
    # Unpaced: the simulator only ever waits on backpressure, never on a timer.
    sim = sim_config(output_token_s=0.0, max_model_len=CONTEXT)
    settings = WsSettings(outgoing_buffer=2)
    with trio.fail_after(GUARD_S):
        async with serving(settings, sim=sim) as served, open_websocket_url(served.url) as slow:
            await send(slow, generate("big", 1 << 20))  # never read
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            stalled = served.fleet.total("tokens_generated", "decode")
            (slow_stats,) = served.server.statistics().connections
            assert slow_stats.generations == 1
            assert slow_stats.outgoing_buffered == settings.outgoing_buffer
            assert stalled < 1 << 20
            async with open_websocket_url(served.url) as fast:
                await send(fast, generate("quick", 64))
                quick = await until_terminal(fast, "quick")
            assert quick["quick"][-1]["type"] == "done"
            assert len(tokens(quick["quick"])) == 64
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            # The slow stream made no progress meanwhile: only "quick" produced tokens.
            assert served.fleet.total("tokens_generated", "decode") == stalled + 64
            (still,) = served.server.statistics().connections
            assert still.messages_sent == slow_stats.messages_sent


async def test_closing_a_stalled_connection_leaves_other_stalled_streams_alone() -> None:
    sim = sim_config(output_token_s=0.0, max_model_len=CONTEXT)
    settings = WsSettings(outgoing_buffer=2)
    with trio.fail_after(GUARD_S):
        async with serving(settings, sim=sim) as served, open_websocket_url(served.url) as kept:
            await send(kept, generate("kept", 1 << 20))  # never read
            async with open_websocket_url(served.url) as closed:
                await send(closed, generate("closed", 1 << 20))  # never read
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            # Only the closed connection's generation was aborted.
            assert served.fleet.total("aborts", "decode") == 1
            (left,) = served.server.statistics().connections
            assert left.generations == 1


@asynccontextmanager
async def owned_connection(port: int) -> AsyncIterator[WebSocketConnection]:
    """A client connection whose socket the test closes itself.

    trio-websocket's client never closes its socket when the *server* closes
    first (and ``open_websocket_url`` leaves a refused handshake's socket
    open): a ResourceWarning, which is an error here.
    """
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream, trio.open_nursery() as nursery:
        ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/ws")
        yield ws
        await ws.aclose()


async def refusal(
    port: int, target: str, headers: list[tuple[bytes, bytes]] | None = None
) -> ConnectionRejected:
    """Attempt a handshake that the server refuses; return the refusal (see above)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        with pytest.RaisesGroup(ConnectionRejected) as refused:
            async with trio.open_nursery() as nursery:
                await wrap_client_stream(
                    nursery, stream, "127.0.0.1", target, extra_headers=headers
                )
    rejected = refused.value.exceptions[0]
    assert isinstance(rejected, ConnectionRejected)
    return rejected


async def test_api_keys_from_header_or_query() -> None:
    settings = WsSettings(api_keys=("k1", "k2"))
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served:
            port = served.server.port
            for headers in ([], [(b"authorization", b"Bearer nope")], [(b"authorization", b"k1")]):
                refused = await refusal(port, "/v1/ws", headers)
                assert refused.status_code == 401
                body = json.loads(refused.body or b"{}")
                assert body["error"]["code"] == "invalid_api_key"
            assert (await refusal(port, "/v1/ws?api_key=k3")).status_code == 401
            wrong_path = await refusal(port, "/v1/other?api_key=k1")
            assert wrong_path.status_code == 404
            assert b"k1" not in (wrong_path.body or b"")  # the query is never echoed
            good = [(b"authorization", b"Bearer k2")]
            async with open_websocket_url(served.url, extra_headers=good) as ws:
                await send(ws, {"type": "ping"})
                assert await receive(ws) == {"type": "pong"}
            async with open_websocket_url(served.url + "?api_key=k1") as ws:
                await send(ws, {"type": "ping"})
                assert await receive(ws) == {"type": "pong"}
            stats = served.server.statistics()
            assert (stats.accepted_total, stats.rejected_total) == (2, 5)


async def test_idle_connection_is_closed_but_not_while_generating() -> None:
    # 250 paced tokens take longer than the idle timeout: the generation keeps it open.
    settings = WsSettings(idle_timeout_s=0.2)
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served, owned_connection(served.server.port) as ws:
            await send(ws, generate("a", 250))
            assert (await until_terminal(ws, "a"))["a"][-1]["type"] == "done"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason is not None
    assert (closed.value.reason.code, closed.value.reason.reason) == (1000, "idle timeout")


async def test_handshake_timeout_drops_a_silent_client() -> None:
    settings = WsSettings(handshake_timeout_s=0.05)
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served:
            stream = await trio.open_tcp_stream("127.0.0.1", served.server.port)
            async with stream:
                assert await stream.receive_some() == b""


async def test_oversized_message_closes_with_1009() -> None:
    settings = WsSettings(max_message_bytes=1024)
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served, owned_connection(served.server.port) as ws:
            await send(ws, generate("a", 2, stop="x" * 2000))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1009


# ---------------------------------------------------------------- lone surrogates, models

LONE = "\ud800"  # json.dumps sends it as the escape "\ud800"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (chat("g", messages=[{"role": "user", "content": f"a{LONE}"}]), "messages[0].content"),
        (
            chat(
                "g",
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": LONE}],
                    }
                ],
            ),
            "messages[0].content[1].text",
        ),
        (chat("g", stop=["x", LONE]), "stop[1]"),
        (generate("g", prompt=LONE), "prompt"),
        (generate("g", model=LONE), "model"),
    ],
    ids=["content", "text-part", "stop", "prompt", "model"],
)
async def test_a_lone_surrogate_in_the_body_is_refused_naming_the_field(
    message: dict[str, object], param: str
) -> None:
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await send(ws, message)
            refused = await receive(ws)
            await send(ws, generate("after", 2))  # the connection stays usable
            after = await until_terminal(ws, "after")
            assert served.fleet.total("generate_requests", "decode") == 1
    assert refused["type"] == "error"
    assert refused["id"] == "g"
    assert refused["error"]["type"] == "invalid_request_error"
    assert refused["error"]["param"] == param
    assert refused["error"]["code"] is None  # as over HTTP
    assert after["after"][-1]["type"] == "done"


def test_a_lone_surrogate_outside_the_body_names_the_frame_field() -> None:
    with pytest.raises(WsMessageError) as in_id:
        parse_client_message(json.dumps({"type": "cancel", "id": f"x{LONE}"}))
    assert (in_id.value.param, in_id.value.client_id) == ("id", None)
    with pytest.raises(WsMessageError) as in_extra:
        parse_client_message(json.dumps({"type": "ping", "note": LONE}))
    assert (in_extra.value.param, in_extra.value.client_id) == ("note", None)
    with pytest.raises(WsMessageError) as in_request:
        parse_client_message(json.dumps({**chat("g"), "request": {"user": LONE}}))
    assert (in_request.value.param, in_request.value.client_id) == ("user", "g")


async def test_a_surrogate_pair_streams_as_an_ordinary_character() -> None:
    emoji = "\U0001f600"
    message = chat("g", 3, messages=[{"role": "user", "content": emoji}], stop=[emoji])
    assert "\\ud83d\\ude00" in json.dumps(message)  # sent as a pair of escapes
    with trio.fail_after(GUARD_S):
        async with serving() as served, open_websocket_url(served.url) as ws:
            await send(ws, message)
            seen = await until_terminal(ws, "g")
    assert seen["g"][-1]["type"] == "done"


@asynccontextmanager
async def deployed(ws_settings: WsSettings | None = None) -> AsyncIterator[str]:
    """``serve_router`` with a configuration like the built-in local deployment's; its WS URL."""
    fleet = build_sim_fleet(EPD)
    server = ServerConfig("127.0.0.1:0", "127.0.0.1:0", ws=ws_settings or WsSettings())
    config = FileConfig(fleet.router_config(), server)
    async with trio.open_nursery() as nursery:
        start = partial(
            serve_router, config, stop=trio.Event(), backend_factory=fleet.backend_factory
        )
        addresses, router = await nursery.start(start)
        await router.wait_ready()
        assert addresses.ws_url is not None
        yield addresses.ws_url
        nursery.cancel_scope.cancel(reason="test over")


async def test_a_model_the_router_does_not_serve_is_refused_as_over_http() -> None:
    with trio.fail_after(GUARD_S):
        async with deployed() as url, open_websocket_url(url) as ws:
            await send(ws, generate("other", 2, model="gpt-4o"))
            refused = await receive(ws)
            await send(ws, generate("served", 2))
            served = await until_terminal(ws, "served")
    assert refused == {
        "type": "error",
        "id": "other",
        "error": error_payload(unknown_model("gpt-4o")),
    }
    assert refused["error"] == {
        "message": "the model 'gpt-4o' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert served["served"][-1]["type"] == "done"


async def test_configured_ws_models_are_the_ones_accepted() -> None:
    with trio.fail_after(GUARD_S):
        async with deployed(WsSettings(models=("alias",))) as url, open_websocket_url(url) as ws:
            await send(ws, generate("alias", 2, model="alias"))
            alias = await until_terminal(ws, "alias")
            await send(ws, generate("sim", 2))
            sim = await receive(ws)
    assert alias["alias"][-1]["type"] == "done"
    assert sim["error"]["code"] == "model_not_found"


async def test_deltas_go_out_from_the_task_that_produced_them_while_the_generation_waits() -> None:
    """Paced tokens find the generation's task waiting: each is queued for the socket
    by the router task that produced it, and the client still gets them in order."""
    with trio.fail_after(GUARD_S):
        paced = sim_config(max_model_len=CONTEXT, output_token_s=0.001)
        async with serving(sim=paced) as served, open_websocket_url(served.url) as ws:
            await send(ws, generate("a", 8))
            messages = (await until_terminal(ws, "a"))["a"]
            (stats,) = served.server.statistics().connections
    assert messages[-1]["type"] == "done"
    assert stats.deltas_direct > 0
