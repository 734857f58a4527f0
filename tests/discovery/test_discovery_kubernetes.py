"""Kubernetes discovery end to end: the real lightkube client against a fake API server.

The fake (``tests/k8s_fake.py``) speaks the list/watch protocol on a loopback
port; the discovery reads a kubeconfig (token auth) or an in-cluster service
account (TLS) pointing at it, and changes a running router's pools of
simulated workers.  Waits are on events the router or the server reached,
under a hang guard, never on elapsed time.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("lightkube")

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.discovery import KubernetesPool, KubernetesSettings, open_discovery
from epd_actors.discovery.kubernetes import KubernetesDiscovery, load_kube_config
from epd_actors.discovery.kubernetes_kind import KubernetesKind
from epd_actors.discovery.kubernetes_settings import ROLE_LABEL
from epd_actors.errors import ConfigError, NoHealthyWorker
from epd_actors.protocol import Role
from epd_actors.request import DeltaEvent, DoneEvent, ErrorEvent
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import create_sim_stores
from epd_actors.testing import sim_config
from tests.faults.polling import wait_until
from tests.k8s_fake import FakeApiServer, endpoint, endpoint_slice

# When a watch stream breaks (the API server goes away mid-stream), the layered
# async generators of lightkube's watch and of httpx2/httpcore2 under it
# (``aiter_lines`` -> ``aiter_text`` -> ... -> ``PoolByteStream.__aiter__``)
# are left to Trio's finalizer, which says so with a ResourceWarning.  Nothing
# leaks: lightkube closes the response, and that closes the connection.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(httpx2|httpcore2)\.:ResourceWarning"
)

NS = "epd"
GUARD_S = 20  # a hang guard only; nothing waits for time to pass


def kubeconfig(tmp_path: Path, server: str, token: str) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "router", "user": {"token": token}}],
        "contexts": [
            {"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": NS}}
        ],
        "current-context": "fake",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def settings(path: str | None, **overrides: Any) -> KubernetesSettings:
    pools = tuple(
        KubernetesPool(stage, None, {ROLE_LABEL: stage}, "native", "http", "tcp://{host}:{port}")
        for stage in ("prefill", "decode")
    )
    values: dict[str, Any] = {
        "kind": "kubernetes",
        "pools": pools,
        "kubeconfig": path,
        "watch_timeout_s": 60.0,
        "request_timeout_s": 5.0,
        "backoff_start_s": 0.01,
        "backoff_max_s": 0.04,
    }
    values.update(overrides)
    return KubernetesSettings(**values)


class SimBackends:
    """A backend factory: an in-process simulated worker per discovered endpoint."""

    def __init__(self, **knobs: Any) -> None:
        self.stores = create_sim_stores()
        self.config = sim_config(**knobs)
        self.built: list[str] = []

    def __call__(self, endpoint: WorkerEndpoint, config: RouterConfig) -> InProcessBackend:
        stage = endpoint.worker_id.split("-", 1)[0]
        engine = SimEngine(
            Role(stage),
            worker_id=endpoint.worker_id,
            config=self.config,
            ec_store=self.stores.ec,
            kv_store=self.stores.kv,
        )
        self.built.append(endpoint.worker_id)
        return InProcessBackend(endpoint.worker_id, engine, stage=stage)


class Recorder:
    """A ``WorkerSink`` in front of the router that remembers each operation."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.ops: list[tuple[str, str]] = []
        self._event = trio.Event()

    def _note(self, op: str, worker_id: str) -> None:
        self.ops.append((op, worker_id))
        self._event.set()
        self._event = trio.Event()

    async def add_worker(
        self, stage: str, endpoint: WorkerEndpoint, *, model: str | None = None
    ) -> None:
        await self.router.add_worker(stage, endpoint, model=model)
        self._note("add", endpoint.worker_id)

    def drain_worker(self, worker_id: str) -> None:
        self.router.drain_worker(worker_id)
        self._note("drain", worker_id)

    def resume_worker(self, worker_id: str) -> None:
        self.router.resume_worker(worker_id)
        self._note("resume", worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self.router.remove_worker(worker_id)
        self._note("remove", worker_id)

    async def wait_for(self, *ops: tuple[str, str]) -> None:
        while not all(op in self.ops for op in ops):
            await self._event.wait()


def members(router: Any, pool: str) -> dict[str, bool]:
    """Worker id -> drained, of one pool."""
    return {m.worker_id: m.drained for m in router.pools[pool].members}


def request(n: int, max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=f"q{n}"), sampling=SamplingParams(max_tokens=max_tokens), request_id=f"k{n}"
    )


