"""Every request waiting on a worker ends promptly when that worker's only connection dies.

The scale benchmark's stuck request: a router with one PD worker whose pool is
full (``max_in_flight_per_worker`` jobs), more jobs parked in
``WorkerPool.lease`` for a slot.  The connection is lost: every job holding a
slot fails with ``WorkerDisconnected`` and returns its lease, and each return
wakes one parked job, which finds the worker unusable and fails with
``NoHealthyWorker`` -- without waking the next.  With more jobs parked than
leases returned, the rest stayed parked (nothing else unparks the pool) until
``first_token_timeout_s``: in flight for minutes, no response bytes at all.
Memory streams and the virtual clock, as in ``tests/faults``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from epd_actors import DeltaEvent, DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.addresses import parse_address
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.core.config import Deadlines, PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.retry import RetryPolicy
from epd_actors.core.router import Router, open_router
from epd_actors.errors import StageTimeout
from epd_actors.protocol import Prompt, Role, SamplingParams
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.store import create_sim_stores
from epd_actors.worker.runtime import WorkerConfig, WorkerServer

TOKEN = "loss-token"
GUARD_S = 600.0
SETTINGS = NativeSettings(
    reconnect_backoff_start_s=0.25, reconnect_backoff_max_s=1.0, reconnect_jitter=0.0
)
DEADLINES = Deadlines(first_token_timeout_s=120.0, inter_token_timeout_s=60.0)
PROMPT_BOUND_S = 5.0  # a request on a lost connection must end within this


class OneWorker:
    """One PD worker over memory streams; ``cut()`` closes the worker's end of the link."""

    def __init__(self) -> None:
        stores = create_sim_stores()
        engine = SimEngine(
            Role.PD,
            worker_id="w",
            config=SimConfig(output_token_s=1.0),
            ec_store=stores.ec,
            kv_store=stores.kv,
        )
        self.server = WorkerServer(engine, WorkerConfig(worker_id="w", auth_token=TOKEN))
        self.nursery: trio.Nursery | None = None
        self.ends: list[trio.abc.Stream] = []
        self.down = False

    async def connect(self) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        if self.down:
            raise ConnectionRefusedError("worker down")
        router_end, worker_end = trio.testing.memory_stream_pair()
        assert self.nursery is not None
        self.nursery.start_soon(self.server.handle_stream, worker_end)
        self.ends.append(worker_end)
        return router_end

    async def cut(self) -> None:
        self.down = True
        await self.ends[-1].aclose()

    def backend(self, endpoint: WorkerEndpoint, config: RouterConfig) -> NativeBackend:
        return NativeBackend(
            endpoint.worker_id,
            parse_address(endpoint.address),
            auth_token=TOKEN,
            settings=SETTINGS,
            connect=self.connect,
        )


class Outcome:
    def __init__(self) -> None:
        self.tokens = 0
        self.final: DoneEvent | ErrorEvent | None = None
        self.ended_at: float | None = None
        self.first_token = trio.Event()


async def consume(router: Router, outcome: Outcome) -> None:
    request = GenerationRequest(Prompt(text="hello"), sampling=SamplingParams(1000))
    async with router.generate(request) as events:
        async for event in events:
            if isinstance(event, DeltaEvent):
                outcome.tokens += len(event.token_ids)
                outcome.first_token.set()
            elif isinstance(event, DoneEvent | ErrorEvent):
                outcome.final = event
    outcome.ended_at = trio.current_time()


@pytest.mark.parametrize("waiting", [1, 2, 3])
async def test_requests_waiting_for_a_slot_end_when_the_connection_dies(
    autojump_clock: object, waiting: int
) -> None:
    worker = OneWorker()
    config = RouterConfig(
        (
            PoolConfig(
                "pd", (WorkerEndpoint("w", "tcp://127.0.0.1:0"),), max_in_flight_per_worker=1
            ),
        ),
        auth_token=TOKEN,
        deadlines=DEADLINES,
        retries=RetryPolicy(max_attempts=1),
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            worker.nursery = nursery
            async with open_router(config, backend_factory=worker.backend) as router:
                await router.backends["w"].wait_ready()
                running = Outcome()
                queued = [Outcome() for _ in range(waiting)]
                async with trio.open_nursery() as clients:
                    clients.start_soon(consume, router, running)
                    await running.first_token.wait()
                    for outcome in queued:
                        clients.start_soon(consume, router, outcome)
                    await trio.sleep(2.0)  # the others now wait in the pool for the slot
                    assert router.statistics().supervisor.requests_in_flight == 1 + waiting
                    cut_at = trio.current_time()
                    await worker.cut()
                for outcome in [running, *queued]:
                    assert isinstance(outcome.final, ErrorEvent), outcome.final
                    assert not isinstance(outcome.final.error, StageTimeout), outcome.final.error
                    assert outcome.ended_at is not None
                    assert outcome.ended_at - cut_at <= PROMPT_BOUND_S
                assert router.statistics().supervisor.requests_in_flight == 0
            nursery.cancel_scope.cancel()
