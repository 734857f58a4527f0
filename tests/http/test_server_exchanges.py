"""The server shell's lower level: per-connection ``Exchanges``, the reader's disconnect
watch, the upgrade hand-off, the busy answer and the linger on close (memory streams)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.http.server import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    Refusal,
    Responder,
    ServerConnection,
    ServerLimits,
)
from tests.http.test_http_server import LIMITS
from tests.http_wire import exchange, responses

if TYPE_CHECKING:
    import h11


class Checked:
    """Exchanges that refuse ``/closed`` before its body, echo bodies, and fail on ``/boom``."""

    def __init__(self, conn: ServerConnection, log: list[str]) -> None:
        self.conn = conn
        self.log = log

    async def answer(self, head: h11.Request) -> None:
        responder = Responder(self.conn, head_only=False)
        if head.target == b"/closed":
            self.log.append("closed")
            self.conn.close_after = True  # the body is never read
            await responder.respond(HttpResponse(403, b"no", headers=(("connection", "close"),)))
            return
        if head.target == b"/boom":
            raise ZeroDivisionError("a bug")
        try:
            declared = next((int(v) for k, v in head.headers if k == b"content-length"), None)
            body = await self.conn.read_body(8, declared=declared)
        except Refusal as exc:
            self.log.append(f"body refused {exc.status}")
            self.conn.close_after = True
            await responder.respond(
                HttpResponse(exc.status, b"", headers=(("connection", "close"),))
            )
            return
        self.log.append(f"answered {body!r}")
        await responder.respond(HttpResponse(200, b"got:" + body))

    async def refuse(self, refusal: Refusal) -> None:
        self.log.append(f"refused {refusal.status}")
        await Responder(self.conn, head_only=False).respond(HttpResponse(refusal.status, b"shaped"))

    async def failed(self) -> None:
        self.log.append("failed")
        await Responder(self.conn, head_only=False).respond(HttpResponse(500, b"shaped 500"))


def checked_server(log: list[str], limits: ServerLimits = LIMITS, **options: object) -> HttpServer:
    return HttpServer(
        limits=limits,
        exchanges=lambda conn: Checked(conn, log),
        **options,  # type: ignore[arg-type]
    )


async def test_exchanges_answer_heads_and_read_bodies_themselves() -> None:
    log: list[str] = []
    data = (
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
        b"POST /closed HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nxyz"
    )
    answers = responses(await exchange(checked_server(log), data))
    assert [(s, b) for s, _, b in answers] == [(200, b"got:abc"), (403, b"no")]
    assert log == ["answered b'abc'", "closed"]


async def test_a_declared_body_over_the_exchanges_limit_is_refused_before_100_continue() -> None:
    log: list[str] = []
    data = b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 9\r\n\r\n"
    raw = await exchange(checked_server(log), data, eof=False)
    assert not raw.startswith(b"HTTP/1.1 100")
    assert [s for s, _, _ in responses(raw)] == [413]
    assert log == ["body refused 413"]


async def test_the_shells_refusals_go_to_the_exchanges() -> None:
    log: list[str] = []
    answers = responses(await exchange(checked_server(log), b"NOT HTTP\r\n\r\n"))
    assert [(s, b) for s, _, b in answers] == [(400, b"shaped")]
    assert log == ["refused 400"]


async def test_a_part_of_a_head_that_times_out_is_answered_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    raw = await exchange(checked_server(log), b"GET / HTTP/1.1\r\nhost", eof=False)
    assert [s for s, _, _ in responses(raw)] == [408]
    assert log == ["refused 408"]


async def test_an_unexpected_error_is_answered_by_failed_and_closes() -> None:
    log: list[str] = []
    data = b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\nGET /a HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = responses(await exchange(checked_server(log), data))
    assert [(s, b) for s, _, b in answers] == [(500, b"shaped 500")]
    assert log == ["failed"]


async def test_the_reader_cancels_the_response_scope_when_the_client_leaves() -> None:
    outcome: list[str] = []

    class Watched(Checked):
        async def answer(self, head: h11.Request) -> None:
            await self.conn.read_body(0)
            with trio.CancelScope() as scope:
                self.conn.response = scope
                await trio.sleep_forever()
            self.conn.response = None
            outcome.append(f"cancelled={scope.cancelled_caught} eof={self.conn.saw_eof}")

    server = HttpServer(limits=LIMITS, exchanges=lambda conn: Watched(conn, []))
    client, stream = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []
            await client.send_eof()
    assert outcome == ["cancelled=True eof=True"]
    assert server.connections == 0


async def test_an_upgrade_hands_the_stream_on_with_the_head_replayed() -> None:
    received: list[bytes] = []

    class Upgrading(Checked):
        async def answer(self, head: h11.Request) -> None:
            self.conn.upgrade = head

    async def on_upgrade(stream: trio.abc.Stream) -> None:
        data = b""
        while len(data) < 64:
            data += await stream.receive_some(1024)
        received.append(data)
        await stream.send_all(b"switched")

    server = HttpServer(
        limits=LIMITS, exchanges=lambda conn: Upgrading(conn, []), on_upgrade=on_upgrade
    )
    head = b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n"
    client, stream = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(head + b"frame-bytes-after-the-head")
            answer = b""
            while chunk := await client.receive_some(1024):
                answer += chunk
    assert answer == b"switched"  # no HTTP answer: the other protocol's bytes only
    assert received == [head + b"frame-bytes-after-the-head"]


async def test_a_connection_past_the_limit_gets_the_busy_answer() -> None:
    busy = HttpResponse(503, b"busy", headers=(("retry-after", "1"),))
    server = checked_server([], busy_response=busy)
    server.connections = LIMITS.max_connections
    client, stream = trio.testing.memory_stream_pair()
    await server.handle_connection(stream)
    raw = b""
    while chunk := await client.receive_some(1024):
        raw += chunk
    [(status, headers, body)] = responses(raw)
    assert (status, body, headers["retry-after"], headers["connection"]) == (
        503,
        b"busy",
        "1",
        "close",
    )
    assert server.connections == LIMITS.max_connections


async def linger_upload(linger_s: float) -> tuple[bytes, bool]:
    """A 413 to a client still uploading: the answer, and whether the upload went on."""
    limits = ServerLimits(max_body_bytes=4, linger_s=linger_s, write_timeout_s=5.0)
    server = checked_server([], limits=limits)
    client, stream = trio.testing.memory_stream_pair()
    answer = b""
    upload_went_on = True
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 99\r\n\r\n")
            while chunk := await client.receive_some(1024):
                answer += chunk  # the server said EOF (linger) or closed
            try:
                await client.send_all(b"x" * 99)  # the rest of the upload
            except trio.BrokenResourceError:
                upload_went_on = False
            await client.aclose()
    return answer, upload_went_on


async def test_linger_drains_the_clients_upload_after_the_last_answer() -> None:
    answer, upload_went_on = await linger_upload(1.0)
    assert [s for s, _, _ in responses(answer)] == [413]
    assert upload_went_on


async def test_without_linger_the_connection_closes_at_once() -> None:
    answer, upload_went_on = await linger_upload(0.0)
    assert [s for s, _, _ in responses(answer)] == [413]
    assert not upload_went_on


def test_a_handler_and_exchanges_are_exclusive() -> None:
    async def handler(request: HttpRequest, responder: Responder) -> HttpResponse | None:
        return None

    with pytest.raises(ValueError, match="not both"):
        HttpServer()
    with pytest.raises(ValueError, match="not both"):
        HttpServer(handler, exchanges=lambda conn: Checked(conn, []))


def test_limits_of_a_settings_object_take_the_fields_it_names() -> None:
    from dataclasses import dataclass

    from epd_actors.http.server import ServerLimits

    @dataclass
    class Settings:
        max_body_bytes: int = 123
        write_timeout_s: float = 4.5
        api_keys: tuple[str, ...] = ()  # not a limit: ignored

    limits = ServerLimits.of(Settings())
    assert (limits.max_body_bytes, limits.write_timeout_s) == (123, 4.5)
    assert limits.max_header_bytes == ServerLimits().max_header_bytes
