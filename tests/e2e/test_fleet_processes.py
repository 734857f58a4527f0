"""Three router processes, one real Redis, simulated workers that register themselves.

Each router is its own ``serve`` process (its own port) with ``[shared]``
pointed at one ``redis-server`` and ``[discovery] kind = "redis"``; the PD
workers are ``worker --register`` processes.  What is proven, as users would
see it over HTTP:

- fleet-wide least-in-flight: long streams sent to the three routers in turn
  spread evenly over the workers, where the same routers without Redis pile
  them up (each router sees only its own load);
- a worker drained through one router's admin API is drained on all three;
- ``kill -9`` of one router loses only that router's streams;
- Redis killed and restarted under load: no request fails.

Every wait is for a condition read over HTTP (bounded only as a safety net).
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

pytest.importorskip("coredis")

from epd_actors.program.worker import AUTH_TOKEN_ENV
from tests.faults.polling import wait_until
from tests.fleet.redis_server import RedisServer, free_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

# A stream whose router is killed leaves httpx's inner async generators (under
# ``aiter_lines``, which is closed here) to Trio's finalizer, which says so;
# httpx closes the response and its connection either way.
pytestmark = [
    pytest.mark.processes,
    pytest.mark.filterwarnings(r"ignore:Async generator 'httpx\.:ResourceWarning"),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <async_generator object"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function MemoryObject(Send|Receive)Stream.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]

TOKEN = "fleet-token"
ADMIN = "fleet-admin"
PREFIX = "e2e"
SAFETY_S = 120.0
WORKERS = ("pd-0", "pd-1", "pd-2")
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(autouse=True)
def _collect_coredis_leftovers() -> Iterator[None]:
    yield
    gc.collect()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@dataclass
class RouterProcess:
    name: str
    process: trio.Process
    url: str = ""
    lines: list[str] = field(default_factory=list)


def router_config(
    tmp_path: Path, name: str, redis_url: str | None, addresses: dict[str, str]
) -> Path:
    text = (
        f'auth_token = "{TOKEN}"\n'
        "[server]\n"
        'http_listen = "127.0.0.1:0"\n'
        f'admin_key = "{ADMIN}"\n'
        "drain_timeout_s = 1\n"
    )
    if redis_url is None:
        workers = ", ".join(f'{{ id = "{w}", address = "{a}" }}' for w, a in addresses.items())
        text += f'[pools.pd]\npolicy = "least_in_flight"\nworkers = [{workers}]\n'
    else:
        text += '[pools.pd]\npolicy = "least_in_flight"\nworkers = []\n'
        text += (
            f'[shared]\nredis_url = "{redis_url}"\nrouter_id = "{name}"\n'
            f'key_prefix = "{PREFIX}"\npublish_interval_s = 0.05\nttl_s = 0.5\n'
            '[discovery]\nkind = "redis"\nperiod_s = 0.05\n'
        )
    path = tmp_path / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return path


async def _collect(stream: trio.abc.ReceiveStream, lines: list[str]) -> None:
    buffer = b""
    while chunk := await stream.receive_some(65536):
        buffer += chunk
        *done, buffer = buffer.split(b"\n")
        lines += [line.decode(errors="replace") for line in done]


@asynccontextmanager
async def processes(
    commands: dict[str, list[str]], ready: str
) -> AsyncIterator[dict[str, RouterProcess]]:
    """The commands, started together; yields once each printed a line matching ``ready``.

    On exit each gets SIGTERM (a graceful drain), then is waited for.
    """
    started: dict[str, RouterProcess] = {}
    env = {**os.environ, AUTH_TOKEN_ENV: TOKEN}
    try:
        async with trio.open_nursery() as nursery:
            for name, command in commands.items():
                process = await trio.lowlevel.open_process(
                    command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
                )
                started[name] = RouterProcess(name, process)
                assert process.stdout is not None
                nursery.start_soon(_collect, process.stdout, started[name].lines)
            for child in started.values():
                await wait_until(lambda c=child: _ready(c, ready))  # type: ignore[misc]
            yield started
            for child in started.values():
                if child.process.returncode is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in started.values():
                await child.process.wait()
    finally:
        for child in started.values():
            if child.process.returncode is None:
                child.process.kill()
            with trio.CancelScope(shield=True):
                await child.process.wait()


def _ready(child: RouterProcess, ready: str) -> bool:
    found = re.search(ready, "\n".join(child.lines))
    assert child.process.poll() is None or found, "\n".join(child.lines)
    if found and found.groups():
        child.url = found.group(1)
    return found is not None


@asynccontextmanager
async def fleet(tmp_path: Path, redis_url: str | None) -> AsyncIterator[list[RouterProcess]]:
    """Three PD workers (registering in Redis when there is one) and three routers.

    All six processes start at once: the workers' ports are chosen first.
    """
    await trio.Path(tmp_path).mkdir(exist_ok=True)
    addresses = {w: f"tcp://127.0.0.1:{free_port()}" for w in WORKERS}
    knobs = ["--sim-output-token-s", "0.02", "--sim-store-dir", str(tmp_path)]
    knobs += ["--drain-timeout", "1"]
    if redis_url is not None:
        knobs += ["--register", redis_url, "--register-prefix", PREFIX, "--register-ttl", "1.5"]
    epd = [sys.executable, "-m", "epd_actors"]
    commands = {
        w: [*epd, "worker", "--role", "pd", "--worker-id", w, "--listen", a, *knobs]
        for w, a in addresses.items()
    }
    for n in range(3):
        config = router_config(tmp_path, f"r{n}", redis_url, addresses)
        commands[f"r{n}"] = [*epd, "serve", "--config", str(config)]
    async with processes(commands, r"router listening on (http://\S+)|listening on tcp") as up:
        routers = [up[f"r{n}"] for n in range(3)]
        for router in routers:
            await wait_for_workers(router, set(WORKERS))
        yield routers


async def admin(router: RouterProcess, method: str, path: str) -> Any:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.request(method, router.url + path, headers=HEADERS)
    assert response.status_code == 200, response.text
    return response.json()


async def members(router: RouterProcess) -> dict[str, dict[str, Any]]:
    body = await admin(router, "GET", "/admin/workers")
    return {m["worker_id"]: m for m in body["pools"].get("pd", [])}


async def wait_for_workers(router: RouterProcess, wanted: set[str]) -> None:
    with trio.fail_after(SAFETY_S):
        while True:
            found = await members(router)
            if set(found) == wanted and all(m["usable"] for m in found.values()):
                return
            await trio.sleep(0.05)


async def fleet_in_flight(routers: list[RouterProcess]) -> dict[str, int]:
    """Each worker's jobs in flight, summed over every router (the worker's real load)."""
    load = dict.fromkeys(WORKERS, 0)
    for router in routers:
        for worker_id, member in (await members(router)).items():
            load[worker_id] += member["in_flight"]
    return load


async def wait_fleet_sees(routers: list[RouterProcess], total: int) -> None:
    """Until every router counts ``total`` requests in flight over the fleet."""
    with trio.fail_after(SAFETY_S):
        for router in routers:
            while True:
                view = await admin(router, "GET", "/admin/routers")
                own = next(r["requests_in_flight"] for r in view["routers"] if r["this"])
                if own + view["remote_requests_in_flight"] == total:
                    break
                await trio.sleep(0.02)


async def _lines(response: httpx.Response) -> AsyncIterator[str]:
    """``aiter_lines``, closed here even when the connection breaks (not left to GC)."""
    async with aclosing(response.aiter_lines()) as lines:
        async for line in lines:
            yield line


class Streams:
    """Long streamed completions held open; each records how it ended."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}

    async def hold(
        self,
        router: RouterProcess,
        tag: str,
        max_tokens: int,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        body = {"model": "sim-model", "prompt": tag, "max_tokens": max_tokens, "stream": True}
        started = False
        try:
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", router.url + "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                async for line in _lines(response):
                    if line.startswith("data:") and not started:
                        started = True
                        task_status.started()
                    if line == "data: [DONE]":
                        self.ended[tag] = "done"
                        return
                    if line.startswith("event: error"):
                        self.ended[tag] = "error"
                        return
            self.ended[tag] = "cut"
        except httpx.TransportError:
            self.ended[tag] = "broken"
        finally:
            if not started:
                task_status.started()


async def spread(routers: list[RouterProcess], *, shared: bool) -> dict[str, int]:
    """Six long streams sent to the routers in turn; each worker's load once all run."""
    streams = Streams()
    async with trio.open_nursery() as nursery:
        for n in range(6):
            await nursery.start(streams.hold, routers[n % 3], f"long {n}", 2000)
            if shared:
                await wait_fleet_sees(routers, n + 1)
        load = await fleet_in_flight(routers)
        nursery.cancel_scope.cancel()
    return load


async def test_least_in_flight_balances_the_fleet_with_redis_and_skews_without(
    tmp_path: Path, redis: RedisServer
) -> None:
    with trio.fail_after(SAFETY_S):
        async with fleet(tmp_path / "alone", None) as routers:
            alone = await spread(routers, shared=False)
        async with fleet(tmp_path / "shared", redis.url) as routers:
            shared = await spread(routers, shared=True)
    print(f"six long streams over three routers: alone {alone}, shared {shared}")
    assert sorted(alone.values()) == [0, 3, 3]  # each router saw only its own two
    assert sorted(shared.values()) == [2, 2, 2]


async def test_a_worker_drained_on_one_router_is_drained_on_all(
    tmp_path: Path, redis: RedisServer
) -> None:
    with trio.fail_after(SAFETY_S):
        async with fleet(tmp_path, redis.url) as routers:
            await admin(routers[1], "POST", "/admin/workers/pd-1/drain")
            for router in routers:
                while not (await members(router))["pd-1"]["draining"]:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            streams = Streams()
            async with trio.open_nursery() as nursery:
                for n in range(6):
                    await nursery.start(streams.hold, routers[n % 3], f"after drain {n}", 2000)
                load = await fleet_in_flight(routers)
                nursery.cancel_scope.cancel()
            assert load["pd-1"] == 0
            assert load["pd-0"] + load["pd-2"] == 6


async def test_kill_9_of_one_router_loses_only_its_own_streams(
    tmp_path: Path, redis: RedisServer
) -> None:
    with trio.fail_after(SAFETY_S):
        async with fleet(tmp_path, redis.url) as routers:
            streams = Streams()
            async with trio.open_nursery() as nursery:
                for n in range(9):
                    # The killed router's streams outlast the kill; the others run to the end.
                    tokens = 5000 if n % 3 == 1 else 150
                    await nursery.start(streams.hold, routers[n % 3], f"r{n % 3} s{n}", tokens)
                routers[1].process.send_signal(signal.SIGKILL)
            assert streams.ended == {
                f"r{n % 3} s{n}": "broken" if n % 3 == 1 else "done" for n in range(9)
            }
            for router in (routers[0], routers[2]):
                body = {"model": "sim-model", "prompt": "after", "max_tokens": 3}
                async with httpx.AsyncClient(timeout=30) as client:
                    response = await client.post(router.url + "/v1/completions", json=body)
                assert response.status_code == 200
            # The killed router's report expires: the others count only each other.
            await wait_fleet_sees([routers[0], routers[2]], 0)
            view = await admin(routers[0], "GET", "/admin/routers")
            assert sorted(r["id"] for r in view["routers"]) == ["r0", "r2"]


async def test_redis_killed_and_restarted_under_load_fails_no_request(
    tmp_path: Path, redis: RedisServer
) -> None:
    results: list[int] = []
    done = 0

    async def client_loop(router: RouterProcess, tag: str, count: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=30) as client:
            for n in range(count):
                body = {"model": "sim-model", "prompt": f"{tag} {n}", "max_tokens": 4}
                response = await client.post(router.url + "/v1/completions", json=body)
                results.append(response.status_code)
                done += 1

    with trio.fail_after(SAFETY_S):
        async with fleet(tmp_path, redis.url) as routers:
            async with trio.open_nursery() as nursery:
                for n in range(6):
                    nursery.start_soon(client_loop, routers[n % 3], f"c{n}", 25)
                await wait_until(lambda: done >= 25)
                served = [await members(router) for router in routers]
                redis.stop()
                down_at = done
                await wait_until(lambda: done >= down_at + 50)
                print(f"Redis down from {down_at} to {done} requests done")
                redis.start()  # empty
                up_at = done
            for router in routers:  # the discovered workers stayed, and are known again
                await wait_for_workers(router, set(WORKERS))
            await wait_fleet_sees(routers, 0)
            view = await admin(routers[0], "GET", "/admin/routers")
            assert view["store_up"]
            assert sorted(r["id"] for r in view["routers"]) == ["r0", "r1", "r2"]
            # Never removed while Redis was away: a worker added again would count from 0.
            assert sum(m["served"] for view in served for m in view.values()) >= 25
            for router, before in zip(routers, served, strict=True):
                after = await members(router)
                for worker_id in WORKERS:
                    assert after[worker_id]["served"] >= before[worker_id]["served"]
    print(f"150 requests: Redis killed after {down_at}, restarted after {up_at}")
    assert len(results) == 150
    assert set(results) == {200}
