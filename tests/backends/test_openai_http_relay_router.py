"""Relayed text through a router in front of simulated ``vllm serve`` servers (loopback).

The same requests with ``relay_engine_text`` on and off give the same events
and the same client chunks; the guarantees that depend on the deltas (token
counts and usage, the retry of a decoder that failed before its first token,
no retry and an error after it) hold with the relay on.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from epd_actors.core.config import Deadlines
from epd_actors.frontends.http_app import HttpSettings, RouterHttpApp
from epd_actors.openai.engine_text import EngineText
from epd_actors.openai.format import SseFormatter
from epd_actors.protocol import ChatMessage, Prompt, SamplingParams
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from tests.backends.test_openai_http_backend import (
    FAST,
    QUICK,
    collect,
    final,
    fleet_router,
    sim_http_fleet,
    text_of,
)
from tests.frontends.test_http_frontend import connected

if TYPE_CHECKING:
    from epd_actors.request import GenerationEvent

ONE_TOKEN = replace(QUICK, tokens_per_delta=1)


def chat_request(n: int) -> GenerationRequest:
    messages = (ChatMessage("user", (f"tell me a story {n}",)),)
    return GenerationRequest(
        Prompt(messages=messages), sampling=SamplingParams(max_tokens=12), request_id=f"r{n}"
    )


def joined(deltas: list[DeltaEvent]) -> tuple[str, tuple[int, ...]]:
    """The text and the token ids of ``deltas``, however they were split."""
    return "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.token_ids)


def chunks(events: list[GenerationEvent]) -> list[str]:
    formatter = SseFormatter("chat", request_id="req", model="alias", created=1)
    return [formatter.event(e) for e in events if isinstance(e, DeltaEvent) and e.text]


@pytest.mark.parametrize("workers", [{"prefill": 1, "decode": 1}, {"pd": 1}])
async def test_relay_on_and_off_give_the_same_events_and_chunks(workers: dict[str, int]) -> None:
    seen: dict[bool, list[GenerationEvent]] = {}
    for relay in (True, False):
        async with sim_http_fleet(workers, configs={"decode": ONE_TOKEN, "pd": ONE_TOKEN}) as fleet:
            settings = replace(FAST, relay_engine_text=relay)
            async with fleet_router(fleet, settings=settings) as router:
                seen[relay] = await collect(router, chat_request(1))
    on, off = seen[True], seen[False]
    deltas_on = [e for e in on if isinstance(e, DeltaEvent)]
    deltas_off = [e for e in off if isinstance(e, DeltaEvent)]
    # How the tokens split into deltas depends on what one read of the socket
    # found (a real clock); what they carry does not.
    assert joined(deltas_on) == joined(deltas_off)
    assert any(type(e.text) is EngineText for e in deltas_on)  # the relay reached the caller
    assert not any(type(e.text) is EngineText for e in deltas_off)
    # A relayed delta's chunk is the chunk of the same delta parsed.
    parsed = [replace(e, text=str(e.text)) for e in deltas_on]
    assert all(type(e.text) is str for e in parsed)
    assert chunks(list(deltas_on)) == chunks(list(parsed))
    done_on, done_off = final(on), final(off)
    assert isinstance(done_on, DoneEvent)
    assert isinstance(done_off, DoneEvent)
    assert (done_on.finish_reason, done_on.usage) == (done_off.finish_reason, done_off.usage)
    assert done_on.usage.completion_tokens == 12
    assert done_on.timings.ttft_s is not None


async def test_a_decoder_that_fails_before_its_first_token_is_retried_with_the_relay() -> None:
    configs = {"decode-0": replace(ONE_TOKEN, generate_error_rate=1.0), "decode-1": ONE_TOKEN}
    async with (
        sim_http_fleet({"prefill": 1, "decode": 2}, configs=configs) as fleet,
        fleet_router(fleet, policies={"decode": "round_robin"}) as router,
    ):
        events = await collect(router, chat_request(2))
    done = final(events)
    assert isinstance(done, DoneEvent), done
    assert done.usage.completion_tokens == 12
    assert len(fleet.log("decode-0")) == 1
    assert len(fleet.log("decode-1")) == 1


async def test_a_decoder_that_fails_after_its_first_token_ends_the_request_with_an_error() -> None:
    configs = {"decode-0": replace(ONE_TOKEN, crash_after_tokens=3), "decode-1": ONE_TOKEN}
    async with (
        sim_http_fleet({"prefill": 1, "decode": 2}, configs=configs) as fleet,
        fleet_router(fleet, policies={"decode": "round_robin"}) as router,
    ):
        events = await collect(router, chat_request(3))
    assert isinstance(final(events), ErrorEvent)
    assert not any(isinstance(e, DoneEvent) for e in events)
    assert text_of(events)  # the output had started: no retry
    assert fleet.log("decode-1") == []


async def _sse_body(relay: bool, stream_body: dict[str, object]) -> str:
    """The SSE body, one event per engine chunk (how reads merge chunks is timing)."""
    settings = replace(FAST, relay_engine_text=relay, merge_reads=False)
    one_per_delta = HttpSettings(linger_s=0.5, stream_coalescing="off")
    async with (
        sim_http_fleet({"prefill": 1, "decode": 1}, configs={"decode": ONE_TOKEN}) as fleet,
        fleet_router(fleet, settings=settings) as router,
        connected(RouterHttpApp(router), one_per_delta) as client,
    ):
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            json_body=stream_body,
            headers=(("x-request-id", "r1"),),
        )
    assert reply.status == 200
    text = reply.body.decode()
    text = re.sub(r'"created":[0-9]+', '"created":0', text)
    return re.sub(r"^: timings .*$", ": timings", text, flags=re.MULTILINE)


async def test_an_sse_client_gets_the_same_bytes_with_the_relay_on_and_off() -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    on, off = await _sse_body(True, body), await _sse_body(False, body)
    assert on == off
    assert on.count('"delta":{"content":') == 12  # one chunk per token
    assert "token_ids" not in on
    assert on.endswith("data: [DONE]\n\n")


async def test_a_decode_job_in_its_request_task_waits_out_many_inter_token_deadlines() -> None:
    # The decode job runs in the request's task and watches the inter-token deadline
    # itself; the read hub hands the deltas over meanwhile.  The deadline's scope is
    # set by the first delta only, so over a stream three times as long as the timeout
    # it passes twice while tokens still flow: each time the job asks again and waits
    # on, with the hub serving the stream anew, and nothing is lost.
    paced = replace(QUICK, tokens_per_delta=1, output_token_s=0.08)
    async with sim_http_fleet({"prefill": 1, "decode": 1}, configs={"decode": paced}) as fleet:
        config = replace(fleet.config(), deadlines=Deadlines(inter_token_timeout_s=0.3))
        async with fleet_router(fleet, config=config) as router:
            events = await collect(router, chat_request(2))
    done = final(events)
    assert isinstance(done, DoneEvent)
    assert done.usage.completion_tokens == 12
    deltas = [e for e in events if isinstance(e, DeltaEvent)]
    assert sum(len(e.token_ids) for e in deltas) == 12
    assert text_of(events)
