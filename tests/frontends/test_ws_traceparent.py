"""A WebSocket ``generate`` message may carry the client's W3C ``traceparent``."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
from trio_websocket import open_websocket_url

from epd_actors.core.router import open_router
from epd_actors.frontends.ws import WsSettings, serve_ws
from epd_actors.frontends.ws_messages import GenerateMessage, WsMessageError, parse_client_message
from epd_actors.testing import build_sim_fleet
from tests.core.test_tracing import CLIENT_SPAN, CLIENT_TRACE, TRACEPARENT, memory_tracing, root_of
from tests.frontends.test_ws_frontend import GUARD_S, chat, send, until_terminal


def test_a_generate_message_keeps_its_traceparent() -> None:
    frame = {**chat("a"), "traceparent": TRACEPARENT}
    parsed = parse_client_message(json.dumps(frame))
    assert isinstance(parsed, GenerateMessage)
    assert parsed.traceparent == TRACEPARENT
    plain = parse_client_message(json.dumps(chat("b")))
    assert isinstance(plain, GenerateMessage)
    assert plain.traceparent is None


@pytest.mark.parametrize("value", [7, {"x": 1}, ["00-…"], True])
def test_a_traceparent_that_is_not_a_string_is_refused(value: object) -> None:
    with pytest.raises(WsMessageError) as caught:
        parse_client_message(json.dumps({**chat("g"), "traceparent": value}))
    assert caught.value.code == "invalid_message"
    assert caught.value.param == "traceparent"
    assert caught.value.client_id == "g"


async def test_the_request_trace_continues_the_clients() -> None:
    tracing, exporter = memory_tracing()
    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    with trio.fail_after(GUARD_S):
        async with open_router(
            fleet.router_config(), backend_factory=fleet.backend_factory, tracing=tracing
        ) as router:
            await router.wait_ready()
            async with trio.open_nursery() as nursery:
                start = partial(serve_ws, router, "127.0.0.1", 0, settings=WsSettings())
                server = await nursery.start(start)
                url = f"ws://127.0.0.1:{server.port}/v1/ws"
                async with open_websocket_url(url) as ws:
                    await send(ws, {**chat("t", 3), "traceparent": TRACEPARENT})
                    await send(ws, chat("u", 3))
                    seen = await until_terminal(ws, "t", "u")
                nursery.cancel_scope.cancel(reason="test over")
    assert seen["t"][-1]["type"] == seen["u"][-1]["type"] == "done"
    spans = exporter.get_finished_spans()
    roots = [span for span in spans if span.name == "epd.request"]
    assert len(roots) == 2
    traced = [root for root in roots if root.parent is not None]
    (root,) = traced  # the message without a traceparent started a trace of its own
    assert root.parent is not None
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.context is not None
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root_of(tuple(s for s in spans if s.context.trace_id == root.context.trace_id)) is root
