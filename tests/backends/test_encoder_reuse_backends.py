"""Encoder-output reuse and every media kind through both backends, on the simulator.

* native: simulated workers behind real :class:`~epd_actors.worker.runtime.WorkerServer`\\ s,
  reached over memory streams (``tests/memory_fleet.py``);
* openai_http: simulated vLLM HTTP servers on 127.0.0.1, port 0
  (``tests/backends/test_openai_http_backend.py``), where ``ec_transfer_params`` travel in the
  JSON bodies and a refusal comes back as an HTTP 400 with its code.

Images, audio (``input_audio`` over HTTP) and video go through E+P+D and E+PD;
with reuse on, the second turn of a conversation makes no encoder call, and an
entry the workers evicted is encoded again.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.encoder_cache import EncoderReuse
from epd_actors.core.router import open_router
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, Role, SamplingParams
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import (
    MemoryEncoderCacheStore,
    MemoryKVStore,
    SimStores,
    create_sim_stores,
)
from tests.backends.test_openai_http_backend import QUICK, fleet_router, sim_http_fleet
from tests.memory_fleet import MemoryFleet, worker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping
    from contextlib import AbstractAsyncContextManager

    from epd_actors.core.router import Router
    from epd_actors.request import GenerationEvent

    Deploy = Callable[
        [Mapping[str, int], EncoderReuse, SimStores], AbstractAsyncContextManager["Deployment"]
    ]

GUARD_S = 10.0
TTL = EncoderReuse(mode="ttl", ttl_s=60.0)
EPD = {"encode": 1, "prefill": 1, "decode": 1}
EPD_PD = {"encode": 1, "pd": 1}
MEDIA = {
    "image": ("image/png", b"\x89PNG\r\n\x1a\n"),
    "audio": ("audio/wav", b"RIFF\x24\x00\x00\x00WAVEfmt "),
    "video": ("video/mp4", b"\x00\x00\x00\x18ftypmp42"),
}


def item(kind: str, tag: str = "") -> MediaItem:
    mime, magic = MEDIA[kind]
    return MediaItem.from_bytes(magic + f"{kind} {tag}".encode() * 8, mime)


def turn(*media: MediaItem, history: int = 0) -> GenerationRequest:
    messages = [ChatMessage("user", (*range(len(media)), "what is in there?"))]
    for n in range(history):
        messages += [ChatMessage("assistant", (f"answer {n}",)), ChatMessage("user", ("more?",))]
    return GenerationRequest(
        Prompt(messages=tuple(messages)),
        media=media,
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
    )


def with_reuse(config: RouterConfig, reuse: EncoderReuse) -> RouterConfig:
    pools = tuple(
        replace(pool, encoder_reuse=reuse) if pool.stage == "encode" else pool
        for pool in config.pools
    )
    return replace(config, pools=pools)


async def run(router: Router, request: GenerationRequest) -> list[GenerationEvent]:
    async with router.generate(request) as events:
        return [event async for event in events]


def final(events: list[GenerationEvent]) -> DoneEvent | ErrorEvent:
    last = events[-1]
    assert isinstance(last, DoneEvent | ErrorEvent)
    return last


# ---------------------------------------------------------------- the two backends


class Deployment:
    """A router in front of simulated workers; counts each engine's calls."""

    def __init__(self, router: Router, engines: Mapping[str, SimEngine]) -> None:
        self.router = router
        self.engines = engines

    def total(self, counter: str) -> int:
        return sum(int(getattr(e.statistics(), counter)) for e in self.engines.values())


@asynccontextmanager
async def native_deployment(
    workers: Mapping[str, int], reuse: EncoderReuse, stores: SimStores
) -> AsyncIterator[Deployment]:
    engines = {
        f"{stage}-{n}": SimEngine(
            Role(stage),
            worker_id=f"{stage}-{n}",
            config=QUICK,
            ec_store=stores.ec,
            kv_store=stores.kv,
        )
        for stage, count in workers.items()
        for n in range(count)
    }
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            fleet = MemoryFleet(
                nursery,
                {wid: worker(engine, wid) for wid, engine in engines.items()},  # type: ignore[arg-type]
            )
            pools = tuple(
                PoolConfig(
                    stage,
                    tuple(
                        WorkerEndpoint(wid, f"tcp://{wid}.invalid:7000")
                        for wid in engines
                        if wid.rsplit("-", 1)[0] == stage
                    ),
                )
                for stage in workers
            )
            config = with_reuse(RouterConfig(pools, auth_token="s3cret"), reuse)
            async with open_router(config, backend_factory=fleet.backend) as router:
                await router.wait_ready()
                yield Deployment(router, engines)
            nursery.cancel_scope.cancel(reason="test done")


