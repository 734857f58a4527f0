"""Several models and LoRA adapters behind one router.

Native simulated workers of two models (over memory streams, speaking the real
protocol) and the simulator's vLLM HTTP double for run-time LoRA loading.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import pytest
import trio
import trio.testing
from trio_websocket import open_websocket_url

from epd_actors.core.config import ModelConfig, PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.models import ModelCatalog
from epd_actors.core.router import open_router
from epd_actors.errors import AdapterLoadFailed, ConfigError, ModelNotFound, RemoteWorkerError
from epd_actors.frontends.http_app import RouterHttpApp
from epd_actors.frontends.ws import WsSettings, serve_ws
from epd_actors.lora import AdapterLoads, LoraAdapter
from epd_actors.program.config_file import parse_config
from epd_actors.protocol import GenerateRequest, Prompt, Role, SamplingParams
from epd_actors.request import DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.lora import LoraRefused, SimLoraAdapters
from epd_actors.simulator.openai_server import SimOpenAIServer, serve_openai
from epd_actors.simulator.store import create_sim_stores
from tests.frontends.test_http_frontend import connected
from tests.memory_fleet import TOKEN, MemoryFleet, worker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.core.pool import WorkerPool
    from epd_actors.core.router import Router
    from epd_actors.request import GenerationEvent

GUARD_S = 30
ALPHA, BETA = "alpha", "beta"
SIM = SimConfig(prefill_token_s=0.0, first_token_s=0.0, output_token_s=0.0)


def sim_worker(worker_id: str, model: str, adapters: tuple[str, ...] = ()) -> SimEngine:
    stores = create_sim_stores()
    return SimEngine(
        Role.PD,
        worker_id=worker_id,
        config=SIM,
        ec_store=stores.ec,
        kv_store=stores.kv,
        model=model,
        lora_adapters=adapters,
    )


def endpoints(*worker_ids: str) -> tuple[WorkerEndpoint, ...]:
    return tuple(WorkerEndpoint(w, f"tcp://{w}.invalid:7000") for w in worker_ids)


@asynccontextmanager
async def two_models(
    engines: dict[str, SimEngine], pools: tuple[PoolConfig, ...]
) -> AsyncIterator[Router]:
    """A router over native sim workers (``engines``), its default model ``ALPHA``."""
    async with trio.open_nursery() as nursery:
        servers = {wid: worker(engine, wid) for wid, engine in engines.items()}  # type: ignore[arg-type]
        fleet = MemoryFleet(nursery, servers)
        config = RouterConfig(pools, auth_token=TOKEN, model=ALPHA)
        async with open_router(config, backend_factory=fleet.backend) as router:
            await router.wait_ready()
            yield router
        nursery.cancel_scope.cancel(reason="test over")


def alpha_and_beta() -> tuple[dict[str, SimEngine], tuple[PoolConfig, ...]]:
    engines = {
        "alpha-0": sim_worker("alpha-0", ALPHA),
        "alpha-1": sim_worker("alpha-1", ALPHA),
        "beta-0": sim_worker("beta-0", BETA),
    }
    pools = (
        PoolConfig("pd", endpoints("alpha-0", "alpha-1"), policy="round_robin"),
        PoolConfig("pd", endpoints("beta-0"), policy="round_robin", model=BETA),
    )
    return engines, pools


def request(n: int, model: str | None) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"q{n}"), sampling=SamplingParams(max_tokens=2), request_id=f"r{n}", model=model
    )


async def final(router: Router, req: GenerationRequest) -> GenerationEvent:
    async with router.generate(req) as events:
        return [event async for event in events][-1]


async def test_requests_land_only_on_the_workers_of_their_model() -> None:
    engines, pools = alpha_and_beta()
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            landed: dict[str | None, set[str]] = {ALPHA: set(), BETA: set(), None: set()}
            for n, model in enumerate([ALPHA, BETA, None, ALPHA, BETA, None]):
                done = await final(router, request(n, model))
                assert isinstance(done, DoneEvent), done
                landed[model].update(done.timings.workers["pd"])
    assert landed[BETA] == {"beta-0"}
    assert landed[ALPHA] | landed[None] == {"alpha-0", "alpha-1"}
    assert engines["beta-0"].statistics().generate_requests == 2
    alpha_calls = sum(engines[w].statistics().generate_requests for w in ("alpha-0", "alpha-1"))
    assert alpha_calls == 4
    assert set(router.pools) == {"pd", "pd@beta"}


async def test_an_unknown_model_ends_the_request_with_model_not_found() -> None:
    engines, pools = alpha_and_beta()
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            refused = await final(router, request(1, "gamma"))
    assert isinstance(refused, ErrorEvent)
    assert isinstance(refused.error, ModelNotFound)
    assert str(refused.error) == "the model 'gamma' does not exist"
    assert sum(e.statistics().generate_requests for e in engines.values()) == 0


async def test_v1_models_lists_every_model_and_an_unknown_one_is_404_over_http() -> None:
    engines, pools = alpha_and_beta()
    engines["beta-0"] = sim_worker("beta-0", BETA, adapters=("beta-sql",))
    body = {"prompt": "hi", "max_tokens": 2}
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router, connected(RouterHttpApp(router)) as c:
            listed = (await c.request("GET", "/v1/models")).json()
            beta = await c.request("POST", "/v1/completions", json_body={**body, "model": BETA})
            unknown = await c.request("POST", "/v1/completions", json_body={**body, "model": "x"})
    cards = listed["data"]
    assert isinstance(cards, list)
    assert [(card["id"], card.get("parent")) for card in cards] == [
        (ALPHA, None),
        (BETA, None),
        ("beta-sql", BETA),
    ]
    assert beta.status == 200
    assert beta.json()["model"] == BETA
    assert engines["beta-0"].statistics().generate_requests == 1
    assert unknown.status == 404
    assert unknown.error() == {
        "message": "the model 'x' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


async def ws_exchange(router: Router, *messages: dict[str, object]) -> list[dict[str, object]]:
    """Send ``messages`` over one WebSocket connection; each one's terminal message."""
    terminal: list[dict[str, object]] = []
    async with trio.open_nursery() as nursery:
        start = partial(serve_ws, router, "127.0.0.1", 0, settings=WsSettings())
        server = await nursery.start(start)
        async with open_websocket_url(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
            for message in messages:
                await ws.send_message(json.dumps(message))
                while True:
                    reply = json.loads(await ws.get_message())
                    if reply["type"] in ("done", "error"):
                        terminal.append(reply)
                        break
        nursery.cancel_scope.cancel(reason="test over")
    return terminal


def ws_generate(client_id: str, model: str) -> dict[str, object]:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    return {"type": "generate", "id": client_id, "kind": "completion", "request": body}


async def test_the_websocket_routes_by_model_and_refuses_an_unknown_one_as_http_does() -> None:
    engines, pools = alpha_and_beta()
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            beta, unknown = await ws_exchange(
                router, ws_generate("b", BETA), ws_generate("u", "gamma")
            )
    assert beta["type"] == "done"
    assert engines["beta-0"].statistics().generate_requests == 1
    assert unknown == {
        "type": "error",
        "id": "u",
        "error": {
            "message": "the model 'gamma' does not exist",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        },
    }


async def test_an_adapter_request_lands_on_the_worker_that_has_it() -> None:
    engines = {
        "alpha-0": sim_worker("alpha-0", ALPHA),
        "alpha-1": sim_worker("alpha-1", ALPHA, adapters=("sql",)),
        "alpha-2": sim_worker("alpha-2", ALPHA),
    }
    pools = (PoolConfig("pd", endpoints(*engines), policy="round_robin"),)
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            landed = set()
            for n in range(4):
                done = await final(router, request(n, "sql"))
                assert isinstance(done, DoneEvent), done
                landed.update(done.timings.workers["pd"])
            names = [card.id for card in router.model_cards()]
    assert landed == {"alpha-1"}
    assert engines["alpha-1"].statistics().generate_requests == 4
    assert names == [ALPHA, "sql"]


async def test_a_native_worker_refuses_an_adapter_it_does_not_serve() -> None:
    engines = {"alpha-0": sim_worker("alpha-0", ALPHA, adapters=("sql",))}
    pools = (PoolConfig("pd", endpoints("alpha-0")),)
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            backend = router.backends["alpha-0"]
            generate = GenerateRequest("w1", Prompt(text="hi"), lora_adapter="chat")
            with pytest.raises(RemoteWorkerError) as refused:
                async with backend.open_stream(generate) as stream:
                    await stream.receive()
    assert refused.value.code == "invalid_request"
    assert refused.value.param == "model"
    assert "does not serve the LoRA adapter 'chat'" in refused.value.detail


# ---------------------------------------------------------------- run-time loading


@asynccontextmanager
async def http_double_router(
    *, lora: SimLoraAdapters | None = None, lora_loading: bool = True
) -> AsyncIterator[tuple[Router, SimOpenAIServer]]:
    """A router over one simulated vLLM PD server of ``ALPHA``, adapter ``sql`` loadable."""
    engine = sim_worker("http-0", ALPHA)
    server = SimOpenAIServer(engine, worker_id="http-0")
    if lora is not None:
        server.lora = lora
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(serve_openai, server, listeners)
        pool = PoolConfig(
            "pd",
            (WorkerEndpoint("http-0", server.url, "openai_http"),),
            lora_loading=lora_loading,
        )
        adapter = LoraAdapter("sql", "/loras/sql")
        config = RouterConfig((pool,), model=ALPHA, models=(ModelConfig(ALPHA, (adapter,)),))
        async with open_router(config) as router:
            await router.wait_ready()
            yield router, server
        nursery.cancel_scope.cancel(reason="test over")


async def test_an_adapter_is_loaded_once_on_the_vllm_worker_before_its_requests() -> None:
    outcomes: list[GenerationEvent] = []

    async def one(router: Router, n: int) -> None:
        outcomes.append(await final(router, request(n, "sql")))

    with trio.fail_after(GUARD_S):
        async with http_double_router() as (router, server):
            async with trio.open_nursery() as nursery:
                for n in range(3):
                    nursery.start_soon(one, router, n)
            log = server.log.snapshot()
            status = router.backends["http-0"].status()
    assert all(isinstance(outcome, DoneEvent) for outcome in outcomes), outcomes
    assert server.lora.loads == ["sql"]
    paths = [entry["path"] for entry in log]
    assert paths == ["/v1/load_lora_adapter"] + ["/v1/completions"] * 3
    assert [entry["model"] for entry in log[1:]] == ["sql"] * 3
    assert "sql" in status.adapters


class RefusingLoads(SimLoraAdapters):
    """A server whose every run-time load fails, as vLLM's does for a bad path."""

    def load(self, body: object, base_model: str) -> str:
        self.loads.append("refused")
        raise LoraRefused(400, "Loading lora sql failed: No adapter found for /loras/sql")


async def test_a_failed_load_fails_the_request_with_adapter_load_failed() -> None:
    with trio.fail_after(GUARD_S):
        async with http_double_router(lora=RefusingLoads(())) as (router, server):
            failed = await final(router, request(1, "sql"))
            log = server.log.snapshot()
    assert isinstance(failed, ErrorEvent)
    assert isinstance(failed.error, AdapterLoadFailed)
    assert "No adapter found for /loras/sql" in str(failed.error)
    assert not [entry for entry in log if entry["path"] == "/v1/completions"]


async def test_without_run_time_loading_the_adapter_name_goes_to_the_worker() -> None:
    with trio.fail_after(GUARD_S):
        async with http_double_router(lora_loading=False) as (router, server):
            refused = await final(router, request(1, "sql"))
    assert server.lora.loads == []
    assert isinstance(refused, ErrorEvent)
    assert isinstance(refused.error, RemoteWorkerError)
    assert "The model `sql` does not exist" in str(refused.error)


async def test_concurrent_requests_wait_for_one_load_and_share_its_failure() -> None:
    loads = AdapterLoads()
    gate = trio.Event()
    calls = 0
    failures: list[AdapterLoadFailed] = []

    async def load() -> None:
        nonlocal calls
        calls += 1
        await gate.wait()
        raise AdapterLoadFailed("refused", adapter="sql", worker_id="w")

    async def ensure() -> None:
        try:
            await loads.ensure("sql", load)
        except AdapterLoadFailed as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ensure)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert calls == 1
    assert len(failures) == 3
    assert len({id(exc) for exc in failures}) == 3  # each waiter raises its own error
    gate = trio.Event()
    gate.set()
    with pytest.raises(AdapterLoadFailed):
        await loads.ensure("sql", load)
    assert calls == 2  # a failed load is tried again by the next request