async def final_event(router: Any, n: int) -> Any:
    async with router.generate(request(n)) as events:
        return [e async for e in events][-1]


ROUTER = RouterConfig((PoolConfig("prefill"), PoolConfig("decode")))
P0 = "prefill-0@10.0.0.10:8000"
D0 = "decode-0@10.0.0.20:8000"
D1 = "decode-1@10.0.0.21:8000"


def prefill_slice() -> dict[str, Any]:
    return endpoint_slice(
        "prefill-abc", [endpoint("prefill-0", "10.0.0.10")], labels={ROLE_LABEL: "prefill"}
    )


def decode_slice(*endpoints: dict[str, Any], name: str = "decode-abc") -> dict[str, Any]:
    return endpoint_slice(name, list(endpoints), labels={ROLE_LABEL: "decode"})


class Harness:
    def __init__(self, tmp_path: Path, **server: Any) -> None:
        self.api = FakeApiServer(**server)
        self.tmp_path = tmp_path
        self.backends = SimBackends()

    async def start(
        self, nursery: trio.Nursery, **overrides: Any
    ) -> tuple[Any, Recorder, KubernetesDiscovery]:
        await self.api.start(nursery)
        router = await nursery.start(self._router)
        recorder = Recorder(router)
        path = kubeconfig(self.tmp_path, self.api.url, self.api.token)
        discovery = KubernetesDiscovery(settings(path, **overrides), router.metrics.registry)
        await nursery.start(discovery.run, recorder)
        return router, recorder, discovery

    async def _router(self, *, task_status: Any) -> None:
        async with open_router(ROUTER, backend_factory=self.backends) as router:
            task_status.started(router)
            await trio.sleep_forever()


