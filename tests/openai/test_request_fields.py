"""Every OpenAI request field reaches the engine or is refused by name (docs/http.md).

The table itself (:mod:`epd_actors.openai.fields`) is tested field by
field; then requests go through the HTTP and WebSocket front ends to the
router, on the native backend (simulated workers) and on the HTTP backend (the
simulator's vLLM HTTP double), to show that a forwarded field changes the
answer there and that a field the engine cannot honour comes back as a 400
naming it, never as a silently different answer.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
from trio_websocket import open_websocket_url

from epd_actors.core.router import open_router
from epd_actors.errors import InvalidRequest
from epd_actors.frontends.http import RouterHttpApp
from epd_actors.frontends.ws import WsSettings
from epd_actors.openai.fields import (
    ENGINE_FIELDS,
    REFUSED_FIELDS,
    ROUTER_FIELDS,
    FieldPolicy,
    engine_options,
)
from epd_actors.openai.schema import parse_chat_completion, parse_completion
from epd_actors.protocol import ChatMessage, Prompt, SamplingParams
from epd_actors.request import DeltaEvent, DoneEvent, GenerationRequest
from epd_actors.testing import build_sim_fleet
from tests.backends.test_openai_http_backend import fleet_router, sim_http_fleet
from tests.frontends.test_http_frontend import ScriptedApp, connected
from tests.frontends.test_ws_frontend import receive, send, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.core.router import Router

CHAT_BODY: dict[str, object] = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "count to ten"}],
    "max_tokens": 8,
    "temperature": 0,
}

SAMPLE_VALUES: dict[str, object] = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.1,
    "length_penalty": 1.0,
    "logit_bias": {"42": -100},
    "min_p": 0.1,
    "ignore_eos": True,
    "stop_token_ids": [7, 9],
    "allowed_token_ids": [1, 2, 3],
    "bad_words": ["darn"],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 64,
    "vllm_xargs": {"k": 1},
    "logits_processors": ["pkg.module:Processor"],
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "structured_outputs": {"choice": ["yes", "no"]},
    "guided_json": {"type": "object"},
    "guided_regex": "[0-9]+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'x'",
    "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "parallel_tool_calls": False,
    "reasoning_effort": "low",
    "include_reasoning": True,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"fps": 1},
    "media_io_kwargs": {"video": {"num_frames": 4}},
    "return_tokens_as_token_ids": True,
    "priority": -1,
    "cache_salt": "tenant-1",
}
"""One valid value per engine field (the test below checks that every field has one)."""

BAD_VALUES: dict[str, tuple[object, str]] = {
    "frequency_penalty": (3, "frequency_penalty"),
    "repetition_penalty": (0, "repetition_penalty"),
    "logit_bias": ({"x": 1}, "logit_bias"),
    "min_p": (-0.1, "min_p"),
    "ignore_eos": ("yes", "ignore_eos"),
    "stop_token_ids": ([1, -1], "stop_token_ids[1]"),
    "allowed_token_ids": ([], "allowed_token_ids"),
    "bad_words": ([1], "bad_words[0]"),
    "response_format": ({"type": "json_schema"}, "response_format.json_schema"),
    "tools": ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    "tool_choice": ("sometimes", "tool_choice"),
    "reasoning_effort": ("max", "reasoning_effort"),
    "chat_template_kwargs": ([], "chat_template_kwargs"),
}


def chat_body(**fields: object) -> dict[str, object]:
    return {**CHAT_BODY, **fields}


def parse(body: dict[str, object], policy: FieldPolicy | None = None) -> object:
    from epd_actors.openai.media import MediaLimits

    kwargs = {} if policy is None else {"policy": policy}
    return parse_chat_completion(body, request_id="r", limits=MediaLimits(), **kwargs)


def refusal(body: dict[str, object], *, completion: bool = False) -> InvalidRequest:
    from epd_actors.openai.media import MediaLimits

    parser = parse_completion if completion else parse_chat_completion
    with pytest.raises(InvalidRequest) as caught:
        parser(body, request_id="r", limits=MediaLimits())
    return caught.value


# ---------------------------------------------------------------- the table


def test_the_table_names_each_field_once() -> None:
    engine, refused = set(ENGINE_FIELDS), set(REFUSED_FIELDS)
    router = ROUTER_FIELDS["chat"] | ROUTER_FIELDS["completion"]
    assert not engine & refused
    assert not engine & router
    assert not refused & router
    assert set(SAMPLE_VALUES) == engine


@pytest.mark.parametrize("name", sorted(ENGINE_FIELDS))
def test_every_engine_field_is_carried_verbatim(name: str) -> None:
    value = SAMPLE_VALUES[name]
    kind = "chat" if "chat" in ENGINE_FIELDS[name].kinds else "completion"
    assert engine_options({name: value}, kind, FieldPolicy()) == {name: value}


@pytest.mark.parametrize(("name", "bad"), sorted(BAD_VALUES.items()))
def test_a_badly_shaped_engine_field_is_refused_by_name(name: str, bad: tuple[object, str]) -> None:
    value, param = bad
    assert refusal(chat_body(**{name: value})).param == param


@pytest.mark.parametrize(
    ("name", "value", "harmless"),
    [
        ("best_of", 2, 1),
        ("use_beam_search", True, False),
        ("prompt_logprobs", 1, None),
        ("return_token_ids", True, False),
        ("functions", [{"name": "f"}], []),
        ("kv_transfer_params", {"do_remote_decode": True}, None),
        ("ec_transfer_params", {}, None),
        ("request_id", "mine", None),
    ],
)
def test_refused_fields_say_why_unless_harmless(name: str, value: object, harmless: object) -> None:
    error = refusal(chat_body(**{name: value}))
    assert error.param == name
    assert str(error)
    if harmless is not None:
        assert parse(chat_body(**{name: harmless})).options is None  # type: ignore[attr-defined]


def test_an_unknown_field_is_refused_unless_the_router_forwards_unknown_fields() -> None:
    error = refusal(chat_body(web_search_options={}))
    assert (error.param, error.code) == ("web_search_options", "unknown_parameter")
    parsed = parse(chat_body(web_search_options={}), FieldPolicy(unknown="forward"))
    assert parsed.options == {"web_search_options": {}}  # type: ignore[attr-defined]


def test_null_means_unset_for_every_field() -> None:
    parsed = parse(chat_body(frequency_penalty=None, anything_at_all=None, best_of=None))
    assert parsed.options is None  # type: ignore[attr-defined]


def test_a_chat_field_is_not_a_completions_field() -> None:
    body = {"model": "m", "prompt": "x", "tools": []}
    assert refusal(body, completion=True).param == "tools"


def test_the_transfer_fields_are_a_worker_s_to_accept() -> None:
    body = chat_body(kv_transfer_params={"do_remote_decode": True}, return_token_ids=True)
    parsed = parse(body, FieldPolicy(accept_transfer_fields=True))
    assert parsed.options == {  # type: ignore[attr-defined]
        "kv_transfer_params": {"do_remote_decode": True},
        "return_token_ids": True,
    }


def test_message_fields_travel_with_their_message() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = chat_body(
        messages=[
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    messages = parse(body).prompt.messages  # type: ignore[attr-defined]
    assert messages == (
        ChatMessage("user", ("hi",), {"name": "ann"}),
        ChatMessage("assistant", (), {"tool_calls": [call]}),
        ChatMessage("tool", ("42",), {"tool_call_id": "c1"}),
    )


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls[0].id"),
        ({"role": "user", "content": "x", "colour": "red"}, "messages[0].colour"),
    ],
    ids=["tool-call-id-on-user", "tool-call-without-id", "unknown-key"],
)
def test_bad_message_fields_are_refused_by_name(message: dict[str, object], param: str) -> None:
    assert refusal(chat_body(messages=[message])).param == param


# ---------------------------------------------------------------- through the router


@asynccontextmanager
async def router_on(backend: str) -> AsyncIterator[Router]:
    """A router on simulated E+P+D workers, over the native or the HTTP backend."""
    if backend == "native":
        fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1})
        async with open_router(
            fleet.router_config(), backend_factory=fleet.backend_factory
        ) as router:
            await router.wait_ready()
            yield router
        return
    async with (
        sim_http_fleet({"encode": 1, "prefill": 1, "decode": 1}) as http_fleet,
        fleet_router(http_fleet) as router,
    ):
        yield router


async def token_ids(router: Router) -> list[int]:
    request = GenerationRequest(
        Prompt(messages=(ChatMessage("user", ("count to ten",)),)),
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
    )
    ids: list[int] = []
    async with router.generate(request) as events:
        async for event in events:
            if isinstance(event, DeltaEvent):
                ids += event.token_ids
            else:
                assert not isinstance(event, DoneEvent) or event.finish_reason == "length"
    return ids


BACKENDS = pytest.mark.parametrize("backend", ["native", "openai_http"])


@BACKENDS
async def test_a_forwarded_field_changes_the_answer_at_the_engine(backend: str) -> None:
    """``stop_token_ids`` is honoured by the engine, on both backends, from the HTTP front end."""
    async with router_on(backend) as router, connected(RouterHttpApp(router)) as client:
        ids = await token_ids(router)
        assert len(ids) == 8
        body = chat_body(stop_token_ids=[ids[2]])
        reply = await client.request("POST", "/v1/chat/completions", json_body=body)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert answer["usage"]["completion_tokens"] == 3  # type: ignore[index]


@BACKENDS
async def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(backend: str) -> None:
    async with router_on(backend) as router, connected(RouterHttpApp(router)) as client:
        body = chat_body(frequency_penalty=0.5)
        reply = await client.request("POST", "/v1/chat/completions", json_body=body)
    assert reply.status == 400, reply.body
    error = reply.error()
    assert error["param"] == "frequency_penalty"
    assert "frequency_penalty" in str(error["message"])


async def test_unset_sampling_fields_are_not_sent_to_vllm() -> None:
    """The engine decides what the client left unset: no temperature, top_p or max_tokens."""
    async with sim_http_fleet({"prefill": 1, "decode": 1}) as fleet, fleet_router(fleet) as router:
        request = GenerationRequest(Prompt(text="hello"), sampling=SamplingParams(max_tokens=3))
        async with router.generate(request) as events:
            async for _ in events:
                pass
        (prefill,), (decode,) = fleet.log("prefill-0"), fleet.log("decode-0")
    for entry in (prefill, decode):
        assert entry.get("temperature") is None
        assert entry.get("top_p") is None
    assert decode["max_tokens"] == 3


# ---------------------------------------------------------------- the front ends


async def test_http_names_an_unknown_field() -> None:
    app = ScriptedApp()
    async with connected(app) as client:
        reply = await client.request(
            "POST", "/v1/chat/completions", json_body={**chat_body(), "model": "m", "store": True}
        )
    assert reply.status == 400
    assert (reply.error()["param"], reply.error()["code"]) == ("store", "unknown_parameter")
    assert app.requests == []


async def ws_error(request: dict[str, object], settings: WsSettings | None = None) -> dict:
    """The ``error`` a WebSocket generation of ``request`` gets (it must get one)."""
    async with serving(settings) as served, open_websocket_url(served.url) as ws:
        await send(ws, {"type": "generate", "id": "g1", "kind": "chat", "request": request})
        message = await receive(ws)
    assert message["type"] == "error"
    error = message["error"]
    assert isinstance(error, dict)
    return error


async def test_websocket_names_an_unknown_field() -> None:
    error = await ws_error({**chat_body(), "store": True})
    assert (error["param"], error["code"]) == ("store", "unknown_parameter")


async def test_websocket_forwards_unknown_fields_when_told() -> None:
    settings = WsSettings(fields=FieldPolicy(unknown="forward"))
    error = await ws_error({**chat_body(), "store": True}, settings)
    # Forwarded to the simulated engine, which does not know it either: refused by name there.
    assert error["param"] == "store"
    assert "not supported by this worker" in str(error["message"])


async def test_websocket_refuses_a_refused_field_saying_why() -> None:
    error = await ws_error({**chat_body(), "n": 2})
    assert error["param"] == "n"
    assert "one request per choice" in str(error["message"])


# ---------------------------------------------------------------- HEAD and OPTIONS


async def test_head_answers_like_get_without_the_body() -> None:
    async with connected(ScriptedApp()) as client:
        get = await client.request("GET", "/health")
        head = await client.request("HEAD", "/health")
        models = await client.request("HEAD", "/v1/models")
    assert head.status == get.status == 200
    assert head.body == b""
    assert head.headers["content-length"] == str(len(get.body))
    assert head.headers["content-type"] == get.headers["content-type"]
    assert models.status == 200
    assert json.loads(get.body) == {"status": "ok"}


@pytest.mark.parametrize(
    ("path", "allow"),
    [("/health", "GET, HEAD, OPTIONS"), ("/v1/chat/completions", "POST, OPTIONS")],
)
async def test_options_lists_the_methods_of_a_route(path: str, allow: str) -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request("OPTIONS", path)
        again = await client.request("GET", "/health")  # the connection is still usable
    assert (reply.status, reply.headers["allow"], reply.body) == (204, allow, b"")
    assert "content-length" not in reply.headers
    assert again.status == 200


async def test_a_method_a_route_does_not_take_is_a_405_with_allow() -> None:
    async with connected(ScriptedApp()) as client:
        reply = await client.request("HEAD", "/v1/chat/completions")
        unknown = await client.request("OPTIONS", "/nowhere")
    assert (reply.status, reply.headers["allow"]) == (405, "POST, OPTIONS")
    assert reply.body == b""
    assert unknown.status == 404


# ---------------------------------------------------------------- the docs


def test_the_http_docs_list_every_field_with_its_support() -> None:
    """docs/http.md's tables say, per backend, what the code does with each field."""
    from pathlib import Path

    from epd_actors.simulator.engine import SIM_OPTIONS
    from epd_actors.worker.engines.vllm_io import VLLM_OPTIONS

    text = (Path(__file__).resolve().parents[2] / "docs" / "http.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| `")
    }
    for name, spec in ENGINE_FIELDS.items():
        kinds, http, native_vllm, native_sim = rows[name]
        assert kinds == ("both" if len(spec.kinds) == 2 else next(iter(spec.kinds))), name
        assert http == "forwarded", name
        assert (native_vllm == "applied") == (name in VLLM_OPTIONS), name
        assert (native_sim == "applied") == (name in SIM_OPTIONS), name
    for name, rule in REFUSED_FIELDS.items():
        assert rows[name][1] == rule.reason, name


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
        ({"include_obfuscation": False}, "stream_options.include_obfuscation"),
    ],
    ids=["usage-per-chunk", "unknown"],
)
def test_stream_options_the_router_cannot_honour_are_refused(
    options: dict[str, object], param: str
) -> None:
    assert refusal(chat_body(stream=True, stream_options=options)).param == param


def test_harmless_stream_options_are_taken() -> None:
    body = chat_body(
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False, "x": None},
    )
    assert parse(body).include_usage is True  # type: ignore[attr-defined]
