"""What the client gets back equals what a plain ``vllm serve`` gives for the same request.

Logprob entries (each token's text, ``bytes`` and alternatives), the chat
delta's other keys (``tool_calls`` pieces, ``reasoning_content``) and the
finish reason travel from the engine to the client on both backends: the
simulator behind the native protocol (over memory streams) and the
simulator's vLLM HTTP double (on loopback, port 0); canned vLLM streams,
written by hand in vLLM's exact shape, stand for tool-calling and reasoning
models.  The front end is driven over memory streams; the loopback parts use
the real clock under ``fail_after``.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.backends.openai_http.backend import OpenAIHttpSettings
from epd_actors.backends.openai_http.contract import DeltaParser
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.router import DefaultBackendFactory, open_router
from epd_actors.frontends.http import RouterHttpApp
from epd_actors.frontends.ws_messages import delta_messages
from epd_actors.http.sse import SseDecoder
from epd_actors.protocol import Role, TokenLogprob
from epd_actors.request import DeltaEvent
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import create_sim_stores
from tests.backends.test_openai_http_backend import QUICK, fleet_router, sim_http_fleet
from tests.frontends.test_http_frontend import connected
from tests.http.test_openai_http_client import backend_replies, canned_server
from tests.memory_fleet import MemoryFleet, worker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.core.router import Router

GUARD_S = 10.0  # real seconds: loopback sockets and the real clock
MODEL = "sim-model"
TOP = 2
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "name three colours"}],
    "max_tokens": 5,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": TOP,
}
COMPLETION = {
    "model": MODEL,
    "prompt": "once upon a time",
    "max_tokens": 5,
    "temperature": 0,
    "logprobs": TOP,
}


# ---------------------------------------------------------------- harness


@asynccontextmanager
async def native_router() -> AsyncIterator[Router]:
    """A PD simulator behind a native worker server, reached over memory streams."""
    stores = create_sim_stores()
    engine = SimEngine(
        Role.PD, worker_id="pd-0", config=QUICK, ec_store=stores.ec, kv_store=stores.kv, model=MODEL
    )
    async with trio.open_nursery() as nursery:
        fleet = MemoryFleet(nursery, {"pd-0": worker(engine, "pd-0")})
        config = fleet.config("pd")
        config = RouterConfig(config.pools, model=MODEL)
        async with open_router(config, backend_factory=fleet.backend) as router:
            await router.wait_ready()
            yield router
        nursery.cancel_scope.cancel(reason="test done")


@asynccontextmanager
async def http_router() -> AsyncIterator[Router]:
    """A PD simulator behind its vLLM HTTP double, on loopback."""
    async with sim_http_fleet({"pd": 1}) as fleet, fleet_router(fleet) as router:
        yield router


ROUTERS = {"native": native_router, "openai_http": http_router}


async def post(router: Router, path: str, body: dict[str, object]) -> bytes:
    """The body of the front end's answer to ``body`` (status 200 asserted)."""
    with trio.fail_after(GUARD_S):
        async with connected(RouterHttpApp(router)) as client:
            reply = await client.request("POST", path, json_body=body)
    assert reply.status == 200, reply.body
    return reply.body


def sse_chunks(body: bytes) -> list[dict[str, object]]:
    """The JSON chunks of a server-sent event stream (``[DONE]`` and comments left out)."""
    chunks = []
    for event in body.decode().split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            chunks.append(json.loads(event.removeprefix("data: ")))
    assert body.endswith(b"data: [DONE]\n\n")
    return chunks


def choices(chunks: list[dict[str, object]]) -> list[dict[str, object]]:
    return [c for chunk in chunks for c in chunk["choices"]]  # type: ignore[attr-defined]


def streamed_logprobs(kind: str, chunks: list[dict[str, object]]) -> dict[str, object]:
    """The logprobs of a stream's chunks, concatenated into one choice's ``logprobs``."""
    parts = [c["logprobs"] for c in choices(chunks) if c["logprobs"] is not None]
    if kind == "chat":
        return {"content": [entry for part in parts for entry in part["content"]]}  # type: ignore[index]
    return {
        key: [entry for part in parts for entry in part[key]]  # type: ignore[index]
        for key in ("tokens", "token_logprobs", "top_logprobs")
    }


async def answers(router: Router, kind: str) -> tuple[dict[str, object], dict[str, object]]:
    """(non-streamed logprobs, streamed logprobs concatenated) of the kind's request."""
    path, body = (
        ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    )
    unary = json.loads(await post(router, path, body))
    stream = sse_chunks(await post(router, path, {**body, "stream": True}))
    return unary["choices"][0]["logprobs"], streamed_logprobs(kind, stream)


