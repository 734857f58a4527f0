"""The ``openai_http`` backend's HTTP/1.1 client against canned servers on loopback.

Each server is a Trio listener on 127.0.0.1 whose connections run a small
handler that reads one request head (and its body) and writes scripted bytes,
sometimes in odd pieces, so that framing split across reads is covered.
Real sockets, real clock; every test runs under ``fail_after``.
"""

from __future__ import annotations

import functools
import socket
import struct
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.backends.openai_http.backend import OpenAIHttpBackend, OpenAIHttpSettings
from epd_actors.errors import RemoteWorkerError, WorkerDisconnected
from epd_actors.http.client import (
    BadResponse,
    ClientLimits,
    ConnectFailed,
    ConnectionLost,
    RequestTimeout,
    Response,
    ResponseTooLarge,
    WorkerHttpClient,
    _Connection,
)
from epd_actors.protocol import ErrorCode, GenerateRequest, PrefillRequest, Prompt

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    Answer = Callable[[trio.SocketStream, bytes], Awaitable[bool]]

GUARD_S = 10.0
LIMITS = ClientLimits(connect_timeout_s=2.0, read_timeout_s=5.0, pool_timeout_s=5.0)


async def read_request(stream: trio.SocketStream, buffer: bytearray) -> bytes | None:
    """One request (head and Content-Length body) from ``stream``; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(buffer) < end + length:
        buffer += await stream.receive_some(65536)
    request = bytes(buffer[: end + length])
    del buffer[: end + length]
    return request


@asynccontextmanager
async def canned_server(
    answer: Callable[[trio.SocketStream, bytes], Awaitable[bool]],
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Serve ``answer(stream, request) -> keep the connection open?``; yields (URL, requests)."""
    seen: list[bytes] = []

    async def handle(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        async with stream:
            while (request := await read_request(stream, buffer)) is not None:
                seen.append(request)
                if not await answer(stream, request):
                    return

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            yield f"http://127.0.0.1:{port}/base", seen
            nursery.cancel_scope.cancel(reason="test done")


def writes(*parts: bytes, keep: bool = True) -> Answer:
    async def answer(stream: trio.SocketStream, request: bytes) -> bool:
        for part in parts:
            await stream.send_all(part)
            await trio.lowlevel.checkpoint()
        return keep

    return answer


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n"
)


async def test_one_write_per_request_and_keep_alive_reuse() -> None:
    body = b'{"ok":true}'
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n" + body
    async with canned_server(writes(reply)) as (url, seen):
        client = WorkerHttpClient(url, LIMITS, headers=[("authorization", "Bearer k")])
        for _ in range(3):
            response = await client.request(
                "POST", "/v1/x", b"{}", headers=[("x-request-id", "r1")]
            )
            assert response.status == 200
            assert await response.read_all(100) == body
            await response.aclose()
        await client.aclose()
    assert client.connections_opened == 1
    head, _, sent = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/x HTTP/1.1"
    assert b"x-request-id: r1" in lines
    assert b"authorization: Bearer k" in lines
    assert b"content-length: 2" in lines
    assert sent == b"{}"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
