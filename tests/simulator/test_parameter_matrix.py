"""The real-vLLM lane's parameter matrix, run here against the simulator's vLLM HTTP double.

The lane (``tests/real_vllm``) sends every case of ``tests/real_vllm/matrix.py``
through routers over real vLLM engines and to a plain ``vllm serve``.  Here the
same harness runs in full against what this machine has: a router over the
simulator's vLLM HTTP double (``worker --engine sim --serve-openai``; a P and a
D) versus that double served whole (a PD) directly.  The fields the simulator
honours must give the plain answer through the router, token by token; the
ones it refuses must come back through the router as 400 naming them.  The
harness's own judgements are pinned too, on hand-made replies, so that each
comparison is shown to fail when it should.
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

from epd_actors.backends.openai_http.backend import OpenAIHttpSettings
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.router import DefaultBackendFactory, open_router
from epd_actors.frontends.http import serve_http
from epd_actors.frontends.http_app import RouterHttpApp
from epd_actors.openai.fields import ENGINE_FIELDS, ROUTER_FIELDS
from epd_actors.protocol import Role
from epd_actors.simulator.engine import SIM_OPTIONS, SimConfig, SimEngine
from epd_actors.simulator.openai_server import SimOpenAIServer, serve_openai
from epd_actors.simulator.store import create_sim_stores
from epd_actors.worker.engines.vllm_io import VLLM_OPTIONS
from tests.real_vllm import matrix
from tests.real_vllm.matrix import (
    CHAT,
    SIM,
    VLLM_NATIVE,
    Case,
    Model,
    PlainAnswers,
    Profile,
    Reply,
    check_case,
    run_matrix,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

GUARD_S = 60.0  # real seconds: a hung matrix fails instead of hanging the run
MODEL = Model("sim-model", eos_token_id=0, special_token_id=1)
QUICK = SimConfig(encode_item_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)
FAST = OpenAIHttpSettings(health_interval_s=0.05, health_timeout_s=2.0, read_timeout_s=10.0)


async def _serve_double(nursery: trio.Nursery, server: SimOpenAIServer) -> str:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(serve_openai, server, listeners)
    return server.url


@asynccontextmanager
async def router_and_plain() -> AsyncIterator[tuple[str, str]]:
    """A router over a simulated P and D (vLLM's HTTP contract), and a PD double: their URLs."""
    stores = create_sim_stores()

    def double(worker_id: str, role: Role) -> SimOpenAIServer:
        engine = SimEngine(
            role, worker_id=worker_id, config=QUICK, ec_store=stores.ec, kv_store=stores.kv
        )
        return SimOpenAIServer(engine, worker_id=worker_id)

    async with trio.open_nursery() as nursery:
        urls = {
            stage: await _serve_double(nursery, double(f"{stage}-0", Role(stage)))
            for stage in ("prefill", "decode", "pd")
        }
        pools = tuple(
            PoolConfig(stage, (WorkerEndpoint(f"{stage}-0", urls[stage], "openai_http"),))
            for stage in ("prefill", "decode")
        )
        config = RouterConfig(pools, model=MODEL.name)
        factory = DefaultBackendFactory(openai_http=FAST)
        async with open_router(config, backend_factory=factory) as router:
            await router.wait_ready()
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(serve_http, RouterHttpApp(router), listeners)
            port = listeners[0].socket.getsockname()[1]
            yield f"http://127.0.0.1:{port}", urls["pd"]
            nursery.cancel_scope.cancel(reason="matrix finished")


def no_validator(instance: object, schema: object) -> list[str]:
    raise AssertionError("the simulator refuses every constrained-output case")


async def run_sim_matrix(profile: Profile = SIM) -> matrix.MatrixReport:
    with trio.fail_after(GUARD_S):
        async with router_and_plain() as (router_url, plain_url):

            def run() -> matrix.MatrixReport:
                with httpx.Client(timeout=GUARD_S) as client:
                    return run_matrix(
                        client,
                        router_url=router_url,
                        plain=PlainAnswers(client, plain_url),
                        model=MODEL,
                        profile=profile,
                        validate=no_validator,
                    )

            return await trio.to_thread.run_sync(run)


SIM_EQUAL = {
    "baseline", "completion", "seeded", "seeded_other", "top_k", "top_p", "top_logprobs",
    "stop", "include_stop_str_in_output", "min_tokens", "stop_token_ids",
}  # fmt: skip
"""The cases the simulator honours: answered through the router exactly as directly."""


async def test_the_matrix_through_the_router_equals_the_double_or_is_refused_by_name() -> None:
    report = await run_sim_matrix()
    problems = report.problems()
    assert not problems, "\n".join(problems)
    outcomes = report.outcomes()
    assert {name for name, outcome in outcomes.items() if outcome == "equal"} == SIM_EQUAL
    refused = {
        name: o.removeprefix("refused ") for name, o in outcomes.items() if name not in SIM_EQUAL
    }
    assert set(refused.values()) <= SIM.refuses
    assert refused["echo"] == "echo"
    assert refused["ignore_eos"] == "logit_bias"  # ignore_eos itself is honoured, and first
    assert refused["tool_choice_named"] == "tools"


async def test_a_profile_that_misjudges_the_engine_fails_the_matrix() -> None:
    """Claiming the simulator refuses ``stop`` and honours ``logit_bias``: both are caught."""
    wrong = Profile("wrong", refuses=(SIM.refuses - {"logit_bias"}) | {"stop"}, inert=SIM.inert)
    report = await run_sim_matrix(wrong)
    results = report.results
    assert results["stop"].outcome == "refused stop"
    assert results["stop"].problems[0].startswith("expected 400 naming 'stop', got 200")
    assert results["logit_bias"].outcome == "failed"
    assert "the router answered 400" in results["logit_bias"].problems[-1]
    assert "logit_bias" in results["logit_bias"].problems[-1]
    assert results["baseline"].outcome == "equal"


async def test_the_double_answers_logprobs_without_streaming_as_vllm_does() -> None:
    """A plain ``vllm serve`` returns one logprob per token in a non-streamed answer too."""
    with trio.fail_after(GUARD_S):
        async with router_and_plain() as (_, plain_url):

            def ask(path: str, body: dict[str, Any]) -> Reply:
                with httpx.Client(timeout=GUARD_S) as client:
                    return matrix.post(client, plain_url, path, body)

            chat = matrix.chat_base(MODEL)
            completion = matrix.completion_base(MODEL)
            chat_reply = await trio.to_thread.run_sync(ask, CHAT, chat)
            completion_reply = await trio.to_thread.run_sync(ask, matrix.COMPLETIONS, completion)
            plain_reply = await trio.to_thread.run_sync(ask, CHAT, {**chat, "logprobs": False})
    content = chat_reply.choice()["logprobs"]["content"]
    assert len(content) == matrix.MAX_TOKENS
    assert all(entry["logprob"] < 0 for entry in content)
    assert len(completion_reply.choice()["logprobs"]["token_logprobs"]) == matrix.MAX_TOKENS
    assert plain_reply.choice()["logprobs"] is None


# ---------------------------------------------------------------- the profiles


@pytest.mark.parametrize(
    ("profile", "honoured"),
    [(SIM, SIM_OPTIONS), (VLLM_NATIVE, VLLM_OPTIONS)],
    ids=["sim", "native"],
)
def test_a_profile_refuses_exactly_the_matrix_fields_its_engine_does_not_declare(
    profile: Profile, honoured: frozenset[str]
) -> None:
    engine_fields = matrix.MATRIX_FIELDS & ENGINE_FIELDS.keys()
    assert engine_fields - honoured == profile.refuses
    assert not profile.refuses & ROUTER_FIELDS["chat"]


def test_every_matrix_field_is_sent_by_some_case() -> None:
    cases = matrix.build_cases(MODEL, FACTS)
    sent = {name for case in cases for name in case.fields}
    assert sent >= matrix.MATRIX_FIELDS
    assert len({case.name for case in cases}) == len(cases)
    references = {case.reference for case in cases} - {None}
    assert references <= {case.name for case in cases}


# ---------------------------------------------------------------- the judgements


FACTS = matrix.Facts("the quick brown fox jumps over", (5, 6, 7, 8, 9, 10, 11, 12))


def chat_reply(
    text: str = "brown fox",
    *,
    logprobs: list[tuple[str, float]] | None = None,
    finish: str = "length",
    status: int = 200,
    tool_calls: list[dict[str, Any]] | None = None,
) -> Reply:
    entries = [
        {"token": token, "logprob": value, "bytes": None, "top_logprobs": []}
        for token, value in logprobs or [("brown", -1.0), (" fox", -2.0)]
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL.name,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": entries},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }
    return Reply(status, body)


def judge(
    case: Case, router: Reply, plain: Reply, reference: Reply | None, profile: Profile = SIM
) -> matrix.CaseResult:
    return check_case(
        case,
        case.body(MODEL),
        router=router,
        plain=plain,
        reference=reference,
        profile=profile,
        validate=lambda instance, schema: [] if instance == {"unit": "c"} else ["invalid"],
    )


STOP = Case("stop", {"stop": ["fox"]})
REFERENCE = chat_reply("brown fox jumps")


def test_equal_answers_within_the_tolerance_pass() -> None:
    nudged = chat_reply(logprobs=[("brown", -1.0 + 1e-3), (" fox", -2.0 - 1e-3)])
    assert judge(STOP, nudged, chat_reply(), REFERENCE).problems == []


@pytest.mark.parametrize(
    ("router", "where"),
    [
        (chat_reply("brown"), "text"),
        (chat_reply(logprobs=[("brown", -1.0), (" fax", -2.0)]), "logprobs[1].token"),
        (chat_reply(logprobs=[("brown", -1.0), (" fox", -2.01)]), "logprobs[1].logprob"),
        (chat_reply(logprobs=[("brown", -1.0)]), "logprobs: 1 entries != 2"),
        (chat_reply(finish="stop"), "finish_reason"),
    ],
    ids=["text", "token", "logprob", "token-count", "finish-reason"],
)
def test_a_router_answer_that_differs_is_caught(router: Reply, where: str) -> None:
    result = judge(STOP, router, chat_reply(), REFERENCE)
    assert result.outcome == "failed"
    assert any(where in problem for problem in result.problems), result.problems


def test_alternatives_are_compared_token_by_token() -> None:
    def with_top(alternatives: list[tuple[str, float]]) -> Reply:
        reply = chat_reply()
        for entry in reply.body["choices"][0]["logprobs"]["content"]:
            entry["top_logprobs"] = [{"token": t, "logprob": v} for t, v in alternatives]
        return reply

    plain = with_top([("brown", -1.0), ("red", -1.5)])
    assert judge(STOP, with_top([("brown", -1.0), ("red", -1.5)]), plain, REFERENCE).problems == []
    dropped = judge(STOP, chat_reply(), plain, REFERENCE)
    assert any("logprobs[0].top" in problem for problem in dropped.problems)


def test_a_field_that_changed_nothing_on_the_plain_engine_fails_its_case() -> None:
    result = judge(STOP, chat_reply(), chat_reply(), chat_reply())
    assert result.outcome == "failed"
    assert "changed nothing on the plain engine" in result.problems[0]
    inert = Case("top_k", {"top_k": 1}, "stop")
    assert judge(inert, chat_reply(), chat_reply(), chat_reply()).problems == []


def test_a_refusal_must_be_a_400_naming_the_first_refused_field() -> None:
    case = Case("ignore_eos", {"ignore_eos": True, "logit_bias": {"1": 100}, "min_p": 0.5})
    named = Reply(
        400, {"error": {"message": "no", "type": "BadRequestError", "param": "logit_bias"}}
    )
    assert judge(case, named, chat_reply(), None).outcome == "refused logit_bias"
    assert judge(case, named, chat_reply(), None).problems == []
    other = Reply(400, {"error": {"message": "no", "param": "min_p"}})
    assert (
        judge(case, other, chat_reply(), None)
        .problems[0]
        .startswith("expected 400 naming 'logit_bias'")
    )
    assert (
        judge(case, chat_reply(), chat_reply(), None)
        .problems[0]
        .startswith("expected 400 naming 'logit_bias', got 200")
    )


def test_an_error_from_either_side_fails_a_compared_case() -> None:
    error = Reply(500, {"error": {"message": "boom"}})
    assert "the router answered 500" in judge(STOP, error, chat_reply(), REFERENCE).problems[0]
    assert (
        "the plain engine answered 500" in judge(STOP, chat_reply(), error, REFERENCE).problems[0]
    )


def tool_reply(name: str, arguments: str, finish: str = "stop", *, calls: int = 1) -> Reply:
    call = {"id": "call-1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return chat_reply("", tool_calls=[call] * calls, finish=finish)


@pytest.mark.parametrize(
    ("reply", "only_one", "problem"),
    [
        (tool_reply("get_weather", '{"unit": "c"}'), True, None),
        (tool_reply("get_weather", '{"unit": "c'), True, "not JSON"),
        (tool_reply("get_weather", '{"unit": "c', finish="length"), True, None),
        (tool_reply("get_weather", '{"unit": "k"}'), True, "invalid"),
        (tool_reply("get_time", '{"unit": "c"}'), True, "expected a call of get_weather"),
        (chat_reply("sunny"), True, "expected one tool call, got 0"),
        (chat_reply("sunny"), False, "expected a tool call, got 0"),
        (tool_reply("get_weather", '{"unit": "c"}', calls=2), True, "expected one tool call"),
        (tool_reply("get_weather", '{"unit": "c"}', calls=2), False, None),
        (tool_reply("get_weather", '{"unit": "k"}', calls=2), False, "invalid"),
        (Reply(200, {"choices": "none"}), True, "the openai client cannot read the answer"),
    ],
    ids=[
        "valid", "cut-json", "cut-short", "schema", "other-tool", "no-call", "required-no-call",
        "named-two-calls", "required-two-calls", "required-schema", "unreadable",
    ],
)  # fmt: skip
def test_a_forced_tool_call_is_read_with_the_openai_client_types(
    reply: Reply, only_one: bool, problem: str | None
) -> None:
    check = matrix.forced_tool_call(matrix.WEATHER_TOOL, only_one=only_one)
    found = check(reply, lambda instance, schema: [] if instance == {"unit": "c"} else ["invalid"])
    assert found == [] if problem is None else problem in found[0], found


def test_constrained_text_checks() -> None:
    never = lambda instance, schema: ["invalid"]  # noqa: E731
    assert matrix.one_of(["yes", "no"])(chat_reply("yes"), never) == []
    assert matrix.one_of(["yes", "no"])(chat_reply("yess"), never) == [
        "'yess' is not one of ['yes', 'no']"
    ]
    assert matrix.matches("[a-c]{3}")(chat_reply("abc"), never) == []
    assert matrix.matches("[a-c]{3}")(chat_reply("abcd"), never) != []
    strict = matrix.json_answer(matrix.FLAG_SCHEMA, must_finish=True)
    lenient = matrix.json_answer(matrix.FLAG_SCHEMA, must_finish=False)
    assert strict(chat_reply('{"flag"'), never)[0].startswith("the JSON answer did not finish")
    assert lenient(chat_reply('{"flag"'), never) == []
    assert strict(chat_reply('{"flag": tru', finish="stop"), never)[0].startswith(
        "the answer is not JSON"
    )
    assert strict(chat_reply('{"flag": 1}', finish="stop"), never) == ["invalid"]


def test_the_cases_are_built_from_the_baseline_answer() -> None:
    cases = {case.name: case for case in matrix.build_cases(MODEL, FACTS)}
    assert cases["stop"].fields == {"stop": ["fox"]}  # the middle word
    assert cases["stop_token_ids"].fields == {"stop_token_ids": [9]}
    assert cases["bad_words"].fields == {"bad_words": ["the"]}
    assert cases["logit_bias"].fields == {"logit_bias": {"6": matrix.BIAS_FORCE}}
    assert cases["bias_pair"].fields == {"logit_bias": {"5": 10, "6": 9}}
    assert cases["ignore_eos"].fields == {
        "ignore_eos": True,
        "logit_bias": {"0": matrix.BIAS_FORCE},
    }
    assert matrix.stop_string("ab\ufffd") == "b"  # from the middle on
    assert matrix.bias_pair(matrix.Facts("x", (4, 4, 4, 4))) == (4, 5)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(400, {"error": {"message": "no"}}), "refused the probe"),
        (chat_reply(), "returned no token_ids"),
    ],
    ids=["refused", "no-token-ids"],
)
def test_a_probe_without_what_the_cases_need_fails_clearly(reply: Reply, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        matrix.facts_of(reply)


def test_a_baseline_without_visible_text_fails_clearly() -> None:
    with pytest.raises(AssertionError, match="no visible character"):
        matrix.stop_string("\ufffd \n")
    with pytest.raises(AssertionError, match="no word to ban"):
        matrix.banned_word("\ufffd")


def test_json_validation_needs_jsonschema_and_says_so() -> None:
    validate = matrix.jsonschema_validator(sys.executable)
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="has no jsonschema"):
            validate({"flag": True}, matrix.FLAG_SCHEMA)
    else:
        assert validate({"flag": True}, matrix.FLAG_SCHEMA) == []
        assert validate({"flag": 1}, matrix.FLAG_SCHEMA) != []
