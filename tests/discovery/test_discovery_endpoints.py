"""Discovery without I/O: EndpointSlices to workers, plans to router operations, the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from epd_actors.discovery import (
    DISCOVERY_KINDS,
    DiscoveryKind,
    KubernetesSettings,
    discovery_kind,
    register_discovery_kind,
)
from epd_actors.discovery.endpoints import (
    DiscoveredWorker,
    EndpointState,
    SliceSet,
    check_address_format,
    workers_of_slice,
)
from epd_actors.discovery.reconcile import Action, Reconciler
from epd_actors.errors import ConfigError
from epd_actors.program.config_file import parse_config
from tests.k8s_fake import endpoint, endpoint_slice

if TYPE_CHECKING:
    from epd_actors.core.config import WorkerEndpoint

FORMAT = "http://{host}:{port}"


def one(obj: dict[str, Any], **kw: Any) -> list[DiscoveredWorker]:
    return workers_of_slice(obj, port_name=kw.get("port", "http"), address_format=FORMAT)


def test_conditions_give_the_state() -> None:
    cases = [
        (endpoint("p", "10.0.0.1"), EndpointState.READY),
        (endpoint("p", "10.0.0.1", ready=False), EndpointState.NOT_READY),
        (
            endpoint("p", "10.0.0.1", ready=False, serving=True, terminating=True),
            EndpointState.TERMINATING,
        ),
        (
            endpoint("p", "10.0.0.1", ready=False, serving=False, terminating=True),
            EndpointState.TERMINATING,
        ),
        # Absent conditions: ready unknown means ready, terminating means false.
        ({"addresses": ["10.0.0.1"], "targetRef": {"name": "p"}}, EndpointState.READY),
    ]
    for entry, state in cases:
        (worker,) = one(endpoint_slice("s", [entry], labels={}))
        assert worker.state is state
        assert worker.worker_id == "p@10.0.0.1:8000"
        assert worker.address == "http://10.0.0.1:8000"


def test_ids_addresses_and_what_a_slice_without_the_port_names() -> None:
    ipv6 = endpoint_slice("s", [endpoint("p", "fd00::5")], labels={}, port=9000)
    (worker,) = one(ipv6)
    assert worker.worker_id == "p@[fd00::5]:9000"
    assert worker.address == "http://[fd00::5]:9000"
    assert worker.uid == "uid-p"
    # No targetRef: the hostname, else the slice's name.
    bare = endpoint_slice(
        "slice-x",
        [{"addresses": ["10.0.0.2"], "hostname": "h"}, {"addresses": ["10.0.0.3"]}],
        labels={},
    )
    assert [w.worker_id for w in one(bare)] == ["h@10.0.0.2:8000", "slice-x@10.0.0.3:8000"]
    assert one(endpoint_slice("s", [endpoint("p", "10.0.0.1")], labels={}, port_name="grpc")) == []
    # An unnamed port is matched by "".
    unnamed = endpoint_slice("s", [endpoint("p", "10.0.0.1")], labels={}, port_name="")
    assert len(one(unnamed, port="")) == 1
    # Shapes a slice should never have are skipped, not raised.
    odd = endpoint_slice("s", [None, {"addresses": []}, {"addresses": [7]}], labels={})  # type: ignore[list-item]
    assert one(odd) == []
    assert one({"metadata": {"name": "s"}, "endpoints": None, "ports": None}) == []
    assert one(endpoint_slice("s", [], labels={}) | {"ports": [{"name": "http", "port": 0}]}) == []


def test_a_slice_set_follows_events_and_merges_duplicates() -> None:
    slices = SliceSet(port_name="http", address_format=FORMAT)
    a = endpoint_slice("a", [endpoint("p", "10.0.0.1", ready=False)], labels={})
    b = endpoint_slice("b", [endpoint("p", "10.0.0.1"), endpoint("q", "10.0.0.2")], labels={})
    assert slices.apply("ADDED", a)
    assert slices.workers()["p@10.0.0.1:8000"].state is EndpointState.NOT_READY
    assert slices.apply("ADDED", b)
    # In two slices at once (the controller moving it): its most eligible state.
    assert slices.workers()["p@10.0.0.1:8000"].state is EndpointState.READY
    assert not slices.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert slices.apply("DELETED", b)
    assert set(slices.workers()) == {"p@10.0.0.1:8000"}
    assert not slices.apply("DELETED", b)
    slices.replace_all([b])
    assert len(slices) == 1
    assert set(slices.workers()) == {"p@10.0.0.1:8000", "q@10.0.0.2:8000"}


def w(
    name: str, state: EndpointState = EndpointState.READY, *, uid: str = "u", ip: str = "10.0.0.1"
) -> DiscoveredWorker:
    return DiscoveredWorker(f"{name}@{ip}:8000", f"http://{ip}:8000", uid, state)


def ids(ops: list[Any]) -> list[tuple[Action, str]]:
    return [(op.action, op.worker.worker_id) for op in ops]


class Sink:
    def __init__(self, refuse: set[str] | None = None) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.refuse = refuse or set()

    async def add_worker(
        self, stage: str, endpoint: WorkerEndpoint, *, model: str | None = None
    ) -> None:
        if endpoint.worker_id in self.refuse:
            raise ConfigError(f"worker id {endpoint.worker_id!r} already exists")
        self.calls.append(("add", endpoint.worker_id, (stage, endpoint, model)))

    def drain_worker(self, worker_id: str) -> None:
        self.calls.append(("drain", worker_id, None))

    def resume_worker(self, worker_id: str) -> None:
        self.calls.append(("resume", worker_id, None))

    def remove_worker(self, worker_id: str) -> None:
        self.calls.append(("remove", worker_id, None))


async def test_the_reconciler_table() -> None:
    rec = Reconciler("decode", "m", "openai_http")
    sink = Sink()
    ready, down, going = EndpointState.READY, EndpointState.NOT_READY, EndpointState.TERMINATING
    # New: only ready ones are added.
    assert ids(rec.plan({"x": w("a"), "y": w("b", down), "z": w("c", going)})) == [
        (Action.ADD, "a@10.0.0.1:8000")
    ]
    assert await rec.apply(sink, {"a@10.0.0.1:8000": w("a")}) == 1
    stage, added, model = sink.calls[0][2]
    assert (stage, added.address, added.backend, model) == (
        "decode",
        "http://10.0.0.1:8000",
        "openai_http",
        "m",
    )
    aid = "a@10.0.0.1:8000"
    assert rec.plan({aid: w("a")}) == []
    assert ids(rec.plan({aid: w("a", down)})) == [(Action.DRAIN, aid)]
    assert ids(rec.plan({aid: w("a", going)})) == [(Action.DRAIN, aid)]
    await rec.apply(sink, {aid: w("a", down)})
    assert rec.workers == {aid: False}
    assert rec.plan({aid: w("a", going)}) == []
    assert ids(rec.plan({aid: w("a", ready)})) == [(Action.RESUME, aid)]
    # Another pod under the same id: the old goes, the new comes when ready.
    assert ids(rec.plan({aid: w("a", uid="v2")})) == [(Action.REMOVE, aid), (Action.ADD, aid)]
    assert ids(rec.plan({aid: w("a", down, uid="v2")})) == [(Action.REMOVE, aid)]
    assert ids(rec.plan({})) == [(Action.REMOVE, aid)]
    await rec.apply(sink, {})
    assert rec.workers == {}
    assert [c[0] for c in sink.calls] == ["add", "drain", "remove"]


async def test_a_refused_operation_is_logged_skipped_and_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Reconciler("decode", None, "native")
    sink = Sink(refuse={"a@10.0.0.1:8000"})
    wanted = {"a@10.0.0.1:8000": w("a"), "b@10.0.0.2:8000": w("b", ip="10.0.0.2")}
    assert await rec.apply(sink, wanted) == 1
    assert rec.workers == {"b@10.0.0.2:8000": True}
    assert "cannot add worker a@10.0.0.1:8000" in caplog.text
    sink.refuse.clear()
    assert await rec.apply(sink, wanted) == 1
    assert set(rec.workers) == set(wanted)


async def test_an_operator_drain_is_not_undone_by_discovery() -> None:
    rec = Reconciler("decode", None, "native")
    sink = Sink()
    aid = "a@10.0.0.1:8000"
    await rec.apply(sink, {aid: w("a")})
    sink.drain_worker(aid)  # the admin API, not the reconciler
    await rec.apply(sink, {aid: w("a")})
    assert [c[0] for c in sink.calls] == ["add", "drain"]


def test_the_registry_of_kinds() -> None:
    assert discovery_kind("kubernetes") is DISCOVERY_KINDS["kubernetes"]
    with pytest.raises(
        ConfigError, match=r"discovery.kind: unknown discovery kind 'redis' \(known: kubernetes\)"
    ):
        discovery_kind("redis")

    class Impostor(DiscoveryKind):
        name = "kubernetes"

        def parse(self, table: Any, router: Any) -> Any:
            raise AssertionError

        def open(self, settings: Any, registry: Any) -> Any:
            raise AssertionError

    with pytest.raises(ConfigError, match="already registered"):
        register_discovery_kind(Impostor)
    assert register_discovery_kind(type(DISCOVERY_KINDS["kubernetes"])) is type(
        DISCOVERY_KINDS["kubernetes"]
    )


BASE: dict[str, Any] = {"model": "m", "pools": {"prefill": {}, "decode": {}}}


def parse(discovery: dict[str, Any], **top: Any) -> Any:
    return parse_config({**BASE, **top, "discovery": discovery}, environ={}).discovery


def test_the_discovery_table() -> None:
    assert parse_config(dict(BASE), environ={}).discovery is None
    found = parse(
        {
            "kind": "kubernetes",
            "namespace": "epd",
            "backend": "native",
            "address_format": "tcp://{host}:{port}",
            "port": "native",
            "backoff_max_s": 10,
            "pools": [
                {"stage": "prefill"},
                {"stage": "decode", "selector": {"app": "d", "tier": "x"}, "port": "other"},
            ],
        }
    )
    assert isinstance(found, KubernetesSettings)
    assert found.namespace == "epd"
    assert found.backoff_max_s == 10
    prefill, decode = found.pools
    assert prefill.selector_text == "epd-actors.io/role=prefill"
    assert (prefill.backend, prefill.port, prefill.address_format) == (
        "native",
        "native",
        "tcp://{host}:{port}",
    )
    assert decode.selector_text == "app=d,tier=x"
    assert decode.port == "other"
    assert "pool decode: EndpointSlices app=d,tier=x" in "\n".join(found.describe())


@pytest.mark.parametrize(
    ("discovery", "message"),
    [
        ({"pools": [{"stage": "decode"}]}, "unknown key.*discovery.pools"),
        ({"kind": "nope"}, "discovery.kind: unknown discovery kind 'nope'"),
        ({"kind": "kubernetes"}, "discovery.pools: name at least one pool"),
        ({"kind": "kubernetes", "pools": [{}]}, r"discovery.pools\[0\].stage: required"),
        (
            {"kind": "kubernetes", "pools": [{"stage": "encode"}]},
            r"no \[pools.encode\] of model 'm'",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "model": "other"}]},
            "of model 'other'",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode"}, {"stage": "decode"}]},
            "given twice",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "selector": {}}]},
            "at least one label",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "selector": {"a": "b,c"}}]},
            "label value",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "selector": {"a": 1}}]},
            "label value",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "colour": "red"}]},
            r"pools\[0\].colour",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "backend": "carrier-pigeon"}]},
            "backend",
        ),
        (
            {
                "kind": "kubernetes",
                "pools": [{"stage": "decode"}],
                "address_format": "http://{host}",
            },
            "{port}",
        ),
        (
            {
                "kind": "kubernetes",
                "pools": [{"stage": "decode"}],
                "address_format": "{host}:{port}/{x}",
            },
            "only",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode", "backend": "native"}]},
            "address",  # native wants tcp://, the default format is http://
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode"}], "backoff_start_s": 0},
            "backoff_start_s",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode"}], "watch_timeout_s": 0.5},
            "watch_timeout_s",
        ),
        (
            {"kind": "kubernetes", "pools": [{"stage": "decode"}], "namespace": 3},
            "discovery.namespace",
        ),
        ({"kind": "kubernetes", "pools": [{"stage": "decode"}], "speed": 3}, "discovery.speed"),
    ],
)
def test_bad_discovery_tables_name_the_key(discovery: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(discovery)


def test_check_address_format() -> None:
    assert check_address_format("tcp://{host}:{port}", key="k") == "tcp://{host}:{port}"
    with pytest.raises(ConfigError, match="k: "):
        check_address_format("{host}:{port", key="k")


async def test_a_router_resumes_a_drained_worker() -> None:
    from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
    from epd_actors.request import DoneEvent, ErrorEvent
    from epd_actors.testing import build_sim_fleet

    fleet = build_sim_fleet({"prefill": 1, "decode": 1})
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        router.drain_worker("decode-0")
        async with router.generate(
            GenerationRequest(Prompt(text="a"), sampling=SamplingParams(max_tokens=3))
        ) as events:
            assert isinstance([e async for e in events][-1], ErrorEvent)
        router.resume_worker("decode-0")
        async with router.generate(
            GenerationRequest(Prompt(text="b"), sampling=SamplingParams(max_tokens=3))
        ) as events:
            assert isinstance([e async for e in events][-1], DoneEvent)
        with pytest.raises(ConfigError, match="unknown worker 'nobody'"):
            router.resume_worker("nobody")