async def test_chunked_bodies_split_anywhere(piece: int) -> None:
    parts = [CHUNKED[i : i + piece] for i in range(0, len(CHUNKED), piece)]
    async with canned_server(writes(*parts)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        for _ in range(2):
            response = await client.request("GET", "/s")
            assert response.header("transfer-encoding") == "chunked"
            assert await response.read_all(100) == b"hello, world"
            assert response.complete
            await response.aclose()
        await client.aclose()
    assert client.connections_opened == 1


def chunked_response() -> tuple[_Connection, Response]:
    """A response reading a chunked body from its connection's buffer (no socket I/O)."""
    conn = _Connection(trio.testing.MemorySendStream(), trio.socket.socket())
    response = Response(WorkerHttpClient("http://127.0.0.1:1", LIMITS), conn)
    response._framing = "chunked"
    return conn, response


@pytest.mark.parametrize(
    ("reads", "expected"),
    [
        # One whole chunk per read, as a paced stream's reads come.
        ([b"5;ext=1\r\nhello\r\n", b"7\r\n, world\r\n"], [b"hello", b", world"]),
        ([b"4\r\na\r\nb\r\n"], [b"a\r\nb"]),  # a CRLF inside the data
        ([b"5\r\nhel", b"lo\r\n"], [b"hel", b"lo"]),  # the rest of a chunk
        ([b"2\r\nab\r\n3\r\ncde\r\n"], [b"abcde"]),  # two chunks in one read
        ([b"0\r\n\r\n"], [None]),  # the last chunk ends the body
    ],
)
async def test_each_read_of_chunked_framing_gives_its_data(
    reads: list[bytes], expected: list[bytes | None]
) -> None:
    conn, response = chunked_response()
    found: list[bytes | None] = []
    for read in reads:
        conn.buffer += read
        found.append(response.body_nowait())
    conn.socket.close()
    assert found == expected
    assert not conn.buffer or expected[-1] is None


@pytest.mark.parametrize("read", [b"3\r\nab\r\n\r\n", b"2\r\nabc\r\n", b"g\r\nab\r\n"])
async def test_a_whole_read_of_bad_chunked_framing_is_refused(read: bytes) -> None:
    conn, response = chunked_response()
    conn.buffer += read
    with pytest.raises(BadResponse):
        response.body_nowait()
    conn.socket.close()


async def test_next_chunk_merges_every_chunk_already_received() -> None:
    async with canned_server(writes(CHUNKED)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("GET", "/s")
        with trio.fail_after(GUARD_S):
            while b"0\r\n" not in response._conn.buffer:  # type: ignore[union-attr]
                more = await client._receive(response._conn)  # type: ignore[arg-type]
                response._conn.buffer += more  # type: ignore[union-attr]
        assert await response.next_chunk() == b"hello, world"
        assert await response.next_chunk() is None
        await response.aclose()
        await client.aclose()


async def test_informational_heads_are_skipped_and_close_framing_is_not_reused() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\nuntil the end"
    async with canned_server(writes(reply, keep=False)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        for _ in range(2):
            response = await client.request("GET", "/s")
            assert response.status == 200
            assert await response.read_all(100) == b"until the end"
            await response.aclose()
        await client.aclose()
    assert client.connections_opened == 2


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    closed = trio.Event()

    async def answer(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
        await stream.aclose()
        closed.set()
        return False

    async with canned_server(answer) as (url, seen):
        client = WorkerHttpClient(url, LIMITS)
        for _ in range(2):
            response = await client.request("GET", "/s")
            assert response.status == 204
            assert await response.read_all(10) == b""
            await response.aclose()
            await closed.wait()
            closed = trio.Event()
        await client.aclose()
    assert (client.connections_opened, len(seen)) == (2, 2)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"SPDY/9 200 OK\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabX\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", ConnectionLost),
        (b"HTTP/1.1 200 OK\r\nx: " + b"y" * 70_000, BadResponse),
        (b"", ConnectionLost),
    ],
)
async def test_broken_responses(reply: bytes, error: type[Exception]) -> None:
    async with canned_server(writes(reply, keep=False)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        with pytest.raises(error):
            await fetch(client)
        await client.aclose()


async def fetch(client: WorkerHttpClient) -> bytes:
    response = await client.request("GET", "/s")
    try:
        return await response.read_all(1000)
    finally:
        await response.aclose()


async def test_limits_and_timeouts() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 100
    async with canned_server(writes(reply)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("GET", "/s")
        with pytest.raises(ResponseTooLarge):
            await response.read_all(99)
        await response.aclose()
        with pytest.raises(ValueError, match="line break"):
            await client.request("GET", "/s", headers=[("x-request-id", "a\r\nb: c")])
        await client.aclose()

    async def silent(stream: trio.SocketStream, request: bytes) -> bool:
        await trio.sleep_forever()
        return False

    quick = ClientLimits(read_timeout_s=0.05, pool_timeout_s=0.05, max_connections=1)
    async with canned_server(silent) as (url, _):
        client = WorkerHttpClient(url, quick)
        with pytest.raises(RequestTimeout, match="reading"):
            await client.request("GET", "/s")
        await client.aclose()
    async with canned_server(writes(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n")) as (url, _):
        client = WorkerHttpClient(url, quick)
        held = await client.request("GET", "/s")  # its body never comes: the slot stays taken
        with pytest.raises(RequestTimeout, match="free connection"):
            await client.request("GET", "/s")
        await held.aclose()
        await client.aclose()


async def test_a_request_larger_than_the_socket_takes_at_once_is_written_in_full() -> None:
    body = bytes(range(256)) * (64 * 1024)  # 16 MiB: more than loopback buffers hold
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def answer_ok(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(reply)
        return True

    async with canned_server(answer_ok) as (url, seen):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("POST", "/big", body)
        assert await response.read_all(10) == b"ok"
        await response.aclose()
        await client.aclose()
    assert seen[0].partition(b"\r\n\r\n")[2] == body

    async def never_reads(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    quick = ClientLimits(write_timeout_s=0.05)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                functools.partial(trio.serve_tcp, never_reads, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            client = WorkerHttpClient(f"http://127.0.0.1:{port}", quick)
            with pytest.raises(RequestTimeout, match="sending"):
                await client.request("POST", "/big", body)
            await client.aclose()
            nursery.cancel_scope.cancel(reason="test done")


async def test_no_server_is_a_connect_failure() -> None:
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = WorkerHttpClient(f"http://127.0.0.1:{port}", LIMITS)
    with trio.fail_after(GUARD_S), pytest.raises(ConnectFailed):
        await client.request("GET", "/health")
    with pytest.raises(ValueError, match="http"):
        WorkerHttpClient("ftp://example.org", LIMITS)


async def test_a_cancelled_request_closes_its_connection() -> None:
    started = trio.Event()
    gone = trio.Event()

    async def stall(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        started.set()
        if not await stream.receive_some(10):
            gone.set()
        return False

    async with canned_server(stall) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("GET", "/s")
        assert await response.next_chunk() == b"a"
        with trio.move_on_after(0.01):
            await response.next_chunk()
        await response.aclose()
        await gone.wait()
        assert client._idle == []
        await client.aclose()


async def test_a_read_waiting_when_its_connection_closes_or_resets_is_a_lost_connection() -> None:
    # The socket is read directly (no Trio stream in between): a close by
    # another task must still wake the wait, and a reset must still be typed.
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    async with canned_server(writes(head)) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("GET", "/s")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(response_closes_soon, response)
            with pytest.raises(ConnectionLost, match="broke while reading"):
                await response.next_chunk()
        await response.aclose()
        await client.aclose()

    async def resets(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(head + b"1\r\na\r\n")
        await trio.sleep(0.05)
        linger = struct.pack("ii", 1, 0)  # close with a reset, not a FIN
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        return False

    async with canned_server(resets) as (url, _):
        client = WorkerHttpClient(url, LIMITS)
        response = await client.request("GET", "/s")
        assert await response.next_chunk() == b"a"
        with pytest.raises(ConnectionLost, match="broke while reading"):
            await response.next_chunk()
        await response.aclose()
        await client.aclose()


async def response_closes_soon(response: Response) -> None:
    await trio.testing.wait_all_tasks_blocked()
    response.close_now()


# ---------------------------------------------------------------- the backend over canned replies


_MODELS = b'{"object":"list","data":[{"id":"m"}]}'
MODEL_LIST = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(_MODELS), _MODELS)


def backend_replies(replies: dict[bytes, bytes], *, close: bool = False) -> Answer:
    """Answer ``GET /health`` with 200, ``GET /v1/models`` with model ``m``, and each
    POST path with its canned reply.

    ``close``: close the connection after a canned reply.
    """

    async def answer(stream: trio.SocketStream, request: bytes) -> bool:
        line = request.split(b"\r\n", 1)[0]
        path = line.split(b" ")[1].removeprefix(b"/base")
        if path == b"/health":
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return True
        if path == b"/v1/models":
            await stream.send_all(MODEL_LIST)
            return True
        await stream.send_all(replies[path])
        return not close

    return answer


@asynccontextmanager
async def ready_backend(
    replies: dict[bytes, bytes], settings: OpenAIHttpSettings, *, close: bool = False
) -> AsyncIterator[OpenAIHttpBackend]:
    """A running backend for a server with ``backend_replies``, once a probe found it ready."""
    async with canned_server(backend_replies(replies, close=close)) as (url, _):
        backend = OpenAIHttpBackend("w", url, model="m", settings=settings)
        async with trio.open_nursery() as nursery:
            await nursery.start(backend.run)
            await backend.wait_ready()
            yield backend
            nursery.cancel_scope.cancel(reason="test done")


def json_reply(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


@pytest.mark.parametrize(
    ("reply", "code", "retryable", "param"),
    [
        (
            json_reply(400, b'{"error": {"message": "too long", "param": "max_tokens"}}'),
            ErrorCode.INVALID_REQUEST,
            False,
            "max_tokens",
        ),
        (json_reply(503, b'{"message": "busy"}'), ErrorCode.OVERLOADED, True, None),
        (json_reply(500, b"oops"), ErrorCode.ENGINE_ERROR, True, None),
        (json_reply(200, b"[1, 2]"), ErrorCode.PROTOCOL_ERROR, True, None),
        (json_reply(200, b'{"pad": "' + b"x" * 300 + b'"}'), ErrorCode.PROTOCOL_ERROR, True, None),
    ],
)
async def test_the_backend_maps_every_reply_of_a_prefill(
    reply: bytes, code: str, retryable: bool, param: str | None
) -> None:
    settings = OpenAIHttpSettings(health_interval_s=0.05, max_response_bytes=256)
    async with ready_backend({b"/v1/completions": reply}, settings) as backend:
        with pytest.raises(RemoteWorkerError) as caught:
            await backend.run_stage(PrefillRequest("r1", Prompt(text="hi")))
    failure = caught.value
    assert (failure.code, failure.retryable, failure.param) == (code, retryable, param)
    assert failure.request_id == "r1"


@pytest.mark.parametrize(
    "events",
    [b"data: not json\n\n", b'data: {"choices": 3}\n\n', b"data: \xff\n\n", b"x" * 300],
    ids=["not-json", "no-choices", "not-utf8", "line-over-limit"],
)
async def test_a_malformed_stream_is_a_protocol_error_of_the_worker(events: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    reply = head + b"content-length: %d\r\n\r\n%s" % (len(events), events)
    settings = OpenAIHttpSettings(health_interval_s=0.05, max_event_bytes=256)
    async with ready_backend({b"/v1/completions": reply}, settings) as backend:
        request = GenerateRequest("r1", Prompt(text="hi"))
        with pytest.raises(RemoteWorkerError) as caught:
            async with backend.open_stream(request) as stream:
                await stream.receive()
    failure = caught.value
    assert (failure.code, failure.retryable) == (ErrorCode.PROTOCOL_ERROR, True)
    assert (failure.stage, failure.request_id) == ("generate", "r1")


async def test_a_lost_connection_is_a_disconnect_and_a_refused_one_takes_the_worker_down() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{"
    replies = {b"/v1/completions": cut}
    async with ready_backend(replies, OpenAIHttpSettings(), close=True) as backend:
        request = PrefillRequest("r1", Prompt(text="hi"))
        with pytest.raises(WorkerDisconnected, match="connection lost"):
            with trio.fail_after(GUARD_S):
                await backend.run_stage(request)
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = OpenAIHttpBackend("p", f"http://127.0.0.1:{port}", model="m")
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        with pytest.raises(WorkerDisconnected, match="cannot connect"):
            await backend.run_stage(PrefillRequest("r2", Prompt(text="hi")))
        assert not backend.status().connected
        nursery.cancel_scope.cancel(reason="test done")
