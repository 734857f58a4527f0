"""Client-side faults through the HTTP front end, over a simulated in-process fleet.

Rows of the fault matrix in docs/reliability.md: a client that hangs up, and a
request whose deadline expires, in each stage (E, P, D); a client that stops
reading; a burst of five times the admission limit.  Everything runs over
memory streams on the virtual clock, with simulator latencies chosen so that
each stage lasts seconds:

=========  ==============================================================
 0 - 2 s   encode (one image, ``encode_item_s=2``)
 2 - ~7 s  prefill (256 image tokens + the text at 20 ms a token)
 ~8 s      first token (``first_token_s=1``), then one token a second
=========  ==============================================================
"""

from __future__ import annotations

import base64
import json
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import h11
import pytest
import trio
import trio.testing

from epd_actors.core.config import AdmissionLimits, Deadlines
from epd_actors.core.router import Router, open_router
from epd_actors.frontends.http import HttpServer, HttpSettings, RouterHttpApp
from epd_actors.testing import SimFleet, build_sim_fleet, sim_config
from tests.frontends.test_http_frontend import Client, Reply, connected

from .polling import wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

GUARD_S = 600.0  # virtual seconds
SLOW_STAGES = {
    "encode_item_s": 2.0,
    "prefill_token_s": 0.02,
    "first_token_s": 1.0,
    "output_token_s": 1.0,
}
EPD = {"encode": 1, "prefill": 1, "decode": 1}
IMAGE_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG a fault picture").decode()
STAGE_ENGINE = {"encode": "encode-0", "prefill": "prefill-0", "decode": "decode-0"}


def chat_body(
    max_tokens: int = 30, *, stream: bool = True, image: bool = True
) -> dict[str, object]:
    content: object = "describe it"
    if image:
        content = [
            {"type": "text", "text": "describe it"},
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        ]
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@asynccontextmanager
async def sim_router(
    *, deadlines: Deadlines | None = None, admission: AdmissionLimits | None = None, **knobs: float
) -> AsyncIterator[tuple[SimFleet, Router, RouterHttpApp]]:
    fleet = build_sim_fleet(EPD, config=sim_config(**{**SLOW_STAGES, **knobs}))
    config = fleet.router_config(deadlines=deadlines)
    if admission is not None:
        config = replace(config, admission=admission)
    async with open_router(config, backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        yield fleet, router, RouterHttpApp(router)


def assert_no_leaks(fleet: SimFleet, router: Router) -> None:
    assert router.supervisor.requests_in_flight == 0
    assert fleet.kv_handles_outstanding() == 0
    assert fleet.total("kv_handles_leaked") == 0
    assert fleet.total("in_flight") == 0
    assert all(m.in_flight == 0 for pool in fleet.pools.values() for m in pool.members)


async def stage_running(fleet: SimFleet, stage: str) -> None:
    engine = fleet.engines[STAGE_ENGINE[stage]]
    await wait_until(lambda: engine.statistics().in_flight > 0)


def sse_events(body: bytes) -> list[str]:
    return [
        line[len("data: ") :] for line in body.decode().split("\n") if line.startswith("data: ")
    ]


# ---------------------------------------------------------------- client hangs up


@pytest.mark.parametrize("stage", ["encode", "prefill", "decode"], ids=lambda s: f"hangup-{s}")
async def test_client_disconnect_in_each_stage_aborts_that_stage(
    autojump_clock: object, stage: str
) -> None:
    with trio.fail_after(GUARD_S):
        async with sim_router() as (fleet, router, app):
            async with connected(app) as client:
                await client.send("POST", "/v1/chat/completions", json_body=chat_body())
                if stage == "decode":
                    head = await client.head()
                    assert head.status == 200
                    assert isinstance(await client.event(), h11.Data)
                await stage_running(fleet, stage)
                hung_up_at = trio.current_time()
            # leaving `connected` closed the client's end and waited for its handler
            assert trio.current_time() - hung_up_at < 1.0
            assert fleet.total("aborts", stage) == 1
            for later in {"encode", "prefill", "decode"} - {stage}:
                assert fleet.total("aborts", later) == 0
            if stage == "decode":
                assert fleet.total("tokens_generated", "decode") < 30
            else:
                assert fleet.total("generate_requests") == 0
            assert router.statistics().supervisor.requests_cancelled == 1
            assert_no_leaks(fleet, router)


# ---------------------------------------------------------------- deadline expires


DEADLINE_IN = {"encode": 1.0, "prefill": 4.0, "decode": 12.0}


@pytest.mark.parametrize("stage", DEADLINE_IN, ids=lambda s: f"deadline-{s}")
async def test_deadline_in_each_stage_is_a_504_or_an_sse_error(
    autojump_clock: object, stage: str
) -> None:
    timeout = DEADLINE_IN[stage]
    with trio.fail_after(GUARD_S):
        async with sim_router(deadlines=Deadlines(request_timeout_s=timeout)) as (
            fleet,
            router,
            app,
        ):
            async with connected(app) as client:
                start = trio.current_time()
                reply = await client.request("POST", "/v1/chat/completions", json_body=chat_body())
                assert trio.current_time() - start == timeout
            if stage == "decode":
                # Streaming had begun: the stream ends with an error event, no [DONE].
                assert reply.status == 200
                events = sse_events(reply.body)
                assert "[DONE]" not in events
                error = json.loads(events[-1])["error"]
                assert error["type"] == "timeout_error"
                assert "deadline" in error["message"]
            else:
                assert reply.status == 504
                error = reply.error()
                assert error["type"] == "timeout_error"
                assert "deadline" in str(error["message"])
            assert fleet.total("aborts", stage) == 1
            assert_no_leaks(fleet, router)


# ---------------------------------------------------------------- a client that stops reading


async def test_a_slow_reader_does_not_hold_back_another_client(autojump_clock: object) -> None:
    settings = HttpSettings(write_timeout_s=4.0, linger_s=0.5)
    with trio.fail_after(GUARD_S):
        async with sim_router(
            encode_item_s=0.001, prefill_token_s=0.0001, first_token_s=0.01, output_token_s=0.01
        ) as (fleet, router, app):
            slow_stream, slow_server_end = trio.testing.lockstep_stream_pair()
            server = HttpServer(app, settings)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.handle_connection, slow_server_end)
                slow = Client(slow_stream)
                body = chat_body(2000, image=False)
                await slow.send("POST", "/v1/chat/completions", json_body=body)
                # The slow client never reads.  Meanwhile another one streams in full.
                start = trio.current_time()
                async with connected(app, settings) as fast:
                    reply = await fast.request(
                        "POST", "/v1/chat/completions", json_body=chat_body(200, image=False)
                    )
                assert reply.status == 200
                events = sse_events(reply.body)
                assert events[-1] == "[DONE]"
                text = "".join(
                    json.loads(e)["choices"][0]["delta"].get("content") or ""
                    for e in events[:-1]
                    if json.loads(e)["choices"]
                )
                assert text
                assert trio.current_time() - start < 4.0
            # The handler gave up on the slow reader after write_timeout_s: its
            # request was cancelled and the decoder told to abort.
            assert fleet.total("aborts", "decode") == 1
            assert fleet.total("tokens_generated", "decode") < 200 + 2000
            await slow_stream.aclose()
            assert_no_leaks(fleet, router)


