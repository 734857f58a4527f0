"""Resets and odd request targets at a live HTTP listener: each fails only its own connection.

The memory-stream fuzzing (``test_fuzz_http.py``) cannot reset a socket; these
few cases do it for real on loopback, at each point of a request: in the
head, after the head, in the body, and while a stream is being written.
After each, the server must answer an ordinary request, and nothing may be
logged at error level.  Waits are ``wait_all_tasks_blocked`` only (see
``test_ws_faults.py``).
"""

from __future__ import annotations

import json
import socket
import struct
from functools import partial

import pytest
import trio
import trio.testing

from epd_actors.frontends.http import HttpServer, HttpSettings, serve_http
from tests.faults.logs import front_end_errors
from tests.frontends.test_http_frontend import ScriptedApp, delta

GUARD_S = 20.0
STREAM = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def post(body: bytes, target: bytes = b"/v1/chat/completions") -> bytes:
    head = (
        b"POST " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    return head + body


def get(target: bytes, *, host: bytes = b"x") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nhost: " + host + b"\r\n\r\n"


REQUEST = post(STREAM)
END_OF_HEAD = REQUEST.index(b"\r\n\r\n") + 4

TRIGGERS = [
    pytest.param(REQUEST[:20], True, id="reset-in-the-head"),
    pytest.param(REQUEST[:END_OF_HEAD], True, id="reset-after-the-head"),
    pytest.param(REQUEST[:-10], True, id="reset-in-the-body"),
    pytest.param(REQUEST, True, id="reset-while-streaming"),
    pytest.param(REQUEST + REQUEST, True, id="reset-with-a-pipelined-request"),
    pytest.param(get(b"//[x"), False, id="unsplittable-target"),
    pytest.param(get(b"//[x"), True, id="unsplittable-target-then-reset"),
    pytest.param(get(b"*"), False, id="asterisk-target"),
    pytest.param(get(b"http://x/v1/models"), False, id="absolute-target"),
    pytest.param(get(b"/v1/%ff%00?x=%zz"), False, id="percent-garbage-target"),
    pytest.param(get(b"/health", host=b"\xff"), False, id="undecodable-host"),
]


async def send_then_drop(port: int, data: bytes, *, reset: bool) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await stream.send_all(data)
        await trio.testing.wait_all_tasks_blocked()  # the server reads it (and starts a stream)
        if reset:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        await stream.aclose()


async def health_status(port: int) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize(("data", "reset"), TRIGGERS)
async def test_a_reset_or_odd_target_ends_only_its_own_connection(data: bytes, reset: bool) -> None:
    app = ScriptedApp([delta("a"), delta("b")])  # a stream that never ends by itself
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with front_end_errors() as errors, trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_http, app, listeners, settings=HttpSettings()))
            for _ in range(4):
                await send_then_drop(port, data, reset=reset)
                await trio.testing.wait_all_tasks_blocked()
            assert await health_status(port) == b"HTTP/1.1 200 OK"
            nursery.cancel_scope.cancel(reason="test over")
    assert errors.records == []


def test_the_connection_count_is_what_the_triggers_leave_behind() -> None:
    """The server counts no connection that a reset ended (the finally path ran)."""

    async def run() -> int:
        server = HttpServer(ScriptedApp([delta("a")]), HttpSettings())
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, server.handle_connection, listeners))
            for data in (REQUEST[:20], REQUEST[:END_OF_HEAD], REQUEST):
                await send_then_drop(port, data, reset=True)
            await trio.testing.wait_all_tasks_blocked()
            left = server.connections
            nursery.cancel_scope.cancel(reason="test over")
        return left

    assert trio.run(run) == 0