# ---------------------------------------------------------------- configuration


def test_a_configuration_with_two_models_and_adapters() -> None:
    config = parse_config(
        {
            "model": ALPHA,
            "pools": {
                "pd": [
                    {"workers": [{"id": "a", "address": "tcp://127.0.0.1:7001"}]},
                    {
                        "model": BETA,
                        "lora_loading": True,
                        "workers": [
                            {
                                "id": "b",
                                "address": "http://127.0.0.1:8001",
                                "backend": "openai_http",
                            }
                        ],
                        "policy": "round_robin",
                    },
                ]
            },
            "models": [{"name": BETA, "lora_adapters": [{"name": "sql", "path": "/l/sql"}]}],
            "openai_http": {"lora_load_timeout_s": 5},
        }
    ).router
    assert [(config.pool_name(p), p.lora_loading) for p in config.pools] == [
        ("pd", False),
        ("pd@beta", True),
    ]
    assert config.lora_adapters(BETA) == (LoraAdapter("sql", "/l/sql"),)
    assert config.openai_http.lora_load_timeout_s == 5


@pytest.mark.parametrize(
    ("models", "pools", "message"),
    [
        pytest.param(
            (),
            (PoolConfig("pd", model=BETA), PoolConfig("pd", model=BETA)),
            "pools.pd: configured twice for model 'beta'",
            id="same-stage-twice-for-a-model",
        ),
        pytest.param(
            (ModelConfig("gamma"),),
            (PoolConfig("pd"),),
            "models[0].name: no pool serves model 'gamma'",
            id="adapters-of-an-unserved-model",
        ),
        pytest.param(
            (ModelConfig(ALPHA, (LoraAdapter(BETA),)),),
            (PoolConfig("pd"), PoolConfig("pd", model=BETA)),
            "models[0].lora_adapters[0].name: 'beta' is a model's name",
            id="adapter-named-like-a-model",
        ),
    ],
)
def test_bad_model_configurations_name_the_key(
    models: tuple[ModelConfig, ...], pools: tuple[PoolConfig, ...], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        RouterConfig(pools, model=ALPHA, models=models)
    assert str(refused.value) == message


@dataclass
class _Status:
    adapters: frozenset[str]


@dataclass
class _Backend:
    adapters: frozenset[str]

    def status(self) -> _Status:
        return _Status(self.adapters)


@dataclass
class _Member:
    backend: _Backend


@dataclass
class _Pool:
    model: str | None
    members: list[_Member]


@pytest.mark.parametrize("name", [ALPHA, BETA, "sql", "chat-lora", "hidden", "gamma", ""])
def test_the_per_request_model_check_agrees_with_the_model_cards(name: str) -> None:
    """``serves`` (asked per request) answers as the ``/v1/models`` list reads: served models,
    configured adapters, adapters announced by workers of a named model, nothing else."""
    pools = [
        _Pool(ALPHA, [_Member(_Backend(frozenset())), _Member(_Backend(frozenset({"sql"})))]),
        _Pool(BETA, [_Member(_Backend(frozenset()))]),
        _Pool(None, [_Member(_Backend(frozenset({"hidden"})))]),
    ]
    catalog = ModelCatalog(
        cast("list[WorkerPool]", pools), default_model=ALPHA, adapters={"chat-lora": ALPHA}
    )
    listed = [card.id for card in catalog.cards()]
    assert listed == [ALPHA, BETA, "chat-lora", "sql"]
    assert catalog.serves(name) == (name in listed)
