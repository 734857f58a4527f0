"""Hostile and broken clients at a live WebSocket listener: each fails only its own connection.

Real loopback sockets on purpose: what is tested is how trio-websocket's
handshake (its reader task, ``accept``, ``reject``) and the front end's own
checks behave when the peer resets, sends what wsproto cannot decode, or
names a target that is no URL.  A raw ``trio.open_tcp_stream`` client writes
the bytes; a reset is ``SO_LINGER`` 0, then close.  After each fault the
server must still serve an ordinary client, and nothing may be logged at
error level (a client's fault is not a bug).

``wait_all_tasks_blocked`` is the only wait: on loopback a reset or a write
is in the server's socket when the client's call returns, so once every task
is blocked the server has done all it will do with that connection.
"""

from __future__ import annotations

import json
import socket
import struct
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio_websocket import open_websocket_url

from epd_actors.frontends.ws import WsServer, WsSettings, serve_ws
from tests.faults.logs import ErrorRecords, front_end_errors
from tests.frontends.test_ws_frontend import generate, receive, send, serving, until_terminal
from tests.wire_strategies import WIRE_SETTINGS

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from epd_actors.request import GenerationRequest

GUARD_S = 20.0
KEY = "k1"


def handshake(target: bytes = b"/v1/ws", *, host: bytes = b"localhost") -> bytes:
    """A complete opening handshake (RFC 6455's sample key)."""
    return (
        b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )


GARBAGE = bytes(range(256)) * 4  # after an upgrade: a frame header announcing nonsense


async def send_then_drop(port: int, data: bytes, *, reset: bool) -> None:
    """Connect, write ``data``, then reset (``SO_LINGER`` 0) or close the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(data)
        if reset:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        await stream.aclose()


@pytest.fixture
def errors() -> Iterator[ErrorRecords]:
    with front_end_errors() as records:
        yield records


async def assert_serves(url: str, *, key: str | None) -> None:
    """An ordinary client connects, pings, and runs one generation to ``done``."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else None
    async with open_websocket_url(url, extra_headers=headers) as ws:
        await send(ws, {"type": "ping"})
        assert await receive(ws) == {"type": "pong"}
        await send(ws, generate("after", 3))
        assert (await until_terminal(ws, "after"))["after"][-1]["type"] == "done"


TRIGGERS = [
    pytest.param(handshake(), True, False, id="upgrade-then-reset"),
    pytest.param(handshake(b"/elsewhere"), True, False, id="wrong-path-then-reset"),
    pytest.param(handshake(), True, True, id="no-key-then-reset"),
    pytest.param(handshake(b"/v1/ws?api_key=nope"), True, True, id="wrong-key-then-reset"),
    pytest.param(handshake(b"//[x"), False, False, id="unsplittable-target"),
    pytest.param(handshake(b"//[x"), True, True, id="unsplittable-target-then-reset"),
    pytest.param(handshake(host=b"\xff"), False, False, id="undecodable-host"),
    pytest.param(handshake() + GARBAGE, False, False, id="bytes-after-upgrade"),
    pytest.param(handshake() + GARBAGE, True, False, id="bytes-after-upgrade-then-reset"),
]


@pytest.mark.parametrize(("data", "reset", "keys"), TRIGGERS)
async def test_a_broken_handshake_ends_only_its_own_connection(
    data: bytes, reset: bool, keys: bool, errors: ErrorRecords
) -> None:
    settings = WsSettings(api_keys=(KEY,) if keys else ())
    with trio.fail_after(GUARD_S):
        async with serving(settings) as served:
            for _ in range(4):  # the reset races the server's answer: try it more than once
                await send_then_drop(served.server.port, data, reset=reset)
                await trio.testing.wait_all_tasks_blocked()
            await assert_serves(served.url, key=KEY if keys else None)
            assert served.server.statistics().connections == ()
    assert errors.records == []


