"""Whole deployments as users run them: the default command, and ``serve --config``.

Real processes on loopback: the router and simulated workers, reached with
curl (when installed), the official ``openai`` client, httpx and a real
WebSocket client.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
import trio
from trio_websocket import open_websocket_url

from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.processes

IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG e2e picture").decode()


class Output:
    """Reads a child's stdout line by line."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.lines: list[str] = []

    async def until(self, marker: str) -> str:
        while marker not in "\n".join(self.lines):
            chunk = await self.stream.receive_some(4096)
            assert chunk, f"the process ended before printing {marker!r}: {self.lines}"
            self.buffer += chunk
            *done, self.buffer = self.buffer.split(b"\n")
            self.lines += [line.decode() for line in done]
        return "\n".join(self.lines)


def openai_client(base_url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=30)


async def worker_aborts(base_url: str, stage: str, client: httpx.AsyncClient) -> int:
    health = (await client.get(base_url + "/health")).json()
    return sum(w["worker_aborts"] or 0 for w in health["pools"][stage]["workers"])


async def disconnect_mid_stream(base_url: str) -> None:
    """Start a long streamed request, read a little of it, and hang up."""
    host, port = base_url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    body = json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": 5000,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += await stream.receive_some(4096)
    await stream.aclose()


async def test_the_default_command(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "epd_actors", "--port", "0", "--ws-port", "0"]
    with trio.fail_after(90):
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
        try:
            assert process.stdout is not None
            banner = await Output(process.stdout).until("Ctrl-C stops everything.")
            assert "SIMULATED" in banner
            url = re.search(r"router listening on (http://\S+)", banner)
            ws_url = re.search(r"WebSocket streaming on (ws://\S+)", banner)
            curl_body = re.search(r"-d '(\{.*\})'", banner)
            assert url
            assert ws_url
            assert curl_body
            base = url.group(1)

            # The printed curl works as printed.
            if shutil.which("curl"):
                result = await trio.run_process(
                    [
                        "curl",
                        "-s",
                        f"{base}/v1/chat/completions",
                        "-H",
                        "content-type: application/json",
                        "-d",
                        curl_body.group(1),
                    ],
                    capture_stdout=True,
                )
                reply = json.loads(result.stdout)
                assert reply["choices"][0]["message"]["content"]

            # The official openai client: chat, streaming with usage, completions, an image.
            def use_openai() -> None:
                client = openai_client(base)
                chat = client.chat.completions.create(
                    model="sim-model",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=8,
                )
                assert chat.choices[0].finish_reason == "length"
                assert chat.usage is not None
                assert chat.usage.completion_tokens == 8
                chunks = list(
                    client.chat.completions.create(
                        model="sim-model",
                        messages=[
                            {
                                "role": "user",
                                "content": [
                                    {"type": "text", "text": "what is this?"},
                                    {"type": "image_url", "image_url": {"url": IMAGE}},
                                ],
                            }
                        ],
                        max_tokens=6,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text
                assert chunks[-1].usage is not None
                assert chunks[-1].usage.completion_tokens == 6
                completion = client.completions.create(
                    model="sim-model", prompt="once", max_tokens=5
                )
                assert completion.choices[0].text
                with pytest.raises(openai.BadRequestError):
                    client.chat.completions.create(
                        model="sim-model",
                        messages=[{"role": "user", "content": "x"}],
                        temperature=-3,
                    )

            await trio.to_thread.run_sync(use_openai)

            # A real WebSocket client.
            async with open_websocket_url(ws_url.group(1)) as ws:
                await ws.send_message(
                    json.dumps(
                        {
                            "type": "generate",
                            "id": "g1",
                            "kind": "chat",
                            "request": {
                                "model": "sim-model",
                                "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}],
                            },
                        }
                    )
                )
                kinds = []
                while not kinds or kinds[-1] not in ("done", "error"):
                    kinds.append(json.loads(await ws.get_message())["type"])
                assert kinds[-1] == "done"

            # A client that hangs up mid-stream: the decode worker receives an abort.
            async with httpx.AsyncClient() as client:
                before = await worker_aborts(base, "decode", client)
                await disconnect_mid_stream(base)
                for _ in range(100):
                    if await worker_aborts(base, "decode", client) > before:
                        break
                    await trio.sleep(0.1)
                assert await worker_aborts(base, "decode", client) == before + 1
        finally:
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0


def write_config(path: Path, addresses: dict[str, str], token: str) -> None:
    def workers(*ids: str) -> str:
        return ", ".join(f'{{ id = "{w}", address = "{addresses[w]}" }}' for w in ids)

    path.write_text(f"""
model = "sim-model"
auth_token = "{token}"

[server]
http_listen = "127.0.0.1:0"
api_keys = ["client-key"]
admin_key = "admin-key"
drain_timeout_s = 10

[server.http]
max_body_bytes = 4096

[deadlines]
request_timeout_s = 1.0

[admission]
max_requests_in_flight = 2

[health]
failure_threshold = 1000   # keep the failing decoder in rotation for the 502 below

[pools.prefill]
workers = [{workers("p0")}]

[pools.decode]
workers = [{workers("d0", "bad")}]
""")


async def test_serve_maps_every_failure_to_its_status(tmp_path: Path) -> None:
    token = "serve-token"
    shared = ("--sim-store-dir", str(tmp_path / "store"))
    specs = [
        WorkerSpec("prefill", "p0", shared),
        WorkerSpec("decode", "d0", shared),
        WorkerSpec("decode", "bad", (*shared, "--sim-generate-error-rate", "1")),
    ]
    with trio.fail_after(90):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: token}) as workers:
            addresses = {w: str(a) for w, a in workers.addresses.items()}
            config = tmp_path / "epd.toml"
            write_config(config, addresses, token)
            command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
            process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
            try:
                assert process.stdout is not None
                banner = await Output(process.stdout).until("router listening on")
                found = re.search(r"router listening on (http://\S+)", banner)
                assert found
                await check_statuses(found.group(1))
            finally:
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0


