"""``worker --register``: real worker processes registering in a real Redis, found by a router.

The router runs here (native backend over loopback) with the ``redis``
discovery; the workers are ``python -m epd_actors worker`` processes.  Every
wait is for a condition (bounded only as a safety net).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

pytest.importorskip("coredis")

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig, RouterConfig
from epd_actors.discovery.redis_discovery import RedisDiscovery
from epd_actors.program.worker import AUTH_TOKEN_ENV
from epd_actors.request import DoneEvent
from tests.discovery.test_discovery_kubernetes import Recorder, members
from tests.discovery.test_discovery_redis import PREFIX, finishes, settings
from tests.faults.polling import wait_until
from tests.fleet.redis_server import RedisServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

pytestmark = [
    pytest.mark.processes,
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function MemoryObject(Send|Receive)Stream.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]

TOKEN = "registered-token"
SAFETY_S = 30.0
WORKER_TTL_S = 1.0


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


@asynccontextmanager
async def worker_process(url: str, worker_id: str, *args: str) -> AsyncIterator[trio.Process]:
    """A PD sim worker registering itself; yields once it announced its address."""
    command = [
        sys.executable, "-m", "epd_actors", "worker", "--role", "pd", "--worker-id", worker_id,
        "--register", url, "--register-prefix", PREFIX, "--register-ttl", str(WORKER_TTL_S),
        *args,
    ]  # fmt: skip
    env = {**os.environ, AUTH_TOKEN_ENV: TOKEN}
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        assert process.stdout is not None
        seen = b""
        while b"listening on" not in seen:
            chunk = await process.stdout.receive_some(4096)
            assert chunk, f"worker {worker_id} exited before listening"
            seen += chunk
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def usable(router: Any, worker_id: str) -> None:
    """Wait until the router has connected to the worker it added."""
    pool = router.pools["pd"]
    await wait_until(lambda: any(m.worker_id == worker_id and m.usable() for m in pool.members))


def router_config() -> RouterConfig:
    return RouterConfig((PoolConfig("pd"),), auth_token=TOKEN)


async def test_a_worker_process_registers_drains_on_sigterm_and_is_removed_when_it_exits(
    redis: RedisServer,
) -> None:
    with trio.fail_after(SAFETY_S):
        async with open_router(router_config()) as router, trio.open_nursery() as nursery:
            recorder = Recorder(router)
            discovery = RedisDiscovery(settings(redis.url), router.metrics.registry)
            await nursery.start(discovery.run, recorder)
            knobs = ("--drain-timeout", "20", "--sim-output-token-s", "0.005")
            async with worker_process(redis.url, "pd-w", *knobs) as process:
                await recorder.wait_for(("add", "pd-w"))
                await usable(router, "pd-w")
                assert await finishes(router, 1)
                request = GenerationRequest(
                    Prompt(text="long"), sampling=SamplingParams(max_tokens=400), request_id="l"
                )
                async with router.generate(request) as events:
                    await events.receive()  # in flight on the worker
                    process.send_signal(signal.SIGTERM)
                    await recorder.wait_for(("drain", "pd-w"))
                    assert members(router, "pd") == {"pd-w": True}
                    final = [e async for e in events][-1]
                assert isinstance(final, DoneEvent)  # the drain let it finish
                await recorder.wait_for(("remove", "pd-w"))
                assert await process.wait() == 0
            assert recorder.ops == [("add", "pd-w"), ("drain", "pd-w"), ("remove", "pd-w")]
            nursery.cancel_scope.cancel()


async def test_a_killed_worker_process_is_removed_once_its_registration_expired(
    redis: RedisServer,
) -> None:
    with trio.fail_after(SAFETY_S):
        async with open_router(router_config()) as router, trio.open_nursery() as nursery:
            recorder = Recorder(router)
            discovery = RedisDiscovery(settings(redis.url), router.metrics.registry)
            await nursery.start(discovery.run, recorder)
            async with worker_process(redis.url, "pd-k") as process:
                await recorder.wait_for(("add", "pd-k"))
                process.kill()
                await process.wait()
                await recorder.wait_for(("remove", "pd-k"))
            assert recorder.ops == [("add", "pd-k"), ("remove", "pd-k")]
            assert members(router, "pd") == {}
            nursery.cancel_scope.cancel()


async def test_a_worker_started_while_redis_is_down_registers_once_it_is_up(
    redis: RedisServer,
) -> None:
    redis.stop()
    with trio.fail_after(SAFETY_S):
        async with worker_process(redis.url, "pd-late"):
            redis.start()
            async with open_router(router_config()) as router, trio.open_nursery() as nursery:
                recorder = Recorder(router)
                discovery = RedisDiscovery(settings(redis.url), router.metrics.registry)
                await nursery.start(discovery.run, recorder)
                await recorder.wait_for(("add", "pd-late"))
                await usable(router, "pd-late")
                assert await finishes(router, 2)
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("--listen", "tcp://0.0.0.0:0"), "--advertise-address"),
        (("--register", "http://h/0"), "scheme 'http'"),
        (("--register-ttl", "0"), "--register-ttl"),
        (("--serve-openai",), "native workers"),
    ],
)
def test_bad_registration_options_are_refused_before_serving(
    args: tuple[str, ...], problem: str
) -> None:
    command: list[str] = [
        sys.executable, "-m", "epd_actors", "worker", "--role", "pd", "--insecure-no-auth",
        "--register", "redis://127.0.0.1:1/0", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert problem in done.stderr


def test_registration_options_need_register() -> None:
    env: dict[str, Any] = {k: v for k, v in os.environ.items() if k != "EPD_REGISTER_URL"}
    command = [
        sys.executable, "-m", "epd_actors", "worker", "--role", "pd", "--insecure-no-auth",
        "--advertise-address", "10.0.0.1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2
    assert "--advertise-address needs --register" in done.stderr
