"""Stopping for real: a second signal forces the exit, and ``local``'s workers die with it.

Real processes on loopback.  Nothing here asserts how long anything took: a
forced stop is told from a drain by what the client saw (a stream cut short,
no ``[DONE]``), and the guards only bound a test that would otherwise hang.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV

from .test_deployments import Output

pytestmark = pytest.mark.processes

GUARD_S = 90
SECOND = "send it again to stop at once"


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until_gone(pids: list[int]) -> None:
    while any(running(pid) for pid in pids):  # noqa: ASYNC110 (other processes: no event to wait on)
        await trio.sleep(0.05)


async def stream_lines(base: str, max_tokens: int, first: trio.Event, lines: list[str]) -> None:
    """A streaming completion; ``first`` is set at its first event; every line is kept."""
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    async with httpx.AsyncClient(timeout=None) as client:
        try:
            async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    lines.append(line)
                    first.set()
        except httpx.HTTPError:
            pass  # the router went away mid-stream


async def force_stop(process: trio.Process, stderr: Output, signum: int) -> None:
    """A signal, once it took effect (two close together may coalesce) the same again; reap."""
    process.send_signal(signum)
    await stderr.until(SECOND)
    process.send_signal(signum)
    await stderr.until("again: stopping at once")
    await process.wait()


async def test_kill_9_of_local_leaves_no_worker_behind() -> None:
    command = [sys.executable, "-m", "epd_actors", "local", "--port", "0", "--ws-port", "-1"]
    with trio.fail_after(GUARD_S):
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
        try:
            assert process.stdout is not None
            await Output(process.stdout).until("Ctrl-C stops everything.")
            workers = children_of(process.pid)
            assert len(workers) == 3  # E, P, D
        finally:
            process.kill()
            await process.wait()
        await until_gone(workers)
    assert not any(running(pid) for pid in workers)


async def test_a_second_sigint_stops_local_at_once() -> None:
    command = [
        sys.executable, "-m", "epd_actors", "local", "--port", "0", "--ws-port", "-1",
        "--drain-timeout", "600",
    ]  # fmt: skip
    lines: list[str] = []
    with trio.fail_after(GUARD_S):
        process = await trio.lowlevel.open_process(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert process.stdout is not None
            assert process.stderr is not None
            banner = await Output(process.stdout).until("Ctrl-C stops everything.")
            found = re.search(r"router listening on (http://\S+)", banner)
            assert found
            workers = children_of(process.pid)
            async with trio.open_nursery() as nursery:
                first = trio.Event()
                # 8,000 tokens at the simulator's 1 ms each: still streaming when stopped.
                nursery.start_soon(stream_lines, found.group(1), 8000, first, lines)
                await first.wait()
                await force_stop(process, Output(process.stderr), signal.SIGINT)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        await until_gone(workers)
    assert process.returncode == 0
    assert lines
    assert "data: [DONE]" not in lines  # cut short: the drain did not run to its end


async def test_a_second_sigterm_stops_serve_at_once(tmp_path: Path) -> None:
    token = "stop-token"
    shared = ("--sim-store-dir", str(tmp_path / "store"))
    slow = (*shared, "--sim-output-token-s", "0.05")
    specs = [WorkerSpec("prefill", "p0", shared), WorkerSpec("decode", "d0", slow)]
    lines: list[str] = []
    with trio.fail_after(GUARD_S):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: token}) as workers:
            addresses = {w: str(a) for w, a in workers.addresses.items()}
            config = tmp_path / "epd.toml"
            config.write_text(
                f'auth_token = "{token}"\n[server]\nhttp_listen = "127.0.0.1:0"\n'
                "drain_timeout_s = 600\n"
                f'[pools.prefill]\nworkers = [{{ id = "p0", address = "{addresses["p0"]}" }}]\n'
                f'[pools.decode]\nworkers = [{{ id = "d0", address = "{addresses["d0"]}" }}]\n'
            )
            command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
            process = await trio.lowlevel.open_process(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            try:
                assert process.stdout is not None
                assert process.stderr is not None
                banner = await Output(process.stdout).until("router listening on")
                found = re.search(r"router listening on (http://\S+)", banner)
                assert found
                async with trio.open_nursery() as nursery:
                    first = trio.Event()
                    nursery.start_soon(stream_lines, found.group(1), 4000, first, lines)
                    await first.wait()
                    await force_stop(process, Output(process.stderr), signal.SIGTERM)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert process.returncode == 0
    assert lines
    assert "data: [DONE]" not in lines


async def test_a_worker_started_to_exit_with_its_parent_drains_when_stdin_ends() -> None:
    command = [
        sys.executable, "-m", "epd_actors", "worker", "--role", "decode", "--worker-id", "d0",
        "--listen", "tcp://127.0.0.1:0", "--exit-with-parent",
    ]  # fmt: skip
    with trio.fail_after(GUARD_S):
        process = await trio.lowlevel.open_process(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, AUTH_TOKEN_ENV: "t"},
        )
        try:
            assert process.stdout is not None
            assert process.stdin is not None
            await Output(process.stdout).until("listening on")
            await process.stdin.aclose()  # what the kernel does when the parent dies
            status = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert status == 0
