"""Embed the router in a Trio program.

Starts three simulated worker processes (E, P, D) on loopback, builds a router
over them with the native backend, and streams one image request and one text
request through E -> P -> D.

    python examples/embed_in_trio.py
"""

from __future__ import annotations

import secrets
import tempfile

import trio

import epd_actors
from epd_actors.program.deployment import WorkerSpec, open_local_workers
from epd_actors.program.worker import AUTH_TOKEN_ENV


def router_config(addresses: dict[str, str], token: str) -> epd_actors.RouterConfig:
    def pool(stage: str, worker_id: str) -> epd_actors.PoolConfig:
        endpoint = epd_actors.WorkerEndpoint(worker_id, addresses[worker_id])
        return epd_actors.PoolConfig(stage, (endpoint,))

    return epd_actors.RouterConfig(
        (pool("encode", "e0"), pool("prefill", "p0"), pool("decode", "d0")), auth_token=token
    )


async def ask(router: epd_actors.Router, request: epd_actors.GenerationRequest) -> None:
    async with router.generate(request) as events:
        async for event in events:
            if isinstance(event, epd_actors.DeltaEvent):
                print(event.text, end="", flush=True)
            elif isinstance(event, epd_actors.DoneEvent):
                print(f"\n[{event.finish_reason}] {event.usage} {event.timings.header_value()}")
            elif isinstance(event, epd_actors.ErrorEvent):
                print(f"\n[error] {event.error}")


async def main() -> None:
    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="epd-example-") as store:
        shared = ("--sim-store-dir", store)
        specs = [
            WorkerSpec(role, worker_id, shared)
            for role, worker_id in (("encode", "e0"), ("prefill", "p0"), ("decode", "d0"))
        ]
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: token}) as workers:
            addresses = {worker_id: str(a) for worker_id, a in workers.addresses.items()}
            async with epd_actors.open_router(router_config(addresses, token)) as router:
                await router.wait_ready()
                picture = epd_actors.MediaItem.from_bytes(b"\x89PNG not really", "image/png")
                await ask(
                    router,
                    epd_actors.GenerationRequest(
                        epd_actors.Prompt(
                            messages=(
                                epd_actors.ChatMessage("user", ("What is in this picture?", 0)),
                            )
                        ),
                        media=(picture,),
                        sampling=epd_actors.SamplingParams(max_tokens=16, temperature=0.0),
                    ),
                )
                await ask(
                    router,
                    epd_actors.GenerationRequest(
                        epd_actors.Prompt(text="Tell me a story"),
                        sampling=epd_actors.SamplingParams(max_tokens=16),
                    ),
                )


if __name__ == "__main__":
    trio.run(main)