# ---------------------------------------------------------------- top_logprobs


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_top_logprobs_are_real_alternatives_the_same_on_both_backends(kind: str) -> None:
    seen = {}
    for name, open_one in ROUTERS.items():
        async with open_one() as router:
            seen[name] = await answers(router, kind)
    unary, streamed = seen["native"]
    assert unary == streamed  # streamed or not: the same entries
    assert seen["openai_http"] == seen["native"]  # and the same on both backends
    if kind == "chat":
        entries = unary["content"]
        assert isinstance(entries, list)
        assert len(entries) == 5
        for entry in entries:
            token = entry["token"]
            assert not token.startswith("token_id:")
            assert entry["bytes"] == list(token.encode("utf-8"))
            assert entry["top_logprobs"][0]["token"] == token  # the sampled token first
            assert len({alt["token"] for alt in entry["top_logprobs"]}) == TOP
            for alt in entry["top_logprobs"]:
                assert alt["bytes"] == list(alt["token"].encode("utf-8"))
    else:
        tops, tokens = unary["top_logprobs"], unary["tokens"]
        assert isinstance(tops, list)
        assert isinstance(tokens, list)
        assert [len(top) for top in tops] == [TOP] * 5
        assert [next(iter(top)) for top in tops] == tokens
        assert [top[token] for top, token in zip(tops, tokens, strict=True)] == (
            unary["token_logprobs"]
        )


async def test_the_text_of_the_tokens_is_the_text_of_the_answer() -> None:
    async with native_router() as router:
        reply = json.loads(await post(router, "/v1/chat/completions", CHAT))
    [choice] = reply["choices"]
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert "".join(tokens) == choice["message"]["content"]


# ---------------------------------------------------------------- the vLLM stream parser


def parse(chat: bool, *chunks: dict[str, object]) -> list[object]:
    """The deltas of ``chunks`` written as vLLM streams them, fed one event per read."""
    parser = DeltaParser("r1", chat=chat)
    decoder = SseDecoder(1 << 16)
    deltas = []
    for chunk in (*chunks, "[DONE]"):
        data = chunk if isinstance(chunk, str) else json.dumps(chunk)
        parser.feed(decoder.feed(f"data: {data}\n\n".encode()))
        delta = parser.take()
        if delta is not None:
            deltas.append(delta)
    return deltas


def chat_chunk(delta: dict[str, object], **choice: object) -> dict[str, object]:
    """A ``chat.completion.chunk`` as vLLM writes it (``return_token_ids`` on)."""
    return {
        "id": "chatcmpl-b6a3",
        "object": "chat.completion.chunk",
        "created": 1764547200,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
                **choice,
            }
        ],
    }


USAGE_CHUNK = {
    "id": "chatcmpl-b6a3",
    "object": "chat.completion.chunk",
    "created": 1764547200,
    "model": "m",
    "choices": [],
    "usage": {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3},
}


def test_chat_logprob_entries_keep_their_tokens_and_alternatives() -> None:
    logprobs = {
        "content": [
            {
                "token": " Paris",
                "logprob": -0.25,
                "bytes": [32, 80, 97, 114, 105, 115],
                "top_logprobs": [
                    {"token": " Paris", "logprob": -0.25, "bytes": [32, 80, 97, 114, 105, 115]},
                    {"token": " Lyon", "logprob": -1.5, "bytes": [32, 76, 121, 111, 110]},
                ],
            }
        ]
    }
    [delta, end] = parse(
        True,
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": " Paris"}, logprobs=logprobs, token_ids=[6342]),
        chat_chunk({"content": ""}, finish_reason="stop", token_ids=[]),
        USAGE_CHUNK,
    )
    assert delta.tokens == (" Paris",)  # type: ignore[attr-defined]
    assert delta.logprobs == (-0.25,)  # type: ignore[attr-defined]
    assert delta.top_logprobs == (  # type: ignore[attr-defined]
        (TokenLogprob(" Paris", -0.25), TokenLogprob(" Lyon", -1.5)),
    )
    assert end.finish_reason == "stop"  # type: ignore[attr-defined]


def test_completion_logprobs_keep_their_tokens_and_alternatives() -> None:
    chunk = {
        "id": "cmpl-7d",
        "object": "text_completion",
        "created": 1764547200,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " upon a",
                "logprobs": {
                    "text_offset": [0, 5],
                    "token_logprobs": [-0.5, -0.125],
                    "tokens": [" upon", " a"],
                    "top_logprobs": [{" upon": -0.5, " in": -2.0}, {" a": -0.125, " the": -3.0}],
                },
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": [5193, 264],
            }
        ],
    }
    [delta] = parse(False, chunk)
    assert delta.tokens == (" upon", " a")  # type: ignore[attr-defined]
    assert delta.top_logprobs == (  # type: ignore[attr-defined]
        (TokenLogprob(" upon", -0.5), TokenLogprob(" in", -2.0)),
        (TokenLogprob(" a", -0.125), TokenLogprob(" the", -3.0)),
    )


