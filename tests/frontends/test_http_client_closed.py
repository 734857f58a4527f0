"""A client that leaves before the router chose an answer is counted as 499, not 0."""

from __future__ import annotations

import trio
import trio.testing

from epd_actors.frontends.http import HttpServer
from epd_actors.frontends.http_connection import CLIENT_CLOSED_STATUS
from tests.frontends.test_http_frontend import CHAT, SETTINGS, Client, ScriptedApp, delta


async def serve_until_left(app: ScriptedApp, body: dict[str, object], *, first_delta: bool) -> None:
    """Send ``body``, wait for its generation (and its first delta's head), then hang up."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = HttpServer(app, SETTINGS)  # type: ignore[arg-type]
    client = Client(client_stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_stream)
        await client.send("POST", "/v1/chat/completions", json_body=body)
        await app.started.wait()
        if first_delta:
            assert app.feed is not None
            await app.feed.send(delta("hi"))
            assert (await client.head()).status == 200
        await client_stream.aclose()
        await app.left.wait()


async def test_a_client_that_leaves_before_the_answer_counts_as_499() -> None:
    app = ScriptedApp()
    with trio.fail_after(10):
        await serve_until_left(app, {**CHAT, "stream": True}, first_delta=False)
    assert app.observed == [("/v1/chat/completions", CLIENT_CLOSED_STATUS)]


async def test_a_unary_request_whose_client_leaves_counts_as_499() -> None:
    app = ScriptedApp()
    with trio.fail_after(10):
        await serve_until_left(app, dict(CHAT), first_delta=False)
    assert app.observed == [("/v1/chat/completions", 499)]


async def test_a_stream_whose_client_leaves_after_its_head_keeps_its_200() -> None:
    app = ScriptedApp()
    with trio.fail_after(10):
        await serve_until_left(app, {**CHAT, "stream": True}, first_delta=True)
    assert app.observed == [("/v1/chat/completions", 200)]