async def check_statuses(base: str) -> None:
    key = {"authorization": "Bearer client-key"}
    admin = {"authorization": "Bearer admin-key"}
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(100):
            if (await client.get("/health")).status_code == 200:
                break
            await trio.sleep(0.1)
        ok = await client.post("/v1/chat/completions", json=chat, headers=key)
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-request-id"]
        assert "decode=" in ok.headers["x-epd-timings"]

        async def status(method: str, path: str, **kwargs: object) -> httpx.Response:
            return await client.request(method, path, **kwargs)  # type: ignore[arg-type]

        assert (await status("POST", "/v1/chat/completions", json=chat)).status_code == 401
        bad = await status(
            "POST", "/v1/chat/completions", json={**chat, "max_tokens": -1}, headers=key
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "max_tokens"
        assert (await status("GET", "/v1/nothing", headers=key)).status_code == 404
        assert (await status("GET", "/v1/chat/completions", headers=key)).status_code == 405
        big = await status(
            "POST",
            "/v1/chat/completions",
            content=b"x" * 10_000,
            headers={**key, "content-type": "application/json"},
        )
        assert big.status_code == 413
        slow = await status(
            "POST", "/v1/chat/completions", json={**chat, "max_tokens": 4000}, headers=key
        )
        assert slow.status_code == 504

        # Admission: two slow requests fill the router; a third is refused at once.
        async def long_one(results: list[int]) -> None:
            response = await status(
                "POST", "/v1/chat/completions", json={**chat, "max_tokens": 300}, headers=key
            )
            results.append(response.status_code)

        results: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_one, results)
            nursery.start_soon(long_one, results)
            await trio.sleep(0.1)
            refused = await status("POST", "/v1/chat/completions", json=chat, headers=key)
        assert refused.status_code == 429
        assert refused.headers["retry-after"]
        assert sorted(results) == [200, 200]

        # With the good decoder drained, only the failing one is left: 502.
        listing = await status("GET", "/admin/workers", headers=admin)
        assert listing.status_code == 200
        drained = await status("POST", "/admin/workers/d0/drain", headers=admin)
        assert drained.status_code == 200
        failed = await status("POST", "/v1/chat/completions", json=chat, headers=key)
        assert failed.status_code == 502
        # And without any decoder at all: 503 with Retry-After.
        assert (await status("POST", "/admin/workers/bad/drain", headers=admin)).status_code == 200
        unavailable = await status("POST", "/v1/chat/completions", json=chat, headers=key)
        assert unavailable.status_code == 503
        assert unavailable.headers["retry-after"]
        assert (await client.get("/health")).status_code == 503
