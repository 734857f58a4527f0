"""examples/websocket_client.py against an in-process router and WebSocket server."""

from __future__ import annotations

import importlib.util
import re
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio
import trio.testing

from epd_actors.core.router import open_router
from epd_actors.frontends.ws import WsSettings, serve_ws
from epd_actors.testing import build_sim_fleet

if TYPE_CHECKING:
    from types import ModuleType

    import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "websocket_client.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("websocket_client_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_websocket_client_example(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example()
    fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1})
    settings = WsSettings(api_keys=("example-key",))
    with trio.fail_after(10):
        async with (
            open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router,
            trio.open_nursery() as nursery,
        ):
            await router.wait_ready()
            server = await nursery.start(
                partial(serve_ws, router, "127.0.0.1", 0, settings=settings)
            )
            await example.main(f"ws://127.0.0.1:{server.port}/v1/ws", api_key="example-key")
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.total("aborts", "decode") == 1
            nursery.cancel_scope.cancel(reason="test over")
    # The two generations run concurrently: only each one's own lines are ordered.
    lines = capsys.readouterr().out.splitlines()
    long = [line for line in lines if line.startswith("[long] ")]
    short = [line for line in lines if line.startswith("[short] ")]
    assert len(long) + len(short) == len(lines), lines
    assert len(long) == 1, lines
    assert re.fullmatch(r"\[long\] cancelled after \d+ deltas", long[0]), lines
    assert len(short) == 2, lines
    assert re.fullmatch(r"\[short\] \S.*", short[0]), lines
    assert re.fullmatch(
        r"\[short\] finish_reason=length prompt_tokens=\d+ completion_tokens=24 total_tokens=\d+",
        short[1],
    ), lines
