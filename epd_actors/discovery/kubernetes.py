"""Workers from Kubernetes EndpointSlices, watched with lightkube under Trio.

Theory of operation: :class:`KubernetesDiscovery` runs one task per
discovered pool.  Each lists the namespace's EndpointSlices that match the
pool's label selector, applies them (:class:`~.endpoints.SliceSet`, then
:class:`~.reconcile.Reconciler` to the router), and watches from the list's
``resourceVersion`` with ``allowWatchBookmarks=true``; every event (bookmarks
included) moves that version on.  When the API server ends a watch (its
``timeoutSeconds``), the next one starts from the latest version.  A ``410
Gone`` (the version was compacted away: the watch answered 410, or an
``ERROR`` event carrying it) starts over with a fresh list, whose result
replaces the pool's view whole, so a change missed in between is not lost.

When the API server cannot be reached or answers with an error, the router
keeps the workers it has (its last view), the failure is logged once at
warning level (then at debug level until it answers again, which is logged
once at info level), counted in ``epd_discovery_errors_total{pool}``, and
``epd_discovery_up{pool}`` drops to 0; the task retries after a jittered
backoff (``backoff_start_s`` doubling to ``backoff_max_s``), resuming the
watch from the version it had.  That handling is the one every kind shares
(:mod:`~.watch_loop`).

What was checked of lightkube (1.0, over httpx2 and httpcore2) to run it on
Trio: httpcore2 picks its Trio network backend when Trio runs it
(``current_async_library``), so connections, TLS and reads are Trio's;
bearer-token auth (inline, or a token file re-read on a 401, which is how
in-cluster service-account tokens rotate) is a plain httpx auth flow;
``AsyncClient.list`` and ``watch`` only await httpx.  Two paths do call
asyncio and are kept out: the watch's own retry (``on_error`` with a sleep
calls ``asyncio.sleep``), so the watch here raises on every error and this
module retries with ``trio.sleep``; and ``exec`` credential plugins (run with
``asyncio.create_subprocess_exec``), which are refused with a clear error.
lightkube's ``watch`` has no bookmark option, so the client's transport (a
documented ``AsyncClient`` argument) adds ``allowWatchBookmarks=true`` to each
watch request; it carries the TLS settings lightkube derives from the
kubeconfig (``verify_cluster``).

Cancellation: cancelling ``run`` ends every watch and closes the client
(shielded, bounded); the workers stay in the router.
Backpressure: events are applied one at a time, in order, by the task that
reads them; a slow router slows the watch read, the API server buffers.
"""

from __future__ import annotations

import logging
import os
import random
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httpx2
import msgspec
import trio
from lightkube import AsyncClient, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.core.exceptions import ApiError
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.resources.discovery_v1 import EndpointSlice
from prometheus_client import Counter

from ..errors import ConfigError
from .base import Discovery, WorkerSink
from .endpoints import SliceSet
from .reconcile import Reconciler
from .watch_loop import Backoff, SourceHealth, SourceMetrics, StartOnce

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Mapping

    from lightkube.config.kubeconfig import SingleConfig
    from prometheus_client import CollectorRegistry

    from .kubernetes_settings import KubernetesPool, KubernetesSettings

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
# What a failed request or watch can raise: HTTP and transport errors (ApiError
# is an HTTPStatusError), a bad line in the stream, a token file gone missing.
_API_ERRORS = (httpx2.HTTPError, msgspec.MsgspecError, LightkubeConfigError, OSError)


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def load_kube_config(settings: KubernetesSettings) -> SingleConfig:
    """The cluster and credentials: the kubeconfig named, else in-cluster, else $KUBECONFIG.

    In-cluster means the pod's service account (``service_account_dir``:
    token, ``ca.crt``, namespace) and ``KUBERNETES_SERVICE_HOST``/``_PORT``.

    Raises:
        ConfigError: nothing usable found, or credentials this client cannot
            use under Trio (an ``exec`` plugin).
    """
    try:
        if settings.kubeconfig is not None:
            config = KubeConfig.from_file(settings.kubeconfig)
        else:
            try:
                config = KubeConfig.from_service_account(settings.service_account_dir)
            except (LightkubeConfigError, KeyError, OSError):
                path = os.environ.get("KUBECONFIG", "~/.kube/config")
                config = KubeConfig.from_file(os.path.expanduser(path))
        single = config.get(settings.context)
    except (LightkubeConfigError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"discovery: no usable Kubernetes credentials: {exc}") from None
    if single is None:
        raise ConfigError("discovery: the kubeconfig has no current context; set discovery.context")
    if single.user is None:
        raise ConfigError("discovery: the kubeconfig's context names no user")
    if single.user.exec is not None:
        raise ConfigError(
            "discovery: the kubeconfig's user authenticates with an exec plugin, which "
            "lightkube runs through asyncio; give a token, a token file or a client certificate"
        )
    return single