# ---------------------------------------------------------------- a burst


async def test_a_burst_of_five_times_the_admission_limit(autojump_clock: object) -> None:
    limit = 4
    replies: list[tuple[Reply, float]] = []

    async def one(app: RouterHttpApp) -> None:
        async with connected(app) as client:
            start = trio.current_time()
            reply = await client.request(
                "POST", "/v1/chat/completions", json_body=chat_body(4, stream=False, image=False)
            )
            replies.append((reply, trio.current_time() - start))

    with trio.fail_after(GUARD_S):
        async with sim_router(
            admission=AdmissionLimits(max_requests_in_flight=limit, retry_after_s=2.0)
        ) as (fleet, router, app):
            async with trio.open_nursery() as nursery:
                for _ in range(5 * limit):
                    nursery.start_soon(one, app)
            refused = [(r, t) for r, t in replies if r.status == 429]
            accepted = [(r, t) for r, t in replies if r.status != 429]
            assert len(refused) == 4 * limit
            assert len(accepted) == limit
            for reply, elapsed in refused:
                assert elapsed == 0  # refused at once, before any simulated work
                assert reply.headers["retry-after"] == "2"
                assert reply.headers["content-type"] == "application/json"
                error = reply.error()
                assert set(error) == {"message", "type", "param", "code"}
                assert isinstance(error["message"], str)
            for reply, elapsed in accepted:
                assert reply.status == 200
                assert elapsed > 0
                usage = reply.json()["usage"]
                assert isinstance(usage, dict)
                assert usage["completion_tokens"] == 4
            assert router.statistics().supervisor.requests_refused == 4 * limit
            assert_no_leaks(fleet, router)


# ---------------------------------------------------------------- router shutdown


async def test_expired_requests_end_with_an_error_not_a_cut(autojump_clock: object) -> None:
    """The server's drain ladder ends the requests left at its deadline with
    ``Supervisor.expire_requests``: a stream gets a proper SSE error event and
    end of body, a unary request a 504 (regression: they used to be cut off)."""
    with trio.fail_after(GUARD_S):
        async with sim_router() as (fleet, router, app):
            async with connected(app) as streaming, connected(app) as unary:
                await streaming.send("POST", "/v1/chat/completions", json_body=chat_body())
                await unary.send("POST", "/v1/chat/completions", json_body=chat_body(stream=False))
                head = await streaming.head()
                assert isinstance(await streaming.event(), h11.Data)
                assert router.supervisor.expire_requests("the drain deadline passed") == 2
                streamed = await streaming.rest(head)
                answered = await unary.response()
            events = sse_events(streamed.body)
            assert "[DONE]" not in events
            error = json.loads(events[-1])["error"]
            assert (error["type"], error["code"]) == ("timeout_error", "drain")
            assert "the drain deadline passed" in error["message"]
            assert answered.status == 504
            assert answered.error()["code"] == "drain"
            assert fleet.total("aborts", "decode") == 2  # both were decoding
            assert_no_leaks(fleet, router)
