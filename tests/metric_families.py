"""Live `/metrics` scrapes and docs/metrics.md, for the metrics doc and dashboard tests."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import httpx
import prometheus_client
import trio
from prometheus_client.parser import text_string_to_metric_families

from epd_actors.core.encoder_cache import EncoderReuse
from epd_actors.program.config_file import FileConfig, ServerConfig
from epd_actors.program.serve import serve_router
from epd_actors.testing import build_sim_fleet
from epd_actors.worker.metrics_http import serve_metrics

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `([a-z_:]+)` \| (counter|gauge|histogram) \|([^|]*)\|")

# The sample suffixes a family's type adds to its name in the text format.
_SUFFIX = {"counter": "_total"}


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family as PromQL names it, with its type and the labels its samples carry."""

    name: str
    type: str
    labels: frozenset[str]


def documented(section: str) -> dict[str, Family]:
    """The families listed in docs/metrics.md under ``## section``, by name."""
    families: dict[str, Family] = {}
    current = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            continue
        match = _ROW.match(line)
        if match and current == section:
            name, kind, labels = match.groups()
            names = frozenset(label.strip(" `") for label in labels.split(",") if label.strip())
            families[name] = Family(name, kind, names)
    return families


def families(text: str) -> dict[str, Family]:
    """The families of a scrape, named as PromQL uses them (``_created`` series left out)."""
    out: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # the parser reports a histogram's _created series as a gauge family
        name = family.name + _SUFFIX.get(family.type, "")
        labels = frozenset(key for sample in family.samples for key in sample.labels) - {"le"}
        out[name] = Family(name, family.type, labels)
    return out


CHAT = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 4,
}


async def scrape_router() -> str:
    """``GET /metrics`` of a live E+P+D router (encoder reuse on, WebSocket on) after one chat."""
    fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1})
    routed = fleet.router_config()
    reuse = EncoderReuse(mode="ttl")  # so the encoder-cache families have series
    pools = tuple(
        replace(pool, encoder_reuse=reuse) if pool.stage == "encode" else pool
        for pool in routed.pools
    )
    server = ServerConfig("127.0.0.1:0", ws_listen="127.0.0.1:0")
    config = FileConfig(replace(routed, pools=pools), server)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        start = partial(serve_router, config, stop=stop, backend_factory=fleet.backend_factory)
        addresses, router = await nursery.start(start)
        await router.wait_ready()
        base = f"http://127.0.0.1:{addresses.http[1]}"
        async with httpx.AsyncClient(base_url=base) as client:
            answer = await client.post("/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200, answer.text
            text = (await client.get("/metrics")).text
        stop.set()
    return text


async def scrape_worker() -> str:
    """``GET /metrics`` of a live worker metrics endpoint on loopback."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_metrics, listeners, registry=prometheus_client.REGISTRY))
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        nursery.cancel_scope.cancel()
    return text
