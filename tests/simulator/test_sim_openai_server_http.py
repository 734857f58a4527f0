"""The ``vllm serve`` double's HTTP edge on the server shell: refusals in vLLM's shape."""

from __future__ import annotations

import json

import trio
import trio.testing

from epd_actors.protocol import Role
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.openai_server import OpenAIServerSettings, SimOpenAIServer
from epd_actors.simulator.store import create_sim_stores
from tests.http_wire import exchange

QUICK = SimConfig(encode_item_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)


def double(config: SimConfig = QUICK, **settings: object) -> SimOpenAIServer:
    stores = create_sim_stores()
    engine = SimEngine(
        Role.PD, worker_id="pd-0", config=config, ec_store=stores.ec, kv_store=stores.kv
    )
    return SimOpenAIServer(
        engine,
        worker_id="pd-0",
        settings=OpenAIServerSettings(**settings),  # type: ignore[arg-type]
    )


async def answer_to(server: SimOpenAIServer, data: bytes) -> tuple[bytes, bytes]:
    head, _, body = (await exchange(server.http, data)).partition(b"\r\n\r\n")
    return head, body


async def test_an_oversized_body_is_413_with_an_openai_error_body() -> None:
    data = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"{" * 100
    head, body = await answer_to(double(max_body_bytes=10), data)
    assert head.startswith(b"HTTP/1.1 413 ")
    error = json.loads(body)["error"]
    assert "exceeds 10 bytes" in error["message"]
    assert error["type"] == "BadRequestError"


async def test_a_malformed_head_is_400_with_an_openai_error_body() -> None:
    head, body = await answer_to(double(), b"GARBAGE\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(body)["error"]["message"].startswith("bad request")


async def test_routes_answer_on_one_keep_alive_connection() -> None:
    data = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\nGET /nowhere HTTP/1.1\r\nhost: x\r\n\r\n"
    head, rest = await answer_to(double(), data)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"HTTP/1.1 404 " in rest
    assert b"no route for GET /nowhere" in rest


async def test_a_client_that_leaves_mid_stream_aborts_the_engine_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow = SimConfig(encode_item_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=1.0)
    server = double(slow)
    body = json.dumps(
        {"model": "sim-model", "prompt": "hi", "max_tokens": 50, "stream": True}
    ).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: r1\r\n"
    request += b"content-length: %d\r\n\r\n%b" % (len(body), body)
    client, stream = trio.testing.memory_stream_pair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(request)
            raw = b""
            while b"data: " not in raw:
                raw += await client.receive_some(65536)
            await client.send_eof()
            await server.log.wait_for(lambda entries: bool(entries[-1]["disconnected"]))
    entry = server.log.snapshot()[-1]
    assert entry["outcome"] == "disconnected"
    assert server.connections == 0
