"""epd_ws_connections and epd_ws_streams_total: every outcome a generation can have."""

from __future__ import annotations

import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from trio_websocket import open_websocket_url

from epd_actors.frontends.ws import WS_STREAM_OUTCOMES, WsSettings
from epd_actors.frontends.ws_metrics import WsCollector
from tests.core.test_metrics import samples
from tests.frontends.test_ws_frontend import (
    GUARD_S,
    LONG,
    generate,
    receive,
    send,
    serving,
    until_first_delta,
    until_terminal,
)


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    values = samples(generate_latest(registry))
    out = {"connections": values[("epd_ws_connections", ())]}
    for outcome in WS_STREAM_OUTCOMES:
        out[outcome] = values[("epd_ws_streams_total", (("outcome", outcome),))]
    return out


async def test_connections_and_stream_outcomes_are_counted() -> None:
    registry = CollectorRegistry()
    with trio.fail_after(GUARD_S):
        async with serving(WsSettings(max_generations=2)) as served:
            registry.register(WsCollector([served.server]))
            before = scrape(registry)
            async with open_websocket_url(served.url) as ws:
                await send(ws, generate("done", 2))
                assert (await until_terminal(ws, "done"))["done"][-1]["type"] == "done"
                await send(ws, generate("bad", 2, model="no-such-model"))
                assert (await until_terminal(ws, "bad"))["bad"][-1]["type"] == "error"
                await send(ws, generate("cancel", LONG))
                await until_first_delta(ws, "cancel")
                await send(ws, generate("cancel", 2))  # a live id: refused
                message = await receive(ws)
                while message["type"] == "delta":
                    message = await receive(ws)
                assert message["error"]["code"] == "duplicate_id"
                await send(ws, {"type": "cancel", "id": "cancel"})
                assert (await until_terminal(ws, "cancel"))["cancel"][-1]["type"] == "cancelled"
                async with open_websocket_url(served.url) as other:
                    await send(other, generate("left", LONG))
                    await until_first_delta(other, "left")
                    during = scrape(registry)
                await trio.testing.wait_all_tasks_blocked()
                after_close = scrape(registry)
            await trio.testing.wait_all_tasks_blocked()
            after = scrape(registry)
    assert before == dict.fromkeys(before, 0.0)
    assert during["connections"] == 2.0
    assert after_close["connections"] == 1.0
    assert after == {
        "connections": 0.0,
        "done": 1.0,
        "error": 1.0,
        "cancelled": 1.0,
        "closed": 1.0,
        "refused": 1.0,
    }
