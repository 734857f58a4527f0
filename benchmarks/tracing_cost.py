"""What request tracing costs the router: requests per second over an instant simulated fleet.

Runs the same requests three ways, in one process: tracing off, tracing on with every
request sampled (spans go to the SDK's in-memory exporter through a batch processor, as
they would go to an OTLP exporter), and tracing on with ``sample_ratio = 0``.

    python benchmarks/tracing_cost.py [--requests N] [--concurrency C]
"""

from __future__ import annotations

import argparse

import trio
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.tracing import TracingConfig, open_tracing
from epd_actors.testing import build_sim_fleet, sim_config

INSTANT = sim_config(encode_item_s=0.0, prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)


async def run(mode: str, requests: int, concurrency: int) -> float:
    tracing = None
    if mode != "off":
        ratio = 1.0 if mode == "on" else 0.0
        processor = BatchSpanProcessor(InMemorySpanExporter())
        tracing = open_tracing(TracingConfig(enabled=True, sample_ratio=ratio), processor=processor)
    fleet = build_sim_fleet({"prefill": 1, "decode": 1}, config=INSTANT)
    config = fleet.router_config()
    sampling = SamplingParams(max_tokens=8)
    async with open_router(
        config, backend_factory=fleet.backend_factory, tracing=tracing
    ) as router:
        await router.wait_ready()
        limiter = trio.CapacityLimiter(concurrency)

        async def one(n: int) -> None:
            async with limiter:
                request = GenerationRequest(Prompt(text=f"hello {n}"), sampling=sampling)
                async with router.generate(request) as events:
                    async for _ in events:
                        pass

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for n in range(requests):
                nursery.start_soon(one, n)
        return requests / (trio.current_time() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    for mode in ("off", "on", "unsampled", "off", "on", "unsampled"):
        rate = trio.run(run, mode, args.requests, args.concurrency)
        print(f"tracing {mode:>9}: {rate:8.0f} requests/s")


if __name__ == "__main__":
    main()
