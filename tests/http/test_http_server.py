"""The HTTP/1.1 server shell (``epd_actors/http/server.py``), over memory streams."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from epd_actors.http.server import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    Responder,
    ServerLimits,
)
from tests.http_wire import exchange, responses

LIMITS = ServerLimits(
    max_header_bytes=1024,
    max_body_bytes=64,
    keep_alive_timeout_s=10.0,
    body_timeout_s=5.0,
    write_timeout_s=5.0,
    max_connections=2,
)


class Recorder:
    """A handler that echoes the body, streams on ``/stream`` and fails on ``/boom``."""

    def __init__(self) -> None:
        self.requests: list[HttpRequest] = []

    async def __call__(self, request: HttpRequest, responder: Responder) -> HttpResponse | None:
        self.requests.append(request)
        if request.path == "/boom":
            raise RuntimeError("a handler bug")
        if request.path == "/silent":
            return None
        if request.path == "/stream":
            await responder.start(200, [("content-type", "text/event-stream")])
            await responder.send(b"data: 1\n\n")
            await responder.send(b"data: 2\n\n")
            await responder.end()
            return None
        return HttpResponse(200, b"echo:" + request.body, headers=(("x-seen", request.path),))


async def test_two_requests_on_one_keep_alive_connection() -> None:
    handler = Recorder()
    data = (
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
        b"POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
    )
    answers = responses(await exchange(HttpServer(handler, LIMITS), data))
    assert [(s, b) for s, _, b in answers] == [(200, b"echo:abc"), (200, b"echo:de")]
    assert answers[1][1]["x-seen"] == "/b"
    assert [r.path for r in handler.requests] == ["/a", "/b"]
    assert handler.requests[0].header("content-length") == "3"


async def test_a_bad_request_line_is_answered_400_and_closes() -> None:
    handler = Recorder()
    answers = responses(await exchange(HttpServer(handler, LIMITS), b"NOT HTTP AT ALL\r\n\r\n"))
    assert [(s, h["connection"]) for s, h, _ in answers] == [(400, "close")]
    assert handler.requests == []


async def test_an_oversized_head_is_answered_431() -> None:
    data = b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2048
    answers = responses(await exchange(HttpServer(Recorder(), LIMITS), data))
    assert [s for s, _, _ in answers] == [431]


async def test_an_oversized_body_is_answered_413_without_calling_the_handler() -> None:
    handler = Recorder()
    body = b"x" * 65
    data = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 65\r\n\r\n" + body
    data += b"GET /never HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = responses(await exchange(HttpServer(handler, LIMITS), data))
    assert [(s, h["connection"]) for s, h, _ in answers] == [(413, "close")]
    assert handler.requests == []


async def test_a_declared_length_over_the_limit_is_413_before_the_body() -> None:
    handler = Recorder()
    data = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n"
    answers = responses(await exchange(HttpServer(handler, LIMITS), data, eof=False))
    assert [(s, h["connection"]) for s, h, _ in answers] == [(413, "close")]
    assert handler.requests == []


async def test_a_client_expecting_100_continue_is_told_to_go_on() -> None:
    handler = Recorder()
    server = HttpServer(handler, LIMITS)
    client, stream = trio.testing.memory_stream_pair()
    head = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
    raw = b""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(head)
            while b"\r\n\r\n" not in raw:
                raw += await client.receive_some(65536)
            assert raw.startswith(b"HTTP/1.1 100 ")
            await client.send_all(b"ok")
            await client.send_eof()
            while chunk := await client.receive_some(65536):
                raw += chunk
    assert raw.endswith(b"echo:ok")


async def test_a_body_cut_short_by_the_clients_eof_is_400_and_not_handled() -> None:
    handler = Recorder()
    data = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\nonly part"
    answers = responses(await exchange(HttpServer(handler, LIMITS), data))
    assert [(s, h["connection"]) for s, h, _ in answers] == [(400, "close")]
    assert handler.requests == []


async def test_a_client_reset_mid_body_ends_the_connection() -> None:
    handler = Recorder()
    server = HttpServer(handler, LIMITS)
    client, stream = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\nab")
            await trio.testing.wait_all_tasks_blocked()
            await client.aclose()  # the server's next receive raises BrokenResourceError
    assert handler.requests == []
    assert server.connections == 0


async def test_a_slow_body_is_answered_408(autojump_clock: trio.testing.MockClock) -> None:
    data = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 40\r\n\r\nslow"
    answers = responses(await exchange(HttpServer(Recorder(), LIMITS), data, eof=False))
    assert [s for s, _, _ in answers] == [408]


async def test_an_idle_connection_closes_silently(autojump_clock: trio.testing.MockClock) -> None:
    assert await exchange(HttpServer(Recorder(), LIMITS), b"", eof=False) == b""


async def test_a_raising_handler_gets_500_and_closes_its_connection_only() -> None:
    handler = Recorder()
    server = HttpServer(handler, LIMITS)
    data = b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\nGET /after HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = responses(await exchange(server, data))
    assert [(s, h["connection"]) for s, h, _ in answers] == [(500, "close")]
    assert [r.path for r in handler.requests] == ["/boom"]
    # The server itself goes on: the next connection is served.
    again = responses(await exchange(server, b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n"))
    assert [(s, b) for s, _, b in again] == [(200, b"echo:")]


async def test_a_handler_that_answers_nothing_gets_500() -> None:
    data = b"GET /silent HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = responses(await exchange(HttpServer(Recorder(), LIMITS), data))
    assert [s for s, _, _ in answers] == [500]


async def test_a_streamed_response_is_chunked_and_keeps_the_connection() -> None:
    data = b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\nGET /x HTTP/1.1\r\nhost: x\r\n\r\n"
    raw = await exchange(HttpServer(Recorder(), LIMITS), data)
    assert b"transfer-encoding: chunked" in raw.lower()
    answers = responses(raw)
    assert [(s, b) for s, _, b in answers] == [(200, b"data: 1\n\ndata: 2\n\n"), (200, b"echo:")]


async def test_head_gets_the_headers_without_the_body() -> None:
    raw = await exchange(HttpServer(Recorder(), LIMITS), b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\n")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"content-length: 5" in head.lower()
    assert rest == b""


async def test_a_custom_error_shape_is_used_for_the_shells_own_answers() -> None:
    def as_json(status: int, message: str) -> HttpResponse:
        return HttpResponse.json(status, {"error": message})

    answers = responses(
        await exchange(HttpServer(Recorder(), LIMITS, error_response=as_json), b"BAD\r\n\r\n")
    )
    assert answers[0][0] == 400
    assert answers[0][1]["content-type"] == "application/json"
    assert answers[0][2].startswith(b'{"error":"bad request')


async def test_wait_disconnected_sees_the_client_leave_and_keeps_pipelined_bytes() -> None:
    seen: list[bool] = []

    async def handler(request: HttpRequest, responder: Responder) -> HttpResponse | None:
        if request.path == "/wait":
            await responder.wait_disconnected()
            seen.append(responder.gone)
            return None
        return HttpResponse(200, b"ok")

    client, stream = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(HttpServer(handler, LIMITS).handle_connection, stream)
            await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
            await client.send_eof()
    assert seen == [True]


async def test_a_client_gone_while_streaming_closes_quietly() -> None:
    async def handler(request: HttpRequest, responder: Responder) -> HttpResponse | None:
        await responder.start(200, [("content-type", "text/plain")])
        await responder.send(b"x" * 1024)
        raise AssertionError("the write to a closed client must fail")

    client, stream = trio.testing.memory_stream_pair()
    server = HttpServer(handler, LIMITS)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await client.aclose()
    assert server.connections == 0


async def test_connections_past_the_limit_are_closed_at_once() -> None:
    server = HttpServer(Recorder(), LIMITS)
    server.connections = LIMITS.max_connections
    client, stream = trio.testing.memory_stream_pair()
    await server.handle_connection(stream)
    assert await client.receive_some(10) == b""


async def test_respond_twice_is_a_bug() -> None:
    async def handler(request: HttpRequest, responder: Responder) -> HttpResponse | None:
        await responder.respond(HttpResponse(200, b"one"))
        return HttpResponse(200, b"two")

    answers = responses(
        await exchange(HttpServer(handler, LIMITS), b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    )
    assert [(s, b) for s, _, b in answers] == [(200, b"one")]


@pytest.mark.processes
async def test_a_failing_handler_does_not_stop_the_loopback_server() -> None:
    server = HttpServer(Recorder(), LIMITS)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            server.serve, await trio.open_tcp_listeners(0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        for target in (b"/boom", b"/ok"):
            with trio.fail_after(10):
                sock = await trio.open_tcp_stream("127.0.0.1", port)
                await sock.send_all(b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                raw = b""
                while chunk := await sock.receive_some(65536):
                    raw += chunk
                    if raw.endswith((b"echo:", b"error\n")):
                        break
                await sock.aclose()
            assert raw.startswith(b"HTTP/1.1 500" if target == b"/boom" else b"HTTP/1.1 200")
        nursery.cancel_scope.cancel()
