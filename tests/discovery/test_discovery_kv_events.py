"""Discovered workers may say where their engines publish KV events: Redis records, slices."""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import TYPE_CHECKING, Any

import pytest
import trio

from epd_actors import open_router
from epd_actors.core.config import PoolConfig, RouterConfig
from epd_actors.core.kv_settings import KVEventsSettings
from epd_actors.discovery import KubernetesPool, KubernetesSettings
from epd_actors.discovery.endpoints import DiscoveredWorker, EndpointState, SliceSet
from epd_actors.discovery.kubernetes_settings import ROLE_LABEL
from epd_actors.discovery.reconcile import Reconciler
from epd_actors.discovery.registrations import Registration, RegistrationError
from epd_actors.errors import ConfigError
from epd_actors.program.worker_registration import (
    Registrar,
    add_registration_arguments,
    registration_from_args,
)
from epd_actors.simulator.kv_memory import MemoryKVEventPublisher
from tests.discovery.test_discovery_endpoints import parse
from tests.discovery.test_discovery_redis import record
from tests.frontends.test_admin_kv_events import kv_router
from tests.k8s_fake import FakeApiServer, endpoint, endpoint_slice

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from epd_actors.core.kv_feeds import KVSourceSpec

PUB, REPLAY = "tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558"


# -- Redis registrations


def test_a_record_carries_its_kv_endpoints_and_reads_back() -> None:
    written = record(kv_events_endpoint=PUB, kv_events_replay_endpoint=REPLAY)
    text = written.to_json()
    assert json.loads(text)["kv_events_endpoint"] == PUB
    read = Registration.from_json(text)
    assert read == written
    worker = read.as_discovered()
    assert (worker.kv_events_endpoint, worker.kv_events_replay_endpoint) == (PUB, REPLAY)