def test_a_chunk_with_only_tool_call_pieces_is_a_delta_of_its_own() -> None:
    piece = {"index": 0, "function": {"arguments": '{"city": '}}
    [delta] = parse(True, chat_chunk({"tool_calls": [piece]}, token_ids=[]))
    assert delta.fields == {"tool_calls": [piece]}  # type: ignore[attr-defined]
    assert delta.text == ""  # type: ignore[attr-defined]


# ---------------------------------------------------------------- canned vLLM chat streams

TOOL_CALL_DELTAS = [
    {"role": "assistant", "content": ""},
    {
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1f0c",
                "type": "function",
                "index": 0,
                "function": {"name": "get_weather"},
            }
        ]
    },
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": 'Paris"}'}}]},
]
REASONING_DELTAS = [
    {"role": "assistant", "content": ""},
    {"reasoning_content": "The user wants"},
    {"reasoning_content": " a capital."},
    {"content": "Paris"},
]


def canned_stream(deltas: list[dict[str, object]], finish: str) -> bytes:
    """A vLLM chat stream of ``deltas`` (one token each), then ``finish`` and usage."""
    chunks = [chat_chunk(deltas[0])]
    chunks += [chat_chunk(d, token_ids=[900 + i]) for i, d in enumerate(deltas[1:])]
    chunks.append(chat_chunk({"content": ""}, finish_reason=finish, token_ids=[]))
    events = b"".join(b"data: %s\n\n" % json.dumps(chunk).encode() for chunk in chunks)
    events += b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(USAGE_CHUNK).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    return head + b"content-length: %d\r\n\r\n%s" % (len(events), events)


@asynccontextmanager
async def canned_router(stream: bytes) -> AsyncIterator[Router]:
    """A router whose one PD worker is a vLLM server answering every chat with ``stream``."""
    replies = {b"/v1/chat/completions": stream}
    async with canned_server(backend_replies(replies)) as (url, _):
        pool = PoolConfig("pd", (WorkerEndpoint("pd-0", url, "openai_http"),))
        factory = DefaultBackendFactory(openai_http=OpenAIHttpSettings(health_interval_s=0.05))
        async with open_router(RouterConfig((pool,), model="m"), backend_factory=factory) as router:
            with trio.fail_after(GUARD_S):
                await router.wait_ready()
            yield router


def client_accumulates(deltas: list[dict[str, object]]) -> dict[str, object]:
    """What an OpenAI client builds from chat deltas: text joined, tool calls by index."""
    message: dict[str, object] = {"content": "", "tool_calls": {}, "reasoning_content": ""}
    calls: dict[int, dict[str, object]] = message["tool_calls"]  # type: ignore[assignment]
    for delta in deltas:
        message["content"] += delta.get("content") or ""  # type: ignore[operator]
        message["reasoning_content"] += delta.get("reasoning_content") or ""  # type: ignore[operator]
        for piece in delta.get("tool_calls") or ():  # type: ignore[attr-defined]
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in piece:
                    call[key] = piece[key]
            function = piece.get("function", {})
            if "name" in function:
                call["function"]["name"] = function["name"]  # type: ignore[index]
            call["function"]["arguments"] += function.get("arguments", "")  # type: ignore[index]
    return message


CHAT_ONLY = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}]}


@pytest.mark.parametrize(
    ("deltas", "finish"),
    [(TOOL_CALL_DELTAS, "tool_calls"), (REASONING_DELTAS, "stop")],
    ids=["tool-calls", "reasoning"],
)
async def test_canned_chat_deltas_reach_the_streaming_client(
    deltas: list[dict[str, object]], finish: str
) -> None:
    async with canned_router(canned_stream(deltas, finish)) as router:
        body = await post(router, "/v1/chat/completions", {**CHAT_ONLY, "stream": True})
    got = choices(sse_chunks(body))
    assert client_accumulates([c["delta"] for c in got]) == client_accumulates(deltas)  # type: ignore[misc]
    assert [c["finish_reason"] for c in got][-1] == finish


async def test_a_non_streamed_answer_has_the_tool_calls_of_the_stream() -> None:
    async with canned_router(canned_stream(TOOL_CALL_DELTAS, "tool_calls")) as router:
        reply = json.loads(await post(router, "/v1/chat/completions", CHAT_ONLY))
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1f0c",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("tool_choice", "content"),
    [
        ("auto", None),
        ("required", ""),
        ({"type": "function", "function": {"name": "get_weather"}}, ""),
    ],
    ids=["chosen", "required", "named"],
)
async def test_forced_tool_calls_come_with_empty_content_as_vllm_answers_them(
    tool_choice: object, content: str | None
) -> None:
    body = {**CHAT_ONLY, "tools": [WEATHER], "tool_choice": tool_choice}
    async with canned_router(canned_stream(TOOL_CALL_DELTAS, "tool_calls")) as router:
        reply = json.loads(await post(router, "/v1/chat/completions", body))
    message = reply["choices"][0]["message"]
    assert message["content"] == content
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]