async def test_a_reset_while_connected_ends_only_that_connection(errors: ErrorRecords) -> None:
    frame = text_frame(json.dumps(generate("gone", 100_000)).encode())
    with trio.fail_after(GUARD_S):
        async with serving() as served:
            stream = await trio.open_tcp_stream("127.0.0.1", served.server.port)
            await stream.send_all(handshake() + frame)
            assert b" 101 " in await stream.receive_some()
            await trio.testing.wait_all_tasks_blocked()
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert served.fleet.total("in_flight") == 0
            await assert_serves(served.url, key=None)
    assert errors.records == []


def text_frame(payload: bytes) -> bytes:
    """One masked client text frame (the zero mask: the payload goes as is)."""
    if len(payload) < 126:
        header = bytes([0x81, 0x80 | len(payload)])
    else:
        header = bytes([0x81, 0x80 | 126]) + struct.pack("!H", len(payload))
    return header + b"\x00\x00\x00\x00" + payload


# ---------------------------------------------------------------- property-based


class PingOnlyApp:
    """An app that is never asked to generate: these clients only ping."""

    def generate(self, request: GenerationRequest) -> Any:
        raise AssertionError(f"unexpected generation {request.request_id}")


@asynccontextmanager
async def ping_server(settings: WsSettings) -> AsyncIterator[WsServer]:
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(serve_ws, PingOnlyApp(), "127.0.0.1", 0, settings=settings)
        )
        yield server
        nursery.cancel_scope.cancel(reason="test over")


HANDSHAKES = [
    handshake(),
    handshake(b"/elsewhere"),
    handshake(b"//[x?api_key=k1"),
    handshake(b"/v1/ws?api_key=k1"),
    handshake(host=b"\xff\xfe"),
    handshake() + text_frame(b'{"type": "ping"}'),
    b"POST /v1/ws HTTP/1.1\r\nHost: x\r\n\r\n",
]


@st.composite
def hostile_client(draw: st.DrawFn) -> tuple[list[bytes], bool, bool]:
    """Chunks to write (a handshake cut anywhere, then random bytes), the ending, and a pause.

    The pause (``wait_all_tasks_blocked`` before the ending) lets the server
    answer first, so the reset lands after the accept or the refusal too.
    """
    seed = draw(st.sampled_from(HANDSHAKES))
    data = seed[: draw(st.integers(0, len(seed)))] + draw(st.binary(max_size=48))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return [chunk for chunk in chunks if chunk], draw(st.booleans()), draw(st.booleans())


async def play(port: int, chunks: list[bytes], reset: bool, pause: bool) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        for index, chunk in enumerate(chunks):
            if index:
                await trio.testing.wait_all_tasks_blocked()  # the server reads each chunk alone
            await stream.send_all(chunk)
        if pause:
            await trio.testing.wait_all_tasks_blocked()
        if reset:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except trio.BrokenResourceError:
        pass  # the server closed first (a refusal, a protocol error): also fine
    finally:
        await stream.aclose()


async def survive(clients: list[tuple[list[bytes], bool, bool]], keys: bool) -> None:
    settings = WsSettings(api_keys=(KEY,) if keys else ())
    with trio.fail_after(GUARD_S):
        async with ping_server(settings) as server:
            for chunks, reset, pause in clients:
                await play(server.port, chunks, reset, pause)
            await trio.testing.wait_all_tasks_blocked()
            url = f"ws://127.0.0.1:{server.port}/v1/ws" + (f"?api_key={KEY}" if keys else "")
            async with open_websocket_url(url) as ws:
                await send(ws, {"type": "ping"})
                assert await receive(ws) == {"type": "pong"}
            await trio.testing.wait_all_tasks_blocked()
            assert server.statistics().connections == ()


@settings(WIRE_SETTINGS, max_examples=40)
@given(st.lists(hostile_client(), min_size=1, max_size=3), st.booleans())
def test_no_bytes_or_reset_during_a_handshake_takes_the_server_down(
    clients: list[tuple[list[bytes], bool, bool]], keys: bool
) -> None:
    with front_end_errors() as errors:
        trio.run(survive, clients, keys)
    assert errors.records == []