def test_a_record_without_them_has_none_and_writes_none() -> None:
    written = record()
    assert "kv_events_endpoint" not in json.loads(written.to_json())
    worker = Registration.from_json(written.to_json()).as_discovered()
    assert (worker.kv_events_endpoint, worker.kv_events_replay_endpoint) == (None, None)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"kv_events_endpoint": "10.0.0.9:5557"}, "field 'kv_events_endpoint': .* not a ZMQ"),
        ({"kv_events_endpoint": 5557}, "'kv_events_endpoint' is not a string"),
        (
            {"kv_events_endpoint": PUB, "kv_events_replay_endpoint": "tcp://h:0"},
            "field 'kv_events_replay_endpoint'",
        ),
        ({"kv_events_replay_endpoint": REPLAY}, "needs kv_events_endpoint"),
    ],
)
def test_a_record_with_a_bad_kv_endpoint_is_refused(fields: dict[str, Any], problem: str) -> None:
    text = json.dumps({**json.loads(record().to_json()), **fields})
    with pytest.raises(RegistrationError, match=problem):
        Registration.from_json(text)


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_registration_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_worker_registers_the_kv_endpoints_it_is_given() -> None:
    args = worker_args(
        "--register",
        "redis://127.0.0.1:1/0",
        "--register-kv-events-endpoint",
        PUB,
        "--register-kv-events-replay-endpoint",
        REPLAY,
    )
    settings = registration_from_args(args, role="prefill", model="m")
    assert settings is not None
    registrar = Registrar(settings, "p0", "tcp://10.0.0.9:9000")
    assert registrar.record.kv_events_endpoint == PUB
    assert registrar.record.kv_events_replay_endpoint == REPLAY


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--register-kv-events-endpoint", PUB), "--register-kv-events-endpoint needs --register"),
        (
            ("--register", "redis://h:1/0", "--register-kv-events-endpoint", "h:1"),
            "--register-kv-events-endpoint: 'h:1' is not a ZMQ endpoint",
        ),
        (
            ("--register", "redis://h:1/0", "--register-kv-events-replay-endpoint", REPLAY),
            "needs --register-kv-events-endpoint",
        ),
    ],
)
def test_bad_worker_kv_registration_options(argv: tuple[str, ...], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        registration_from_args(worker_args(*argv), role="prefill", model="m")


# -- Kubernetes: named ports of the slices


def kv_slice(*ports: tuple[str, int], pod: str = "p0") -> dict[str, Any]:
    obj = endpoint_slice("s", [endpoint(pod, "10.0.0.9")], labels={})
    obj["ports"] += [{"name": name, "port": port, "protocol": "TCP"} for name, port in ports]
    return obj


def test_named_slice_ports_give_each_worker_its_kv_endpoints() -> None:
    slices = SliceSet(
        port_name="http", address_format="http://{host}:{port}", kv_ports=("kv", "kv-replay")
    )
    slices.replace_all([kv_slice(("kv", 5557), ("kv-replay", 5558))])
    (worker,) = slices.workers().values()
    assert (worker.kv_events_endpoint, worker.kv_events_replay_endpoint) == (PUB, REPLAY)
    slices.replace_all([kv_slice(("kv-replay", 5558))])  # no publisher port: nothing
    (worker,) = slices.workers().values()
    assert (worker.kv_events_endpoint, worker.kv_events_replay_endpoint) == (None, None)
    unnamed = SliceSet(port_name="http", address_format="http://{host}:{port}")
    unnamed.replace_all([kv_slice(("kv", 5557))])
    (worker,) = unnamed.workers().values()
    assert worker.kv_events_endpoint is None


def test_the_kubernetes_table_reads_the_kv_port_names() -> None:
    found = parse(
        {
            "kind": "kubernetes",
            "kv_events_port": "kv",
            "pools": [
                {"stage": "prefill", "kv_events_replay_port": "kv-replay"},
                {"stage": "decode", "kv_events_port": ""},
            ],
        }
    )
    assert isinstance(found, KubernetesSettings)
    prefill, decode = found.pools
    assert (prefill.kv_events_port, prefill.kv_events_replay_port) == ("kv", "kv-replay")
    assert (decode.kv_events_port, decode.kv_events_replay_port) == (None, None)
    described = "\n".join(found.describe())
    assert "KV events port kv, replay kv-replay" in described
    with pytest.raises(ConfigError, match=r"pools\[0\]\.kv_events_replay_port: needs kv_events"):
        parse({"kind": "kubernetes", "pools": [{"stage": "prefill", "kv_events_replay_port": "r"}]})


# -- a discovered worker's endpoints reach the router's feeds


async def test_a_discovered_worker_is_subscribed_on_the_endpoint_its_source_names() -> None:
    found = DiscoveredWorker(
        "prefill-1", "tcp://127.0.0.1:1", "uid-1", EndpointState.READY, PUB, REPLAY
    )
    with trio.fail_after(10):
        async with kv_router() as (router, specs, _changes):
            done = await Reconciler("prefill", None, "native").apply(
                router, {found.worker_id: found}
            )
            subscribed = set(router.kv_feeds.pools["prefill"].subscribers)
    assert done == 1
    assert [(s.worker_id, s.endpoint, s.replay_endpoint) for s in specs[1:]] == [
        ("prefill-1", PUB, REPLAY)
    ]
    assert subscribed == {"prefill-0", "prefill-1"}


async def test_kubernetes_discovery_subscribes_on_the_pods_kv_port(tmp_path: Path) -> None:
    from epd_actors.discovery.kubernetes import KubernetesDiscovery
    from tests.discovery.test_discovery_kubernetes import NS, SimBackends, kubeconfig, settings

    api = FakeApiServer()
    pod = kv_slice(("kv", 5557), ("kv-replay", 5558), pod="prefill-0")
    pod["metadata"]["labels"] = {ROLE_LABEL: "prefill"}
    api.put(NS, pod)
    specs: list[KVSourceSpec] = []

    @contextlib.contextmanager
    def factory(spec: KVSourceSpec) -> Iterator[MemoryKVEventPublisher]:
        specs.append(spec)
        yield MemoryKVEventPublisher()

    pool = PoolConfig("prefill", kv_events=KVEventsSettings(enabled=True))
    pools = (
        KubernetesPool(
            "prefill",
            None,
            {ROLE_LABEL: "prefill"},
            "native",
            "http",
            "tcp://{host}:{port}",
            "kv",
            "kv-replay",
        ),
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await api.start(nursery)
            async with open_router(
                RouterConfig((pool, PoolConfig("decode"))),
                backend_factory=SimBackends(),
                kv_source_factory=factory,
            ) as router:
                path = kubeconfig(tmp_path, api.url, api.token)
                discovery = KubernetesDiscovery(
                    settings(path, pools=pools), router.metrics.registry
                )
                await nursery.start(discovery.run, router)  # started: listed and applied
                subscribed = set(router.kv_feeds.pools["prefill"].subscribers)
                nursery.cancel_scope.cancel()
    assert [(s.worker_id, s.endpoint, s.replay_endpoint) for s in specs] == [
        ("prefill-0@10.0.0.9:8000", PUB, REPLAY)
    ]
    assert subscribed == {"prefill-0@10.0.0.9:8000"}
