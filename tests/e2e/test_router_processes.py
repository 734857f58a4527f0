"""The router over real simulated worker processes on loopback (native backend)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import trio

import epd_actors
from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.processes

TOKEN = "integration-token"
IMAGES = [epd_actors.MediaItem.from_bytes(f"picture {n}".encode(), "image/png") for n in range(10)]


def mixed_request(rng: random.Random, n: int) -> epd_actors.GenerationRequest:
    sampling = epd_actors.SamplingParams(max_tokens=rng.randint(4, 24))
    count = rng.choice([0, 1, 2, 3])
    if count == 0:
        return epd_actors.GenerationRequest(
            epd_actors.Prompt(text=f"question number {n}"), sampling=sampling
        )
    media = tuple(rng.sample(IMAGES, count))
    parts: tuple[str | int, ...] = (f"describe these {n}", *range(count))
    return epd_actors.GenerationRequest(
        epd_actors.Prompt(messages=(epd_actors.ChatMessage("user", parts),)),
        media=media,
        sampling=sampling,
    )


def config_for(addresses: dict[str, str], layout: dict[str, list[str]]) -> epd_actors.RouterConfig:
    pools = tuple(
        epd_actors.PoolConfig(
            stage, tuple(epd_actors.WorkerEndpoint(w, addresses[w]) for w in worker_ids)
        )
        for stage, worker_ids in layout.items()
    )
    return epd_actors.RouterConfig(pools, auth_token=TOKEN)


def outstanding_kv_files(store: Path) -> list[str]:
    kv = store / "kv"
    return sorted(p.name for p in kv.iterdir() if not p.name.startswith(".")) if kv.exists() else []


@pytest.mark.parametrize(
    "layout",
    [
        {"encode": ["e0", "e1"], "prefill": ["p0"], "decode": ["d0"]},
        {"encode": ["e0"], "pd": ["pd0"]},
    ],
    ids=["E+P+D", "E+PD"],
)
async def test_200_concurrent_mixed_requests(layout: dict[str, list[str]], tmp_path: Path) -> None:
    shared = ("--sim-store-dir", str(tmp_path))
    specs = [WorkerSpec(stage, w, shared) for stage, ids in layout.items() for w in ids]
    rng = random.Random(7)
    requests = [mixed_request(rng, n) for n in range(200)]
    outcomes: list[epd_actors.GenerationEvent] = []
    tokens: dict[str, int] = {}

    async def run(request: epd_actors.GenerationRequest) -> None:
        count = 0
        async with router.generate(request) as events:
            async for event in events:
                if isinstance(event, epd_actors.DeltaEvent):
                    count += len(event.token_ids)
                elif isinstance(event, epd_actors.DoneEvent | epd_actors.ErrorEvent):
                    outcomes.append(event)
        tokens[request.request_id] = count

    with trio.fail_after(120):
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: TOKEN}) as workers:
            addresses = {w: str(a) for w, a in workers.addresses.items()}
            async with epd_actors.open_router(config_for(addresses, layout)) as router:
                await router.wait_ready()
                async with trio.open_nursery() as nursery:
                    for request in requests:
                        nursery.start_soon(run, request)
                stats = router.statistics()
    errors = [e for e in outcomes if isinstance(e, epd_actors.ErrorEvent)]
    assert errors == []
    assert len(outcomes) == 200
    for request in requests:
        assert tokens[request.request_id] == request.sampling.max_tokens
    assert stats.supervisor.requests_in_flight == 0
    assert all(m.in_flight == 0 for members in stats.pools.values() for m in members)
    assert outstanding_kv_files(tmp_path) == []
