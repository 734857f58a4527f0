"""Native workers served over memory streams, and a router backend factory that dials them.

Each worker id names a real :class:`~epd_actors.worker.runtime.WorkerServer`;
every connection attempt of its :class:`~epd_actors.backends.native.backend.NativeBackend`
opens a ``trio.testing.memory_stream_pair`` and serves the far end with the
server registered under that id *at that moment*, so replacing the entry
stands for a worker restarted on the same address.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import trio
import trio.testing

from epd_actors.addresses import parse_address
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.protocol import Prompt, SamplingParams
from epd_actors.request import GenerationRequest
from epd_actors.worker.runtime import WorkerConfig, WorkerServer

if TYPE_CHECKING:
    from epd_actors.core.router import Router
    from epd_actors.request import GenerationEvent

    from .fakes import ScriptedEngine

TOKEN = "s3cret"
MODEL = "fake-model"  # ScriptedEngine's default
SETTINGS = NativeSettings(
    reconnect_backoff_start_s=0.25, reconnect_backoff_max_s=1.0, reconnect_jitter=0.0
)


def worker(engine: ScriptedEngine, worker_id: str, **config: object) -> WorkerServer:
    """A worker server in front of ``engine`` (``config``: ``WorkerConfig`` fields)."""
    options: dict[str, object] = {"worker_id": worker_id, "auth_token": TOKEN, **config}
    return WorkerServer(engine, WorkerConfig(**options))  # type: ignore[arg-type]


class MemoryFleet:
    """Worker servers by id; :meth:`backend` is a router ``backend_factory``.

    Use it inside ``async with trio.open_nursery() as nursery`` and give it
    that nursery: the far ends of the connections are served there.
    """

    def __init__(self, nursery: trio.Nursery, servers: dict[str, WorkerServer]) -> None:
        self.nursery = nursery
        self.servers = servers

    def backend(self, endpoint: WorkerEndpoint, config: RouterConfig) -> NativeBackend:
        return self.client(endpoint.worker_id)

    def client(self, worker_id: str, client_id: str = "epd_actors-router") -> NativeBackend:
        """A backend for ``worker_id`` (another router's, with another ``client_id``)."""
        return NativeBackend(
            worker_id,
            parse_address(f"tcp://{worker_id}.invalid:7000"),
            auth_token=TOKEN,
            settings=SETTINGS,
            client_id=client_id,
            connect=partial(self._connect, worker_id),
        )

    async def _connect(self, worker_id: str) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        client_end, worker_end = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self.servers[worker_id].handle_stream, worker_end)
        return client_end

    def config(
        self,
        stage: str,
        *,
        policy: str = "round_robin",
        max_in_flight_per_worker: int = 256,
        **options: object,
    ) -> RouterConfig:
        """One pool of every worker, serving ``MODEL`` (``options``: ``RouterConfig`` fields)."""
        endpoints = tuple(
            WorkerEndpoint(worker_id, f"tcp://{worker_id}.invalid:7000")
            for worker_id in self.servers
        )
        pool = PoolConfig(stage, endpoints, policy, max_in_flight_per_worker)
        return RouterConfig((pool,), model=MODEL, **options)  # type: ignore[arg-type]


def request(n: int) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"q{n}"), sampling=SamplingParams(max_tokens=3), request_id=f"r{n}"
    )


async def final_event(router: Router, n: int) -> GenerationEvent:
    """Run request ``n`` to its end; its last event."""
    async with router.generate(request(n)) as events:
        return [event async for event in events][-1]