def compact_call_deltas(arguments: str) -> list[dict[str, object]]:
    """A tool call streamed as vLLM streams a ``required`` tool_choice: the arguments as
    generated (no whitespace under xgrammar's ``disable_any_whitespace``)."""
    return [
        *TOOL_CALL_DELTAS[:2],
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]},
    ]


@pytest.mark.parametrize(
    ("tool_choice", "generated", "answered"),
    [
        (
            "required",
            '{"city":"Z\u00fcrich","days":[1,2.5]}',
            '{"city": "Zürich", "days": [1, 2.5]}',
        ),
        ("required", '{"city":"Zür', '{"city":"Zür'),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '{"city":"Paris"}',
            '{"city":"Paris"}',
        ),
        ("auto", '{"city":"Paris"}', '{"city":"Paris"}'),
    ],
    ids=["required-rewritten", "required-cut-short-kept", "named-kept", "chosen-kept"],
)
async def test_required_tool_calls_have_their_arguments_written_as_vllm_writes_them(
    tool_choice: object, generated: str, answered: str
) -> None:
    """vLLM's non-streamed answer to ``tool_choice: required`` writes each call's arguments
    again with ``json.dumps``; a named or chosen call keeps them as generated."""
    body = {**CHAT_ONLY, "tools": [WEATHER], "tool_choice": tool_choice}
    async with canned_router(canned_stream(compact_call_deltas(generated), "tool_calls")) as router:
        reply = json.loads(await post(router, "/v1/chat/completions", body))
    [call] = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": answered}


@pytest.mark.parametrize(
    ("tool_choice", "calls"),
    [("required", 0), ({"type": "function", "function": {"name": "get_weather"}}, 1), ("auto", 1)],
    ids=["required-none", "named-kept", "chosen-kept"],
)
async def test_a_required_list_of_calls_cut_short_has_no_calls_as_vllm_answers_it(
    tool_choice: object, calls: int
) -> None:
    """vLLM parses a ``required`` answer's list of calls whole: cut short by ``max_tokens``, its
    non-streamed answer lists no call and has empty content (the stream had the partial call)."""
    body = {**CHAT_ONLY, "tools": [WEATHER], "tool_choice": tool_choice}
    cut = canned_stream(compact_call_deltas('{"city":"Pa'), "length")
    async with canned_router(cut) as router:
        reply = json.loads(await post(router, "/v1/chat/completions", body))
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["message"].get("tool_calls") or []) == calls
    if not calls:
        assert choice["message"]["content"] == ""


async def test_a_non_streamed_answer_has_the_reasoning_of_the_stream() -> None:
    async with canned_router(canned_stream(REASONING_DELTAS, "stop")) as router:
        reply = json.loads(await post(router, "/v1/chat/completions", CHAT_ONLY))
    assert reply["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris",
        "reasoning_content": "The user wants a capital.",
    }


# ---------------------------------------------------------------- WebSocket delta messages


def test_a_websocket_delta_carries_tokens_alternatives_and_fields_merged() -> None:
    top = (TokenLogprob(" a", -0.5), TokenLogprob(" b", -1.0))
    pieces = [
        DeltaEvent("", (), fields={"tool_calls": [{"index": 0, "function": {"name": "f"}}]}),
        DeltaEvent(" a", (5,), (-0.5,), tokens=(" a",), top_logprobs=(top,)),
        DeltaEvent("", (), fields={"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
    ]
    [message] = delta_messages("q1", pieces, logprobs=True)
    assert json.loads(message) == {
        "type": "delta",
        "id": "q1",
        "text": " a",
        "token_ids": [5],
        "logprobs": [-0.5],
        "tokens": [" a"],
        "top_logprobs": [[{"token": " a", "logprob": -0.5}, {"token": " b", "logprob": -1.0}]],
        "fields": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]},
    }


def test_websocket_deltas_whose_arrays_differ_are_not_merged() -> None:
    pieces = [
        DeltaEvent(" a", (5,), (-0.5,), tokens=(" a",)),
        DeltaEvent(" b", (6,), (-0.25,)),
        DeltaEvent(" c", (7,), (-0.125,)),
    ]
    messages = [json.loads(m) for m in delta_messages("q1", pieces, logprobs=True)]
    assert [(m["text"], m["logprobs"], m.get("tokens")) for m in messages] == [
        (" a", [-0.5], [" a"]),
        (" b c", [-0.25, -0.125], None),
    ]
