"""Faults of real worker processes under a router (native backend, loopback TCP).

Rows of the fault matrix in docs/reliability.md: ``kill -9`` of an E, P, D and
PD worker in the middle of a request, and a worker whose heartbeats stop while
its data still flows.  Each row checks what the client saw, that the other
requests kept working, that the deployment restarted (or the router reconnected
to) the worker and that a later request used it, and that nothing leaked: no
request or pool slot in flight, no KV file left in the shared store.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import pytest
import trio

from epd_actors import (
    ChatMessage,
    DoneEvent,
    GenerationRequest,
    MediaItem,
    PoolConfig,
    Prompt,
    RouterConfig,
    SamplingParams,
    WorkerEndpoint,
    open_router,
)
from epd_actors.addresses import parse_address
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.errors import WorkerDisconnected
from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV

from .polling import wait_until
from .streams import Seen, consume, run_one

if TYPE_CHECKING:
    from pathlib import Path

    from epd_actors.backends.base import ManagedBackend
    from epd_actors.core.router import Router

pytestmark = pytest.mark.processes

TOKEN = "fault-token"
GUARD_S = 40.0
POLL_S = 0.01
IMAGE = MediaItem.from_bytes(b"a picture for the fault matrix", "image/png")


def text_request(max_tokens: int, tag: str) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"tell me about {tag}"), sampling=SamplingParams(max_tokens=max_tokens)
    )


def image_request(max_tokens: int, tag: str) -> GenerationRequest:
    return GenerationRequest(
        Prompt(messages=(ChatMessage("user", (f"describe {tag}", 0)),)),
        media=(IMAGE,),
        sampling=SamplingParams(max_tokens=max_tokens),
    )


def config_for(addresses: dict[str, str], layout: dict[str, list[str]]) -> RouterConfig:
    pools = tuple(
        PoolConfig(stage, tuple(WorkerEndpoint(w, addresses[w]) for w in ids))
        for stage, ids in layout.items()
    )
    return RouterConfig(pools, auth_token=TOKEN)


def kv_files(store: Path) -> list[str]:
    kv = store / "kv"
    return sorted(p.name for p in kv.iterdir() if not p.name.startswith(".")) if kv.exists() else []


async def busy_worker(router: Router, stage: str) -> str:
    """The worker of ``stage`` that holds a job now (polled)."""
    while True:
        busy = [m.worker_id for m in router.pools[stage].statistics() if m.in_flight]
        if busy:
            return busy[0]
        await trio.sleep(POLL_S)


async def wait_usable(backend: ManagedBackend) -> None:
    """Connected is not enough: a worker takes jobs once a heartbeat said it is ready."""
    await backend.wait_ready()


def assert_nothing_in_flight(router: Router) -> None:
    stats = router.statistics()
    assert stats.supervisor.requests_in_flight == 0
    assert all(m.in_flight == 0 for members in stats.pools.values() for m in members)


# ---------------------------------------------------------------- kill -9


@dataclass(frozen=True)
class KillCase:
    """One stage whose worker is killed mid-request."""

    stage: str
    layout: dict[str, list[str]]
    slow_args: tuple[str, ...]  # for the victim's pool: keeps the stage running
    request: str  # "image" or "text"
    streaming: bool  # killed after the first token (D, PD) rather than mid-stage


STALL = ("--sim-stall-s", "1.0")
PACED = ("--sim-output-token-s", "0.05")
KILL_CASES = [
    KillCase(
        "encode",
        {"encode": ["e0", "e1"], "prefill": ["p0"], "decode": ["d0"]},
        STALL,
        "image",
        streaming=False,
    ),
    KillCase(
        "prefill", {"prefill": ["p0", "p1"], "decode": ["d0"]}, STALL, "text", streaming=False
    ),
    KillCase("decode", {"prefill": ["p0"], "decode": ["d0", "d1"]}, PACED, "text", streaming=True),
    KillCase("pd", {"pd": ["pd0", "pd1"]}, PACED, "text", streaming=True),
]


@pytest.mark.parametrize("case", KILL_CASES, ids=[f"kill-9-{c.stage}" for c in KILL_CASES])
async def test_kill_9_mid_request(case: KillCase, tmp_path: Path) -> None:
    shared = ("--sim-store-dir", str(tmp_path), "--max-concurrency", "8")
    specs = [
        WorkerSpec(stage, w, (*shared, *(case.slow_args if stage == case.stage else ())))
        for stage, ids in case.layout.items()
        for w in ids
    ]
    make = image_request if case.request == "image" else text_request
    max_tokens = 40 if case.streaming else 4
    with trio.fail_after(GUARD_S):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            addresses = {w: str(a) for w, a in workers.addresses.items()}
            async with open_router(config_for(addresses, case.layout)) as router:
                await router.wait_ready()
                for worker_id in addresses:
                    await wait_usable(router.backends[worker_id])
                victim_request = Seen(first_token=trio.Event())
                bystander = Seen()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consume, router, make(max_tokens, "victim"), victim_request)
                    if case.streaming:
                        await victim_request.first_token.wait()  # type: ignore[union-attr]
                    victim = await busy_worker(router, case.stage)
                    survivor = next(w for w in case.layout[case.stage] if w != victim)
                    if case.streaming:
                        # A second stream, on the other worker, running through the kill.
                        nursery.start_soon(consume, router, make(max_tokens, "other"), bystander)
                        survivor_member = router.pools[case.stage].get(survivor)
                        assert survivor_member is not None
                        await wait_until(lambda: survivor_member.in_flight > 0, poll_s=POLL_S)
                    process = workers[victim].process
                    assert process is not None
                    process.send_signal(signal.SIGKILL)

                if case.streaming:
                    # After its first token a stream is never retried: typed error, no repeat.
                    assert isinstance(victim_request.error, WorkerDisconnected)
                    assert 0 < victim_request.tokens < max_tokens
                    assert isinstance(bystander.final, DoneEvent)
                    assert bystander.tokens == max_tokens
                else:
                    # Before any output the stage is retried on the other worker.
                    assert isinstance(victim_request.final, DoneEvent), victim_request.final
                    assert victim_request.final.timings.workers[case.stage] == (survivor,)
                    assert victim_request.tokens == max_tokens

                # While the victim is down, requests keep working through the survivor.
                during = await run_one(router, make(4, "during"))
                assert isinstance(during.final, DoneEvent), during.final

                # The deployment restarts it on the same address; the router reconnects
                # and, with the survivor drained, the next request is served by it.
                await workers[victim].wait_announced(2)
                await wait_usable(router.backends[victim])
                router.drain_worker(survivor)
                after = await run_one(router, make(4, "after"))
                assert isinstance(after.final, DoneEvent), after.final
                assert after.final.timings.workers[case.stage] == (victim,)
                assert_nothing_in_flight(router)
        assert workers[victim].exits[0] == -signal.SIGKILL
    assert kv_files(tmp_path) == []


# ---------------------------------------------------------------- heartbeats stop


FAST_HEARTBEATS = NativeSettings(
    heartbeat_interval_s=0.1,
    heartbeat_timeout_s=0.5,
    reconnect_backoff_start_s=0.05,
    reconnect_backoff_max_s=0.2,
    reconnect_jitter=0.0,
)


def fast_heartbeat_backends(endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
    return NativeBackend(
        endpoint.worker_id,
        parse_address(endpoint.address),
        auth_token=config.auth_token,
        settings=FAST_HEARTBEATS,
    )


async def test_a_worker_that_never_answers_pings_gets_no_traffic(tmp_path: Path) -> None:
    """``--heartbeat-drop`` from the start: the connection comes up (``Welcome``)
    but never becomes ready, so no request is routed to it; the router keeps
    declaring it dead after ``heartbeat_timeout_s`` and reconnecting.  The case of
    heartbeats stopping in the middle of a stream is ``test_wire_faults.py::
    test_heartbeats_stop_while_data_flows`` (in process: the flag is per process)."""
    shared = ("--sim-store-dir", str(tmp_path))
    specs = [
        WorkerSpec("prefill", "p0", shared),
        WorkerSpec("decode", "mute", (*shared, "--heartbeat-drop")),
        WorkerSpec("decode", "d1", shared),
    ]
    layout = {"prefill": ["p0"], "decode": ["mute", "d1"]}
    with trio.fail_after(GUARD_S):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            addresses = {w: str(a) for w, a in workers.addresses.items()}
            config = config_for(addresses, layout)
            async with open_router(config, backend_factory=fast_heartbeat_backends) as router:
                mute = cast("NativeBackend", router.backends["mute"])
                await router.wait_ready()
                while mute.statistics().disconnects < 2:
                    outcome = await run_one(router, text_request(4, "q"))
                    assert isinstance(outcome.final, DoneEvent), outcome.final
                    assert outcome.final.timings.workers["decode"] == ("d1",)
                    await trio.sleep(0.05)
                stats = mute.statistics()
                assert stats.connects >= 2
                assert mute.status().ready is False
                member = router.pools["decode"].get("mute")
                assert member is not None
                assert member.served == 0
                assert_nothing_in_flight(router)
    assert kv_files(tmp_path) == []
