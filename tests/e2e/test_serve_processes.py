"""``serve --processes N`` as users run it: a parent, N router processes, one port.

Real processes on loopback (port 0: the parent picks the ports and reports
them), one simulated PD worker behind them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.processes

TOKEN = "processes-token"
START_S = 60.0


@dataclass
class Parent:
    process: trio.Process
    url: str = ""
    metrics_url: str = ""
    pids: dict[int, int] = field(default_factory=dict)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


async def _collect(stream: trio.abc.ReceiveStream, lines: list[str]) -> None:
    buffer = b""
    while chunk := await stream.receive_some(65536):
        buffer += chunk
        *done, buffer = buffer.split(b"\n")
        lines += [line.decode(errors="replace") for line in done]
    if buffer:
        lines.append(buffer.decode(errors="replace"))


def write_config(path: Path, worker: str, *, pools: str | None = None) -> Path:
    pools = pools or f'[pools.pd]\nworkers = [{{ id = "pd0", address = "{worker}" }}]\n'
    path.write_text(
        f'auth_token = "{TOKEN}"\n'
        "[server]\n"
        'http_listen = "127.0.0.1:0"\n'
        'metrics_listen = "127.0.0.1:0"\n'
        "drain_timeout_s = 20\n" + pools,
        encoding="utf-8",
    )
    return path


@asynccontextmanager
async def pd_worker(tmp_path: Path, *args: str) -> AsyncIterator[str]:
    spec = WorkerSpec("pd", "pd0", ("--sim-store-dir", str(tmp_path), *args))
    async with open_local_workers([spec], env={AUTH_TOKEN_ENV: TOKEN}) as workers:
        yield str(workers.addresses["pd0"])


@asynccontextmanager
async def start_parent(
    config: Path, count: int, *, wait_ready: bool = True
) -> AsyncIterator[Parent]:
    command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
    process = await trio.lowlevel.open_process(
        [*command, "--processes", str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    parent = Parent(process)
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, process.stdout, parent.stdout)
            nursery.start_soon(_collect, process.stderr, parent.stderr)
            if wait_ready:
                with trio.fail_after(START_S):
                    while len(_process_lines(parent.stdout)) < count:
                        assert process.poll() is None, parent.stderr
                        await trio.sleep(0.05)
                text = "\n".join(parent.stdout)
                url = re.search(r"router listening on (http://\S+)", text)
                metrics = re.search(r"metrics of every process on (http://\S+)", text)
                assert url is not None
                assert metrics is not None
                parent.url, parent.metrics_url = url.group(1), metrics.group(1)
                parent.pids = {int(i): int(p) for i, p in _process_lines(parent.stdout)}
            yield parent
            with trio.fail_after(START_S):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _process_lines(lines: list[str]) -> list[tuple[str, str]]:
    return re.findall(r"router process (\d+): pid (\d+)", "\n".join(lines))


def samples(text: str, name: str) -> dict[str, float]:
    """``name``'s value per ``process`` label, summed over the other labels."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                process = sample.labels["process"]
                found[process] = found.get(process, 0.0) + sample.value
    return found


async def complete(url: str, **extra: object) -> httpx.Response:
    # A fresh client, so a fresh connection (the kernel spreads connections).
    async with httpx.AsyncClient(timeout=30) as client:
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 4, **extra}
        return await client.post(url + "/v1/completions", json=body)


async def metrics(parent: Parent) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(parent.metrics_url)
    assert response.status_code == 200
    return response.text


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_two_processes_share_one_port_and_both_serve(tmp_path: Path) -> None:
    async with pd_worker(tmp_path) as worker:
        config = write_config(tmp_path / "epd.toml", worker)
        async with start_parent(config, 2) as parent:
            assert len(set(parent.pids.values())) == 2
            for _ in range(40):
                response = await complete(parent.url)
                assert response.status_code == 200, response.text
            served = samples(await metrics(parent), "epd_http_requests_total")
            # 40 connections hashed over two accept queues: each gets some.
            assert sum(served.values()) == 40
            assert served["0"] > 0
            assert served["1"] > 0
            assert samples(await metrics(parent), "epd_router_process_up") == {"0": 1, "1": 1}
            parent.process.send_signal(signal.SIGTERM)
        assert parent.process.returncode == 0


async def test_a_killed_process_is_restarted_and_the_port_keeps_answering(
    tmp_path: Path,
) -> None:
    async with pd_worker(tmp_path) as worker:
        config = write_config(tmp_path / "epd.toml", worker)
        async with start_parent(config, 2) as parent:
            os.kill(parent.pids[0], signal.SIGKILL)
            for _ in range(10):
                assert (await complete(parent.url)).status_code == 200
            with trio.fail_after(START_S):
                while True:
                    text = await metrics(parent)
                    restarted = samples(text, "epd_router_process_restarts_total")["0"] == 1
                    if restarted and samples(text, "epd_router_process_up")["0"] == 1:
                        break
                    await trio.sleep(0.1)
            logs = "\n".join(parent.stderr)
            new_pid = re.findall(r"router process 0 restarted \(pid (\d+)", logs)
            assert new_pid
            assert int(new_pid[0]) != parent.pids[0]
            assert alive(int(new_pid[0]))
            for _ in range(10):
                assert (await complete(parent.url)).status_code == 200
            parent.process.send_signal(signal.SIGTERM)
        assert parent.process.returncode == 0


async def test_sigterm_drains_a_stream_in_flight_and_exits_0(tmp_path: Path) -> None:
    paced = ("--sim-output-token-s", "0.05", "--sim-tokens-per-delta", "1")
    async with pd_worker(tmp_path, *paced) as worker:
        config = write_config(tmp_path / "epd.toml", worker)
        async with start_parent(config, 2) as parent:
            body = {"model": "sim-model", "prompt": "hi", "max_tokens": 20, "stream": True}
            chunks: list[str] = []
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", parent.url + "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        chunks.append(line)
                        if len(chunks) == 1:
                            parent.process.send_signal(signal.SIGTERM)
            assert chunks[-1] == "data: [DONE]"
            finals = [json.loads(c[6:])["choices"][0]["finish_reason"] for c in chunks[:-1]]
            assert finals[-1] == "length"  # all 20 tokens, not cut by the stop
            assert len(chunks) >= 21
        assert parent.process.returncode == 0
        for pid in parent.pids.values():
            assert not alive(pid)


async def test_a_process_that_cannot_start_fails_the_parent_with_its_error(
    tmp_path: Path,
) -> None:
    # Prefill without decode: every router process refuses the topology.
    pools = '[pools.prefill]\nworkers = [{ id = "p0", address = "tcp://127.0.0.1:9" }]\n'
    config = write_config(tmp_path / "epd.toml", "", pools=pools)
    async with start_parent(config, 2, wait_ready=False) as parent:
        pass
    assert parent.process.returncode == 2
    errors = "\n".join(parent.stderr)
    assert "configuration error" in errors
    failed = r"router process \d exited with status 2 before it was ready: .*decode"
    assert re.search(failed, errors)
    assert not _process_lines(parent.stdout)


async def test_a_parent_killed_with_sigkill_leaves_no_router_process(tmp_path: Path) -> None:
    async with pd_worker(tmp_path) as worker:
        config = write_config(tmp_path / "epd.toml", worker)
        async with start_parent(config, 2) as parent:
            parent.process.kill()
            with trio.fail_after(START_S):
                # Not our children once the parent is gone: nothing to wait on but /proc.
                while any(alive(pid) for pid in parent.pids.values()):  # noqa: ASYNC110
                    await trio.sleep(0.05)
        assert parent.process.returncode == -signal.SIGKILL