class _BookmarkTransport(httpx2.AsyncBaseTransport):
    """Adds ``allowWatchBookmarks=true`` to watch requests; otherwise the inner transport."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        params = request.url.params
        if params.get("watch") == "true" and "allowWatchBookmarks" not in params:
            request.url = request.url.copy_add_param("allowWatchBookmarks", "true")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def open_client(settings: KubernetesSettings) -> AsyncClient:
    """A lightkube client for ``settings`` (see :func:`load_kube_config`).

    Raises:
        ConfigError: from :func:`load_kube_config`, or unreadable TLS files.
    """
    config = load_kube_config(settings)
    assert config.user is not None  # load_kube_config refuses a context without one
    try:
        verify = verify_cluster(config.cluster, config.user, config.abs_file)
    except (LightkubeConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"discovery: cannot load the cluster's TLS settings: {exc}") from None
    transport = _BookmarkTransport(httpx2.AsyncHTTPTransport(verify=verify))
    return AsyncClient(
        config,
        namespace=settings.namespace,
        timeout=httpx2.Timeout(settings.request_timeout_s),
        transport=transport,
        # Environment proxies would replace the transport above; the API
        # server is reached directly, as client-go does in a pod.
        trust_env=False,
    )


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.source = SourceMetrics(
            registry, errors_help="Failed list or watch requests to the discovery source, by pool"
        )
        self.relists = Counter(
            "epd_discovery_relists",
            "Full lists of a pool's EndpointSlices (the first, and after 410 Gone)",
            ["pool"],
            registry=registry,
        )
        self.events = Counter(
            "epd_discovery_events",
            "Watch events received, by pool and type",
            ["pool", "type"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class PoolDiscoveryStatistics:
    """One pool's discovery, for tests and ``/health``-style reports.

    Attributes:
        workers: each worker applied, by id: whether it takes new work.
        up: the last request to the API server succeeded.
        resource_version: where the watch resumes (None: it lists first).
        lists: full lists done; errors: failed requests; events: events read.
    """

    workers: Mapping[str, bool]
    up: bool
    resource_version: str | None
    lists: int
    errors: int
    events: int


class _PoolWatch:
    """List and watch one pool's EndpointSlices, applying each change."""

    def __init__(
        self, pool: KubernetesPool, settings: KubernetesSettings, metrics: _Metrics
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.slices = SliceSet(
            port_name=pool.port,
            address_format=pool.address_format,
            kv_ports=(pool.kv_events_port, pool.kv_events_replay_port),
        )
        self.reconciler = Reconciler(pool.stage, pool.model, pool.backend, label=pool.label)
        self.resource_version: str | None = None
        self.health = SourceHealth(
            pool.label, metrics.source, source="the API server", attempts="attempts", logger=logger
        )
        self.lists = 0
        self.events = 0
        self._relists = metrics.relists.labels(pool.label)
        self._events = metrics.events

    def statistics(self) -> PoolDiscoveryStatistics:
        return PoolDiscoveryStatistics(
            self.reconciler.workers,
            self.health.up,
            self.resource_version,
            self.lists,
            self.health.errors,
            self.events,
        )

    async def relist(self, client: AsyncClient, sink: WorkerSink) -> None:
        listed = client.list(EndpointSlice, labels=dict(self.pool.selector))
        items = [item.to_dict() async for item in listed]
        version = listed.resourceVersion
        self.lists += 1
        self._relists.inc()
        self.slices.replace_all(items)
        self.health.succeeded()
        await self.reconciler.apply(sink, self.slices.workers())
        self.resource_version = version

    async def watch(self, client: AsyncClient, sink: WorkerSink) -> int:
        """One watch request, until the server ends it; returns the events read.

        Raises:
            _Gone: the version is too old.
        """
        settings = self.settings
        seen = 0
        stream = client.watch(
            EndpointSlice,
            labels=dict(self.pool.selector),
            server_timeout=int(settings.watch_timeout_s),
            resource_version=self.resource_version,
        )
        # A connection that dies without a word would never end the read.
        with trio.move_on_after(settings.watch_timeout_s + settings.request_timeout_s):
            try:
                # lightkube's watch is an async generator: close it here, not at GC.
                events_iter = cast("AsyncGenerator[tuple[str, EndpointSlice]]", stream.__aiter__())
                async with aclosing(events_iter) as events:
                    async for event_type, obj in events:
                        if not seen:
                            self.health.succeeded()
                        seen += 1
                        self.events += 1
                        self._events.labels(self.pool.label, event_type).inc()
                        if self.slices.apply(event_type, obj.to_dict()):
                            await self.reconciler.apply(sink, self.slices.workers())
                        if obj.metadata is not None and obj.metadata.resourceVersion:
                            self.resource_version = obj.metadata.resourceVersion
            except ApiError as exc:
                if exc.status.code == 410:
                    raise _Gone(exc.status.message or "resourceVersion too old") from None
                raise
            except httpx2.HTTPStatusError as exc:
                if exc.response.status_code == 410:
                    raise _Gone("resourceVersion too old") from None
                raise
        self.health.succeeded()
        return seen

    def failed(self, exc: BaseException) -> None:
        self.health.failed(f"{type(exc).__name__}: {exc}", workers=len(self.reconciler.workers))


class KubernetesDiscovery(Discovery):
    """The ``kubernetes`` discovery (see the module docstring).

    Args:
        settings: the ``[discovery]`` table.
        registry: where its metrics go (the router's).
        rng: the backoff's jitter.
    """

    def __init__(
        self,
        settings: KubernetesSettings,
        registry: CollectorRegistry,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self._rng = rng or random.Random()
        metrics = _Metrics(registry)
        self.pools = {pool.label: _PoolWatch(pool, settings, metrics) for pool in settings.pools}

    def statistics(self) -> dict[str, PoolDiscoveryStatistics]:
        return {label: watch.statistics() for label, watch in self.pools.items()}

    async def run(
        self, sink: WorkerSink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        client = open_client(self.settings)
        try:
            async with trio.open_nursery() as nursery:
                for watch in self.pools.values():
                    await nursery.start(self._keep_watching, watch, client, sink)
                task_status.started()
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await client.close()

    async def _keep_watching(
        self,
        watch: _PoolWatch,
        client: AsyncClient,
        sink: WorkerSink,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        settings = self.settings
        backoff = Backoff(settings.backoff_start_s, settings.backoff_max_s, rng=self._rng)
        started = StartOnce(task_status)
        while True:
            try:
                if watch.resource_version is None:
                    await watch.relist(client, sink)
                started()
                seen = await watch.watch(client, sink)
            except _Gone as exc:
                logger.info("discovery of pool %s: %s; listing again", watch.pool.label, exc)
                watch.resource_version = None
                continue
            except _API_ERRORS as exc:
                watch.failed(exc)
                started()
                await backoff.wait()
                continue
            backoff.reset()
            if not seen:
                # A watch that ends at once, again and again, must not spin.
                await trio.sleep(settings.backoff_start_s)
