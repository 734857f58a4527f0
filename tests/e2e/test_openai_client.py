"""The official ``openai`` client against ``serve_http`` on loopback (E+P+D simulated fleet).

The client is synchronous (its async flavour is asyncio-based), so each call
runs in ``trio.to_thread.run_sync`` while the server runs on the Trio loop.
"""

from __future__ import annotations

import base64
import functools
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import openai
import pytest
import trio

from epd_actors.core.router import open_router
from epd_actors.frontends.http import HttpSettings, RouterHttpApp, serve_http
from epd_actors.testing import SimFleet, build_sim_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

MODEL = "sim-model"
KEY = "e2e-key"
GUARD_S = 30
T = TypeVar("T")


@asynccontextmanager
async def served() -> AsyncIterator[tuple[SimFleet, openai.OpenAI]]:
    fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1})
    config = fleet.router_config()
    async with (
        open_router(config, backend_factory=fleet.backend_factory) as router,
        trio.open_nursery() as nursery,
    ):
        await router.wait_ready()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        settings = HttpSettings(api_keys=(KEY,))
        serve = functools.partial(serve_http, settings=settings)
        await nursery.start(serve, RouterHttpApp(router), listeners)
        port = listeners[0].socket.getsockname()[1]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=GUARD_S
        )
        try:
            yield fleet, client
        finally:
            await trio.to_thread.run_sync(client.close)
            nursery.cancel_scope.cancel(reason="test finished")


async def call(fn: Callable[[], T]) -> T:
    with trio.fail_after(GUARD_S):
        return await trio.to_thread.run_sync(fn)


async def test_chat_and_completions_through_the_openai_client() -> None:
    async with served() as (fleet, client):
        chat = await call(
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
            )
        )
        assert chat.choices[0].finish_reason == "length"
        assert chat.choices[0].message.content
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 5

        def stream_chat() -> list[object]:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await call(stream_chat)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[attr-defined]
        assert text.startswith(chat.choices[0].message.content)  # same prompt, one token more
        assert chunks[-1].usage.completion_tokens == 6  # type: ignore[attr-defined]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # type: ignore[attr-defined]

        done = await call(
            lambda: client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
        )
        assert done.object == "text_completion"
        assert done.choices[0].text

        def stream_completion() -> str:
            stream = client.completions.create(
                model=MODEL, prompt="once upon", max_tokens=4, stream=True
            )
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        assert await call(stream_completion) == done.choices[0].text
        assert fleet.total("generate_requests", "decode") == 4


async def test_image_request_goes_through_the_encoder() -> None:
    image = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
    async with served() as (fleet, client):
        reply = await call(
            lambda: client.chat.completions.create(
                model=MODEL,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": image}},
                        ],
                    }
                ],
                max_tokens=3,
            )
        )
        assert reply.choices[0].message.content
        assert fleet.total("encode_requests", "encode") == 1
        assert fleet.total("ec_entries_read", "prefill") == 1


async def test_invalid_request_is_a_bad_request_error() -> None:
    async with served() as (_, client):
        with pytest.raises(openai.BadRequestError) as info:
            await call(
                lambda: client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=7
                )
            )
        assert info.value.status_code == 400
        assert info.value.body["param"] == "temperature"  # type: ignore[index]

        wrong_key = client.with_options(api_key="nope")
        with pytest.raises(openai.AuthenticationError):
            await call(lambda: wrong_key.models.list())


async def test_top_logprobs_parse_in_the_openai_client() -> None:
    messages = [{"role": "user", "content": "hello"}]
    async with served() as (_, client):
        reply = await call(
            lambda: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2
            )
        )

        def stream_chat() -> list[object]:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            )
            return [
                entry
                for chunk in stream
                for choice in chunk.choices
                for entry in (choice.logprobs.content or [] if choice.logprobs else [])
            ]

        streamed = await call(stream_chat)
        completion = await call(
            lambda: client.completions.create(
                model=MODEL, prompt="once upon", max_tokens=3, logprobs=2
            )
        )
    [choice] = reply.choices
    assert choice.logprobs is not None
    content = choice.logprobs.content or []
    assert [len(entry.top_logprobs) for entry in content] == [2, 2, 2, 2]
    assert "".join(entry.token for entry in content) == choice.message.content
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]  # type: ignore[attr-defined]
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.top_logprobs is not None
    assert [len(top) for top in logprobs.top_logprobs] == [2, 2, 2]
    assert logprobs.tokens == [next(iter(top)) for top in logprobs.top_logprobs]
