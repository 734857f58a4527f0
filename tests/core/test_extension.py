"""A new backend kind, routing policy and stage, each one class and one registration.

They are written here, outside the package, as a program embedding the router
would write them, and a request runs through all three with nothing else edited:
the configuration accepts the names, the router builds the backends and the
pools, and the supervisor plans the new stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import pytest
import trio

import epd_actors.core.backend_kinds as kinds_module
import epd_actors.core.config as config_module
import epd_actors.core.routing.base as routing_module
from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.core.actors import STAGE_ACTORS, BaseActor, StageOutput, register_stage
from epd_actors.core.backend_kinds import register_backend_kind
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.lifecycle import Phase
from epd_actors.core.router import open_router
from epd_actors.core.routing import StatelessPolicy, register_policy
from epd_actors.errors import ConfigError
from epd_actors.protocol import Prompt, Role, SamplingParams
from epd_actors.request import DoneEvent, GenerationRequest
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.store import create_sim_stores

if TYPE_CHECKING:
    import random
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from epd_actors.backends.base import ManagedBackend, StageBackend
    from epd_actors.core.actors import Job
    from epd_actors.core.routing import Candidate, Policy, RouteKey


class LowestId(StatelessPolicy):
    """Always the candidate with the smallest worker id."""

    name = "lowest_id"

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        return cls()

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        return min(candidates, key=lambda c: c.worker_id, default=None)


class SimulatedKind:
    """``simulated``: a simulated engine in the router's process, at ``sim:ROLE``."""

    name: ClassVar[str] = "simulated"
    built: ClassVar[list[str]] = []

    def check_address(self, address: str, *, key: str) -> None:
        role = address.removeprefix("sim:")
        if not address.startswith("sim:") or role not in Role.__members__.values():
            raise ConfigError(f"{key}: {address!r} is not sim:ROLE")

    def open_factory(
        self, config: RouterConfig, settings: object | None
    ) -> Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]:
        stores = create_sim_stores()  # one set per router: its workers share them

        def build(endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
            self.built.append(endpoint.worker_id)
            engine = SimEngine(
                Role(endpoint.address.removeprefix("sim:")),
                worker_id=endpoint.worker_id,
                config=SimConfig(),
                ec_store=stores.ec,
                kv_store=stores.kv,
            )
            return InProcessBackend(endpoint.worker_id, engine)

        return build


class Audit(BaseActor):
    """A stage between prefill and decode that notes every request it sees."""

    stage = "audit"
    phase = Phase.PREFILLING
    order = 25
    requires = ("prefill",)
    seen: ClassVar[list[str]] = []

    async def handle(self, job: Job, backend: StageBackend) -> None:
        self.seen.append(job.context.request.request_id)
        await trio.lowlevel.checkpoint()
        await job.reply.send(StageOutput())


@pytest.fixture
def registered() -> Iterator[None]:
    """The three registrations, undone afterwards so other tests see the built-ins only."""
    registries = (
        routing_module._REGISTRY,
        kinds_module._KINDS,
        config_module._ADDRESS_CHECKS,
        STAGE_ACTORS,
    )
    saved = tuple(dict(registry) for registry in registries)
    register_policy(LowestId)
    register_backend_kind(SimulatedKind)
    register_stage(Audit)
    yield
    for registry, before in zip(registries, saved, strict=True):
        registry.clear()
        registry.update(before)  # type: ignore[attr-defined]


def worker(worker_id: str, role: str) -> WorkerEndpoint:
    return WorkerEndpoint(worker_id, f"sim:{role}", backend="simulated")


@pytest.mark.usefixtures("registered")
async def test_a_request_runs_through_a_new_kind_policy_and_stage() -> None:
    config = RouterConfig(
        (
            PoolConfig(
                "prefill", (worker("p-b", "prefill"), worker("p-a", "prefill")), policy="lowest_id"
            ),
            PoolConfig("audit", (worker("audit-0", "prefill"),)),
            PoolConfig("decode", (worker("d-0", "decode"),)),
        )
    )
    async with open_router(config) as router:
        await router.wait_ready()
        for index in range(3):
            request = GenerationRequest(
                Prompt(text=f"question {index}"),
                sampling=SamplingParams(max_tokens=4),
                request_id=f"r{index}",
            )
            async with router.generate(request) as events:
                last = [event async for event in events][-1]
            assert isinstance(last, DoneEvent)
        served = {member.worker_id: member.served for member in router.pools["prefill"].members}
    assert sorted(SimulatedKind.built) == ["audit-0", "d-0", "p-a", "p-b"]
    assert served == {"p-a": 3, "p-b": 0}
    assert Audit.seen[-3:] == ["r0", "r1", "r2"]


@pytest.mark.usefixtures("registered")
def test_the_configuration_checks_a_new_kind_s_addresses() -> None:
    with pytest.raises(ConfigError, match=r"pools\.decode\.workers\[0\]\.address"):
        RouterConfig((PoolConfig("decode", (worker("d-0", "painter"),)),))


def test_an_unregistered_kind_is_refused_naming_the_registered_ones() -> None:
    bad = WorkerEndpoint("d-0", "sim:decode", backend="simulated")
    with pytest.raises(ConfigError, match=r"unknown backend 'simulated' \(choose from native"):
        RouterConfig((PoolConfig("decode", (bad,)),))


def test_a_pool_without_a_policy_gets_its_stage_actor_s_default() -> None:
    from epd_actors.core.actors import stage_policy

    assert stage_policy("encode", None) == "consistent_hash"
    assert stage_policy("pd", None) == "cache_aware"
    assert stage_policy("prefill", None) == "cache_aware"
    assert stage_policy("decode", None) == "least_in_flight"
    assert stage_policy("encode", "round_robin") == "round_robin"
    assert stage_policy("a-stage-nobody-serves", None) == "least_in_flight"
