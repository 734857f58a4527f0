"""The WebSocket API on the HTTP port: real clients on loopback, a simulated fleet behind."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

import h11
import pytest
import trio
import trio.testing
import wsproto
import wsproto.events
from trio_websocket import ConnectionRejected, open_websocket_url, wrap_client_stream

from epd_actors.frontends.http_app import HttpSettings
from epd_actors.frontends.ws import WsSettings
from epd_actors.frontends.ws_upgrade import wants_websocket
from epd_actors.http.upgrade import ReplayStream, replayed_head
from epd_actors.program.config_file import FileConfig, ServerConfig
from epd_actors.program.serve import serve_router
from epd_actors.testing import build_sim_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

EPD = {"encode": 1, "prefill": 1, "decode": 1}
GUARD_S = 10.0
GENERATE = {
    "type": "generate",
    "id": "g",
    "kind": "completion",
    "request": {"model": "sim-model", "prompt": "hello", "max_tokens": 3},
}


@asynccontextmanager
async def deployed(**server: object) -> AsyncIterator[int]:
    """``serve_router`` with no separate WebSocket listener; its HTTP port."""
    fleet = build_sim_fleet(EPD)
    config = FileConfig(fleet.router_config(), ServerConfig("127.0.0.1:0", None, **server))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        start = partial(
            serve_router, config, stop=trio.Event(), backend_factory=fleet.backend_factory
        )
        addresses, router = await nursery.start(start)
        await router.wait_ready()
        assert addresses.ws is None
        yield addresses.http[1]
        nursery.cancel_scope.cancel(reason="test over")


async def _until_done(ws: object) -> list[dict[str, object]]:
    seen = []
    while True:
        message = json.loads(await ws.get_message())  # type: ignore[attr-defined]
        seen.append(message)
        if message["type"] in ("done", "error", "cancelled"):
            return seen


async def test_one_port_serves_http_and_websocket() -> None:
    with trio.fail_after(GUARD_S):
        async with deployed() as port:
            async with open_websocket_url(f"ws://127.0.0.1:{port}/v1/ws") as ws:
                await ws.send_message(json.dumps(GENERATE))
                seen = await _until_done(ws)
            status, _ = await _http_get(port, "/health")
    assert seen[-1]["type"] == "done"
    assert [m["type"] for m in seen[:-1]] == ["delta"] * (len(seen) - 1)
    assert status == 200


async def test_the_api_key_is_checked_on_the_http_port_too() -> None:
    http = HttpSettings(api_keys=("k",))
    with trio.fail_after(GUARD_S):
        async with deployed(http=http, ws=WsSettings(api_keys=("k",))) as port:
            refused = await _refusal(port)
            url = f"ws://127.0.0.1:{port}/v1/ws?api_key=k"
            async with open_websocket_url(url) as ws:
                await ws.send_message(json.dumps(GENERATE))
                seen = await _until_done(ws)
    assert refused.status_code == 401
    assert json.loads(refused.body or b"{}")["error"]["code"] == "invalid_api_key"
    assert seen[-1]["type"] == "done"


async def test_ws_on_http_off_leaves_the_path_unrouted() -> None:
    with trio.fail_after(GUARD_S):
        async with deployed(ws_on_http=False) as port:
            refused = await _refusal(port)
    assert refused.status_code == 404


async def test_an_upgrade_after_a_keep_alive_request_on_the_same_connection() -> None:
    """An HTTP request and the handshake in one write, then a message once accepted.

    (A frame sent before the 101 is not tested: RFC 6455 4.1 has the client
    wait for the answer, and wsproto's server drops such bytes.)
    """
    client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    handshake = client.send(wsproto.events.Request(host="localhost", target="/v1/ws"))
    with trio.fail_after(GUARD_S):
        async with deployed() as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n" + handshake)
                answers = h11.Connection(h11.CLIENT)
                answers.send(h11.Request(method="GET", target="/livez", headers=[("host", "x")]))
                answers.send(h11.EndOfMessage())
                head, body, rest = await _http_answer(stream, answers)
                if rest:
                    client.receive_data(rest)  # b"" would say EOF
                accepted = await _ws_events(stream, client, 1)
                ping = json.dumps({"type": "ping"})
                await stream.send_all(client.send(wsproto.events.TextMessage(ping)))
                answered = await _ws_events(stream, client, 1)
    assert (head.status_code, json.loads(body)) == (200, {"status": "alive"})
    assert isinstance(accepted[0], wsproto.events.AcceptConnection), accepted
    assert isinstance(answered[0], wsproto.events.TextMessage), answered
    assert json.loads(answered[0].data) == {"type": "pong"}


async def test_a_get_of_the_path_without_upgrade_is_404() -> None:
    with trio.fail_after(GUARD_S):
        async with deployed() as port:
            status, _ = await _http_get(port, "/v1/ws")
    assert status == 404


def test_wants_websocket() -> None:
    assert wants_websocket("GET", {"upgrade": "WebSocket"})
    assert wants_websocket("GET", {"upgrade": "h2c, websocket"})
    assert not wants_websocket("POST", {"upgrade": "websocket"})
    assert not wants_websocket("GET", {"upgrade": "h2c"})
    assert not wants_websocket("GET", {})


def test_replayed_head_keeps_the_target_and_the_headers() -> None:
    request = h11.Request(
        method="GET", target="/v1/ws?api_key=k", headers=[("Host", "x"), ("Upgrade", "websocket")]
    )
    assert replayed_head(request) == (
        b"GET /v1/ws?api_key=k HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n"
    )


async def test_replay_stream_returns_the_prefix_first() -> None:
    left, right = trio.testing.memory_stream_pair()
    replay = ReplayStream(right, b"abcdef")
    await left.send_all(b"tail")
    assert await replay.receive_some(4) == b"abcd"
    assert await replay.receive_some() == b"ef"
    assert await replay.receive_some() == b"tail"
    await replay.send_all(b"out")
    assert await left.receive_some() == b"out"
    await replay.aclose()
    assert await left.receive_some() == b""


# ---------------------------------------------------------------- raw clients


async def _refusal(port: int) -> ConnectionRejected:
    """Attempt a handshake on the HTTP port that the server refuses; return the refusal."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        with pytest.RaisesGroup(ConnectionRejected) as refused:
            async with trio.open_nursery() as nursery:
                await wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/ws")
    rejected = refused.value.exceptions[0]
    assert isinstance(rejected, ConnectionRejected)
    return rejected


async def _http_get(port: int, path: str) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        client = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="GET", target=path, headers=[("host", "x"), ("connection", "close")]
        )
        await stream.send_all(client.send(request) + client.send(h11.EndOfMessage()))
        head, body, _ = await _http_answer(stream, client)
    return head.status_code, body


async def _http_answer(
    stream: trio.SocketStream, client: h11.Connection
) -> tuple[h11.Response, bytes, bytes]:
    """The next response: its head, its body, and the bytes received after it."""
    head: h11.Response | None = None
    body = b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some())
            continue
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            assert head is not None
            return head, body, bytes(client.trailing_data[0])


async def _ws_events(
    stream: trio.SocketStream, client: wsproto.WSConnection, count: int
) -> list[wsproto.events.Event]:
    events = list(client.events())
    while len(events) < count:
        client.receive_data(await stream.receive_some())
        events += client.events()
    return events