@asynccontextmanager
async def http_deployment(
    workers: Mapping[str, int], reuse: EncoderReuse, stores: SimStores
) -> AsyncIterator[Deployment]:
    async with sim_http_fleet(workers, stores=stores) as fleet:
        config = with_reuse(fleet.config(), reuse)
        async with fleet_router(fleet, config=config) as router:
            yield Deployment(router, {wid: fleet.engine(wid) for wid in fleet.servers})


BACKENDS = pytest.mark.parametrize(
    "deploy", [native_deployment, http_deployment], ids=["native", "openai_http"]
)
TOPOLOGIES = pytest.mark.parametrize("workers", [EPD, EPD_PD], ids=["E+P+D", "E+PD"])


@BACKENDS
@TOPOLOGIES
@pytest.mark.parametrize("kind", list(MEDIA))
async def test_each_media_kind_is_encoded_once_per_conversation(
    deploy: Deploy, workers: dict[str, int], kind: str
) -> None:
    media = item(kind, "x")
    async with deploy(workers, TTL, create_sim_stores()) as fleet:
        first = await run(fleet.router, turn(media))
        second = await run(fleet.router, turn(media, history=1))
        text = fleet.router.metrics.render().decode()
        assert fleet.total("encode_requests") == 1
        assert fleet.total("ec_entries_read") == 2  # P (or PD) found E's entry both times
        assert fleet.total("recomputed_items") == 0
    assert isinstance(final(first), DoneEvent), final(first)
    assert isinstance(final(second), DoneEvent), final(second)
    assert "".join(e.text for e in second if isinstance(e, DeltaEvent))
    assert 'epd_encoder_calls_skipped_total{pool="encode"} 1.0' in text


@BACKENDS
@TOPOLOGIES
async def test_each_media_kind_is_encoded_every_turn_with_reuse_off(
    deploy: Deploy, workers: dict[str, int]
) -> None:
    media = tuple(item(kind, "y") for kind in MEDIA)
    async with deploy(workers, EncoderReuse(), create_sim_stores()) as fleet:
        for history in range(2):
            assert isinstance(
                final(await run(fleet.router, turn(*media, history=history))), DoneEvent
            )
        assert fleet.total("encode_requests") == 2 * len(media)


@BACKENDS
@TOPOLOGIES
async def test_an_evicted_entry_is_encoded_again_through_the_backend(
    deploy: Deploy, workers: dict[str, int]
) -> None:
    stores = SimStores(MemoryEncoderCacheStore(1), MemoryKVStore())
    a, b = item("image", "a"), item("video", "b")
    async with deploy(workers, TTL, stores) as fleet:
        for request in (turn(a), turn(b), turn(a, history=1)):
            done = final(await run(fleet.router, request))
            assert isinstance(done, DoneEvent), done
        assert fleet.total("encode_requests") == 3
        text = fleet.router.metrics.render().decode()
    assert 'epd_encoder_cache_entries_missing_total{pool="encode"} 1.0' in text


async def test_over_http_p_gets_on_the_second_turn_the_params_e_gave_on_the_first() -> None:
    media = tuple(item(kind, "z") for kind in MEDIA)
    async with sim_http_fleet(EPD) as fleet:
        async with fleet_router(fleet, config=with_reuse(fleet.config(), TTL)) as router:
            for history in range(2):
                assert isinstance(
                    final(await run(router, turn(*media, history=history))), DoneEvent
                )
        encodes = fleet.stage_log("encode")
        first, second = fleet.stage_log("prefill")
    assert sorted(part for e in encodes for part in e["media_parts"]) == [  # type: ignore[attr-defined]
        "image_url",
        "input_audio",
        "video_url",
    ]
    assert isinstance(first["ec_transfer_params"], dict)
    assert len(first["ec_transfer_params"]) == len(media)
    assert second["ec_transfer_params"] == first["ec_transfer_params"]