async def test_listed_workers_are_added_with_the_token_and_the_selector(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    h.api.put(
        NS, decode_slice(endpoint("decode-0", "10.0.0.20"), endpoint("decode-1", "10.0.0.21"))
    )
    h.api.put("other", decode_slice(endpoint("decode-9", "10.9.9.9")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, _ = await h.start(nursery)
            # Started means listed and applied.
            assert members(router, "prefill") == {P0: False}
            assert members(router, "decode") == {D0: False, D1: False}
            lists = [r for r in h.api.requests if not r.watch]
            assert {r.path for r in lists} == {
                f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
            }
            assert {r.query["labelSelector"] for r in lists} == {
                f"{ROLE_LABEL}=prefill",
                f"{ROLE_LABEL}=decode",
            }
            assert {r.authorization for r in h.api.requests} == {"Bearer s3cret"}
            assert isinstance(await final_event(router, 1), DoneEvent)
            # A slice added while watching.
            h.api.put(NS, decode_slice(endpoint("decode-2", "10.0.0.22"), name="decode-def"))
            await recorder.wait_for(("add", "decode-2@10.0.0.22:8000"))
            assert len(members(router, "decode")) == 3
            nursery.cancel_scope.cancel()


async def test_not_ready_drains_and_ready_again_resumes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, _ = await h.start(nursery)
            h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20", ready=False)))
            await recorder.wait_for(("drain", D0))
            assert members(router, "decode") == {D0: True}
            final = await final_event(router, 1)
            assert isinstance(final, ErrorEvent)
            assert isinstance(final.error, NoHealthyWorker)

            h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
            await recorder.wait_for(("resume", D0))
            assert members(router, "decode") == {D0: False}
            assert isinstance(await final_event(router, 2), DoneEvent)
            # A worker first seen not ready is not added until it is ready.
            h.api.put(NS, decode_slice(endpoint("decode-1", "10.0.0.21", ready=False), name="d2"))
            h.api.put(NS, decode_slice(endpoint("decode-1", "10.0.0.21"), name="d2"))
            await recorder.wait_for(("add", D1))
            assert ("drain", D1) not in recorder.ops
            nursery.cancel_scope.cancel()


async def test_terminating_drains_open_streams_finish_and_delete_removes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.backends = SimBackends(output_token_s=0.002)
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, _ = await h.start(nursery)
            async with router.generate(request(1, max_tokens=30)) as events:
                first = await events.receive()
                assert isinstance(first, DeltaEvent)
                h.api.put(
                    NS,
                    decode_slice(
                        endpoint(
                            "decode-0", "10.0.0.20", ready=False, serving=True, terminating=True
                        )
                    ),
                )
                await recorder.wait_for(("drain", D0))
                # No new work for it ...
                refused = await final_event(router, 2)
                assert isinstance(refused, ErrorEvent)
                assert isinstance(refused.error, NoHealthyWorker)
                # ... while the open stream runs to its end.
                rest = [e async for e in events]
            assert isinstance(rest[-1], DoneEvent)
            assert rest[-1].usage.completion_tokens == 30

            h.api.delete(NS, "decode-abc")
            await recorder.wait_for(("remove", D0))
            assert members(router, "decode") == {}
            # An endpoint leaving a slice that stays is removed too.
            h.api.put(NS, prefill_slice() | {"endpoints": []})
            await recorder.wait_for(("remove", P0))
            nursery.cancel_scope.cancel()


async def test_a_restarted_pod_is_a_new_worker(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20", uid="first")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, _ = await h.start(nursery)
            old_backend = router.backends[D0]
            # Same name and address, new uid (a StatefulSet pod restarted in place).
            h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20", uid="second")))
            await recorder.wait_for(("remove", D0))
            await wait_until(lambda: recorder.ops.count(("add", D0)) == 2)
            assert router.backends[D0] is not old_backend
            # A new address is a new worker id as well.
            h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.99", uid="third")))
            await recorder.wait_for(("add", "decode-0@10.0.0.99:8000"))
            assert members(router, "decode") == {"decode-0@10.0.0.99:8000": False}
            assert h.backends.built.count(D0) == 2
            nursery.cancel_scope.cancel()


async def test_bookmarks_move_the_watch_version_on(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            _, _, discovery = await h.start(nursery)
            await h.api.wait_for_request(lambda r: r.watch and "decode" in r.query["labelSelector"])
            watches = [r for r in h.api.requests if r.watch]
            assert all(r.query["allowWatchBookmarks"] == "true" for r in watches)
            assert all("timeoutSeconds" in r.query for r in watches)
            await wait_until(lambda: len(h.api.watchers) == 2)
            version = h.api.bookmark()
            await wait_until(
                lambda: discovery.statistics()["decode"].resource_version == str(version)
            )
            h.api.end_watches()
            resumed = await h.api.wait_for_request(
                lambda r: r.watch and r.query.get("resourceVersion") == str(version)
            )
            assert resumed.query["allowWatchBookmarks"] == "true"
            stats = discovery.statistics()["decode"]
            assert (stats.lists, stats.errors) == (1, 0)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again_and_catches_up(tmp_path: Path, gone_as_http: bool) -> None:
    h = Harness(tmp_path, gone_as_http=gone_as_http)
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, discovery = await h.start(nursery)
            await wait_until(lambda: len(h.api.watchers) == 2)
            # Changes the watch never sees: the server goes away, the slices
            # change, and it comes back with that history compacted.
            h.api.go_away()
            h.api.delete(NS, "decode-abc")
            h.api.put(NS, decode_slice(endpoint("decode-1", "10.0.0.21"), name="decode-new"))
            h.api.compact()
            await h.api.come_back()
            await recorder.wait_for(("remove", D0), ("add", D1))
            assert members(router, "decode") == {D1: False}
            await wait_until(lambda: discovery.statistics()["decode"].lists == 2)
            await wait_until(lambda: discovery.statistics()["prefill"].lists == 2)
            assert members(router, "prefill") == {P0: False}
            metrics = router.metrics.render().decode()
            assert 'epd_discovery_relists_total{pool="decode"} 2.0' in metrics
            nursery.cancel_scope.cancel()


async def test_api_server_away_keeps_the_last_view_logs_once_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_actors.discovery")
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            router, recorder, discovery = await h.start(nursery)
            await wait_until(lambda: len(h.api.watchers) == 2)
            h.api.go_away()
            await wait_until(lambda: discovery.statistics()["decode"].errors >= 3)
            # The router keeps its workers and serves with them.
            assert members(router, "decode") == {D0: False}
            assert isinstance(await final_event(router, 1), DoneEvent)
            metrics = router.metrics.render().decode()
            assert 'epd_discovery_up{pool="decode"} 0.0' in metrics
            assert 'epd_discovery_errors_total{pool="decode"}' in metrics
            warnings = [
                r
                for r in caplog.records
                if r.levelno == logging.WARNING and "decode" in r.getMessage()
            ]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert "keeping the last view of 1 workers" in warnings[0].getMessage()

            h.api.put(
                NS,
                decode_slice(endpoint("decode-0", "10.0.0.20"), endpoint("decode-1", "10.0.0.21")),
            )
            await h.api.come_back()
            await recorder.wait_for(("add", D1))
            await wait_until(lambda: discovery.statistics()["decode"].up)
            assert 'epd_discovery_up{pool="decode"} 1.0' in router.metrics.render().decode()
            assert any("answers again" in r.getMessage() for r in caplog.records)
            assert ("remove", D0) not in recorder.ops
            nursery.cancel_scope.cancel()


async def test_a_router_starts_while_the_api_server_is_down(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await h.api.start(nursery)
            url = h.api.url
            h.api.go_away()
            router = await nursery.start(h._router)
            recorder = Recorder(router)
            path = kubeconfig(tmp_path, url, h.api.token)
            discovery = KubernetesDiscovery(settings(path), router.metrics.registry)
            await nursery.start(discovery.run, recorder)
            assert discovery.statistics()["decode"].errors >= 1
            h.api.put(NS, prefill_slice())
            h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
            await h.api.come_back()
            await recorder.wait_for(("add", D0), ("add", P0))
            assert isinstance(await final_event(router, 1), DoneEvent)
            nursery.cancel_scope.cancel()


async def test_a_wrong_token_is_an_error_that_is_retried(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.api.put(NS, prefill_slice())
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await h.api.start(nursery)
            router = await nursery.start(h._router)
            path = kubeconfig(tmp_path, h.api.url, "wrong")
            discovery = KubernetesDiscovery(settings(path), router.metrics.registry)
            await nursery.start(discovery.run, Recorder(router))
            await wait_until(lambda: discovery.statistics()["prefill"].errors >= 2)
            assert members(router, "prefill") == {}
            h.api.token = "wrong"
            await wait_until(lambda: members(router, "prefill") == {P0: False})
            nursery.cancel_scope.cancel()


async def test_in_cluster_service_account_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_context = __import__("ssl").create_default_context(__import__("ssl").Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    h = Harness(tmp_path, ssl_context=server_context, token="pod-token")
    h.api.put(NS, prefill_slice())
    h.api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text(NS)
    ca.cert_pem.write_to_path(str(account / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await h.api.start(nursery)
            monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(h.api.port))
            router = await nursery.start(h._router)
            recorder = Recorder(router)
            found = settings(None, service_account_dir=str(account))
            assert load_kube_config(found).namespace == NS
            discovery = KubernetesDiscovery(found, router.metrics.registry)
            await nursery.start(discovery.run, recorder)
            assert members(router, "decode") == {D0: False}
            assert {r.authorization for r in h.api.requests} == {"Bearer pod-token"}
            # The kubelet rotates the token: the next request gets 401, the
            # client reads the file again.
            (account / "token").write_text("rotated")
            h.api.token = "rotated"
            h.api.end_watches()
            h.api.put(NS, decode_slice(endpoint("decode-1", "10.0.0.21"), name="more"))
            await recorder.wait_for(("add", D1))
            assert h.api.requests[-1].authorization == "Bearer rotated"
            nursery.cancel_scope.cancel()


async def test_open_discovery_runs_next_to_a_router(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.put(NS, prefill_slice())
    api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await api.start(nursery)
            found = settings(kubeconfig(tmp_path, api.url, api.token))
            async with (
                open_router(ROUTER, backend_factory=SimBackends()) as router,
                open_discovery(router, found) as discovery,
            ):
                assert discovery is not None
                assert members(router, "decode") == {D0: False}
                assert isinstance(await final_event(router, 1), DoneEvent)
            nursery.cancel_scope.cancel()


def test_credentials_that_cannot_work_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no usable Kubernetes credentials"):
        load_kube_config(settings(None, service_account_dir=str(tmp_path / "none")))
    path = Path(kubeconfig(tmp_path, "http://127.0.0.1:1", "t"))
    config = json.loads(path.read_text())
    config["users"][0]["user"] = {
        "exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws"}
    }
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="exec plugin"):
        load_kube_config(settings(str(path)))
    with pytest.raises(ConfigError, match="Context 'nope' not found"):
        load_kube_config(settings(kubeconfig(tmp_path, "http://x:1", "t"), context="nope"))


def test_a_missing_lightkube_is_named_with_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightkube", None)
    monkeypatch.delitem(sys.modules, "epd_actors.discovery.kubernetes", raising=False)
    from prometheus_client import CollectorRegistry

    with pytest.raises(ConfigError, match=r"pip install 'epd_actors\[kubernetes\]'"):
        KubernetesKind().open(settings(None), CollectorRegistry())


async def test_serve_runs_the_configured_discovery(tmp_path: Path) -> None:
    from epd_actors.program.check_config import describe
    from epd_actors.program.config_file import load_config
    from epd_actors.program.serve import serve_router

    api = FakeApiServer()
    api.put(NS, prefill_slice())
    api.put(NS, decode_slice(endpoint("decode-0", "10.0.0.20")))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await api.start(nursery)
            path = tmp_path / "epd.toml"
            path.write_text(
                "[server]\nhttp_listen = '127.0.0.1:0'\n[pools.prefill]\n[pools.decode]\n"
                "[discovery]\nkind = 'kubernetes'\nbackend = 'native'\n"
                "address_format = 'tcp://{host}:{port}'\n"
                f"kubeconfig = '{kubeconfig(tmp_path, api.url, api.token)}'\n"
                "[[discovery.pools]]\nstage = 'prefill'\n[[discovery.pools]]\nstage = 'decode'\n"
            )
            config = load_config(path)
            assert "discovery:  kubernetes" in describe(config)
            stop = trio.Event()
            _, router = await nursery.start(
                lambda task_status: serve_router(
                    config, stop=stop, backend_factory=SimBackends(), task_status=task_status
                )
            )
            assert members(router, "decode") == {D0: False}
            assert isinstance(await final_event(router, 1), DoneEvent)
            stop.set()
            nursery.cancel_scope.cancel()
