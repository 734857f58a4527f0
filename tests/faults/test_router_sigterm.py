"""SIGTERM to a serving router with 100 streams in flight (a row of the fault matrix).

A real ``python -m epd_actors serve --config`` process over worker processes.
Half of the streams are short and finish inside the drain window; the other
half are long and are still running when the drain deadline passes.  Every
stream must end either normally (``data: [DONE]``) or with an SSE error event,
never silently truncated, and the router must exit 0 within
``drain_timeout_s`` plus a margin.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import h11
import pytest
import trio

from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV
from tests.e2e.test_deployments import Output
from tests.frontends.test_http_frontend import Client

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.processes

TOKEN = "sigterm-token"
STREAMS = 100
DRAIN_TIMEOUT_S = 2.0
EXIT_MARGIN_S = 5.0
SHORT_TOKENS = 10  # 0.2 s at 20 ms a token: done well inside the drain window
LONG_TOKENS = 2000  # 40 s: cut by the drain deadline


def write_config(path: Path, addresses: dict[str, str]) -> None:
    path.write_text(f"""
model = "sim-model"
auth_token = "{TOKEN}"

[server]
http_listen = "127.0.0.1:0"
drain_timeout_s = {DRAIN_TIMEOUT_S}

[pools.prefill]
workers = [{{ id = "p0", address = "{addresses["p0"]}" }}]

[pools.decode]
workers = [{{ id = "d0", address = "{addresses["d0"]}" }}]
""")


async def stream_one(host: str, port: int, max_tokens: int, started: trio.Event) -> str:
    """Run one streamed chat; return 'done', 'error' or what was wrong."""
    client = Client(await trio.open_tcp_stream(host, port))
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "count slowly"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    await client.send("POST", "/v1/chat/completions", json_body=body)
    head = await client.head()
    assert head.status == 200, head
    received = b""
    try:
        while True:
            try:
                event = await client.event()
            except h11.RemoteProtocolError:
                return f"truncated (no end of body) after {received[-200:]!r}"
            data = getattr(event, "data", None)
            if data is None:
                break  # EndOfMessage: the chunked body was terminated properly
            received += bytes(data)
            started.set()
    finally:
        await client.stream.aclose()
    text = received.decode()
    if text.endswith("data: [DONE]\n\n"):
        return "done"
    last = text.rstrip("\n").rsplit("\n\n", 1)[-1]
    if last.startswith("event: error\ndata: "):
        error = json.loads(last.removeprefix("event: error\ndata: "))["error"]
        assert error["message"]
        return "error"
    return f"truncated: {last[-200:]!r}"


async def test_sigterm_with_100_streams_in_flight(tmp_path: Path) -> None:
    shared = (
        "--sim-store-dir",
        str(tmp_path / "store"),
        "--sim-output-token-s",
        "0.02",
        "--max-concurrency",
        "128",
    )
    specs = [WorkerSpec("prefill", "p0", shared), WorkerSpec("decode", "d0", shared)]
    outcomes: list[str] = []

    async def run(host: str, port: int, max_tokens: int, started: trio.Event) -> None:
        outcomes.append(await stream_one(host, port, max_tokens, started))

    with trio.fail_after(60):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            config = tmp_path / "epd.toml"
            write_config(config, {w: str(a) for w, a in workers.addresses.items()})
            command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
            process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
            try:
                assert process.stdout is not None
                banner = await Output(process.stdout).until("router listening on")
                found = re.search(r"router listening on http://([\d.]+):(\d+)", banner)
                assert found
                host, port = found.group(1), int(found.group(2))
                async with trio.open_nursery() as nursery:
                    started = [trio.Event() for _ in range(STREAMS)]
                    for n in range(STREAMS):
                        tokens = SHORT_TOKENS if n % 2 else LONG_TOKENS
                        nursery.start_soon(run, host, port, tokens, started[n])
                    for event in started[::2]:  # every long stream is streaming
                        await event.wait()
                    process.send_signal(signal.SIGTERM)
                    signalled = trio.current_time()
                    with trio.fail_after(DRAIN_TIMEOUT_S + EXIT_MARGIN_S):
                        status = await process.wait()
                    exited_after = trio.current_time() - signalled
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert status == 0
    assert exited_after >= DRAIN_TIMEOUT_S - 0.5
    assert len(outcomes) == STREAMS
    assert sorted(set(outcomes)) == ["done", "error"], outcomes
    assert outcomes.count("done") >= STREAMS // 2  # every short stream finished
