"""The embeddable API: ``async with open_router(config) as router: ...``.

Theory of operation: :func:`open_router` builds one backend per configured
worker and one pool per stage and model (:func:`build_pools`), starts every
backend's connection supervisor and the
:class:`~epd_actors.core.supervisor.Supervisor` in a nursery it owns, and yields a
:class:`Router`.  Leaving the block cancels everything: in-flight requests
end, their workers are told to abort, connections close.

Example::

    async with open_router(config) as router:
        await router.wait_ready()
        async with router.generate(GenerationRequest(Prompt(text="hi"))) as events:
            async for event in events:
                ...

Public coroutines raise single typed ``EpdError``s, never exception groups.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import trio

from .._groups import single_exception
from ..backends.base import ManagedBackend, WorkerRequirement
from ..errors import ConfigError, NoHealthyWorker
from ..kv_events.metrics import KVFeedCollector
from .actors import STAGE_ACTORS, stage_policy
from .actors.local_prefill import (
    LocalPrefillCollector,
    LocalPrefillRule,
    consumer_pool,
)
from .backend_kinds import backend_kind
from .config import PoolConfig, RouterConfig, WorkerEndpoint, pool_name
from .encoder_cache import EncoderCache
from .encoder_cache_metrics import EncoderCacheCollector
from .fleet.changes import WorkerChange
from .fleet.store import open_store
from .fleet.sync import FleetSync
from .kv_feeds import KVSourceFactory, RouterKVFeeds, build_kv_feeds, zmq_source
from .metrics import RouterMetrics
from .models import ModelCatalog
from .pool import WorkerPool
from .routing import build_policy
from .routing.kv_aware import KVViewConsumer
from .statistics import RouterStatistics
from .supervisor import Supervisor
from .tracing import closing_tracing, open_tracing

if TYPE_CHECKING:
    from ..handoff import HandoffReceiver
    from ..lora import LoraAdapter
    from ..request import GenerationEvent, GenerationRequest
    from .fleet.state import FleetStore
    from .models import ModelCard
    from .tracing import RequestTracing

logger = logging.getLogger(__name__)

BackendFactory = Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]


class DefaultBackendFactory:
    """Builds each worker's backend through its kind (``endpoint.backend``, a registered name).

    Use one per router: each kind's factory is opened once and builds all of
    that kind's backends, so they share what the kind shares (the
    ``openai_http`` backends: one KV hand-off ledger; see
    :mod:`epd_actors.core.backend_kinds`).

    Args:
        **settings: a kind's settings by the kind's name, overriding the router
            configuration's (``openai_http=OpenAIHttpSettings(...)``,
            ``native=NativeSettings(...)``).
    """

    def __init__(self, **settings: object) -> None:
        self._settings = settings
        self._factories: dict[str, Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]] = {}

    def __call__(self, endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
        factory = self._factories.get(endpoint.backend)
        if factory is None:
            kind = backend_kind(endpoint.backend, key=f"worker {endpoint.worker_id!r} backend")
            factory = kind.open_factory(config, self._settings.get(kind.name))
            self._factories[endpoint.backend] = factory
        return factory(endpoint, config)


def default_backend_factory(endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
    """Build the backend of ``endpoint`` by its kind (each call on its own).

    :func:`open_router` uses a :class:`DefaultBackendFactory` per router
    instead, so that its ``openai_http`` backends share their hand-off ledger.
    """
    return DefaultBackendFactory()(endpoint, config)


class Router:
    """A running router; obtained from :func:`open_router`."""

    def __init__(
        self,
        config: RouterConfig,
        supervisor: Supervisor,
        pools: dict[str, WorkerPool],
        nursery: trio.Nursery,
        backend_factory: BackendFactory,
        metrics: RouterMetrics,
        kv_feeds: RouterKVFeeds | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.supervisor = supervisor
        self.pools = pools
        self._nursery = nursery
        self._backend_factory = backend_factory
        self.backends: dict[str, ManagedBackend] = {}
        self._backend_scopes: dict[str, trio.CancelScope] = {}
        self.kv_feeds = kv_feeds if kv_feeds is not None else RouterKVFeeds({})
        """Each pool's KV event index and subscribers (pools with ``kv_events`` on)."""
        self._kv_scopes: dict[str, trio.CancelScope] = {}
        self.on_worker_change: Callable[[WorkerChange], None] | None = None
        """Told of each operator change made here (``origin`` None), to share it."""
        self.fleet: FleetSync | None = None
        """The replicas' shared state, when ``[shared]`` names a store."""

    def __repr__(self) -> str:
        return f"<Router topology={'+'.join(self.supervisor.topology)}>"

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[HandoffReceiver[GenerationEvent]]:
        """Run one request; the block yields its events (see ``Supervisor.generate``)."""
        return self.supervisor.generate(request)

    def model_cards(self) -> list[ModelCard]:
        """Every model the pools serve, then every LoRA adapter (``/v1/models``)."""
        return self.supervisor.catalog.cards()

    def serves_model(self, name: str) -> bool:
        """Whether ``name`` is the ``id`` of one of :meth:`model_cards` (checked per request)."""
        return self.supervisor.catalog.serves(name)

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            supervisor=self.supervisor.statistics(),
            pools={stage: pool.statistics() for stage, pool in self.pools.items()},
            actors={stage: a.statistics() for stage, a in self.supervisor.actors.items()},
        )

    async def wait_ready(self) -> None:
        """Wait until every pool has at least one worker ready to take work.

        Raises:
            NoHealthyWorker: a pool has no workers configured at all.
        """
        for stage, pool in self.pools.items():
            if not len(pool):
                raise NoHealthyWorker(f"pool {stage!r} has no workers")
            async with trio.open_nursery() as nursery:
                for member in pool.members:
                    backend = self.backends[member.worker_id]
                    nursery.start_soon(_first_ready, backend, nursery.cancel_scope)

    async def add_worker(
        self,
        stage: str,
        endpoint: WorkerEndpoint,
        *,
        model: str | None = None,
        origin: str | None = None,
    ) -> None:
        """Add a worker to a running router (its connection starts at once).

        Args:
            stage: the stage of the pool it joins.
            endpoint: the worker.
            model: the model of the pool it joins (default: the router's model).
            origin: the replica whose change this applies (None: a change made
                here, which ``on_worker_change`` shares; the same for drain
                and remove).

        In a pool with ``kv_events`` on, the worker's KV event subscriber
        starts with it (and stops with ``remove_worker``).

        Raises:
            ConfigError: no pool of that stage and model, a duplicate worker
                id, or (a pool with ``kv_events``) no usable KV events endpoint.
        """
        served = model or self.config.model
        name = pool_name(stage, served, self.config.model)
        pool = self.pools.get(name)
        if pool is None:
            raise ConfigError(f"no pool for stage {stage!r} of model {served!r}")
        if any(p.get(endpoint.worker_id) for p in self.pools.values()):
            raise ConfigError(f"worker id {endpoint.worker_id!r} already exists")
        feeds = self.kv_feeds.pools.get(name)
        subscription = None if feeds is None else feeds.attach(feeds.spec(endpoint))
        backend = self._backend_factory(endpoint, self.config)
        scope = await self._nursery.start(_run_backend, backend)
        self._backend_scopes[endpoint.worker_id] = scope
        self.backends[endpoint.worker_id] = backend
        if feeds is not None and subscription is not None:
            kv_scope = await self._nursery.start(feeds.run, subscription)
            self._kv_scopes[endpoint.worker_id] = kv_scope
        pool.add(backend)
        change = WorkerChange(
            "add",
            endpoint.worker_id,
            stage,
            served,
            endpoint.address,
            endpoint.backend,
            kv_events_endpoint=endpoint.kv_events_endpoint or "",
            kv_events_replay_endpoint=endpoint.kv_events_replay_endpoint or "",
        )
        self._changed(change, origin)

    def _changed(self, change: WorkerChange, origin: str | None) -> None:
        if origin is None and self.on_worker_change is not None:
            self.on_worker_change(change)

    def drain_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Send the worker no new jobs; its in-flight jobs finish normally.

        Raises:
            ConfigError: unknown worker id.
        """
        for pool in self.pools.values():
            if pool.get(worker_id) is not None:
                pool.drain(worker_id)
                logger.info("worker %s drained by an operator", worker_id)
                self._changed(WorkerChange("drain", worker_id), origin)
                return
        raise ConfigError(f"unknown worker {worker_id!r}")

    def resume_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Give a drained worker new jobs again (undoes ``drain_worker``).

        Raises:
            ConfigError: unknown worker id.
        """
        for pool in self.pools.values():
            if pool.get(worker_id) is not None:
                pool.resume(worker_id)
                logger.info("worker %s resumed", worker_id)
                self._changed(WorkerChange("resume", worker_id), origin)
                return
        raise ConfigError(f"unknown worker {worker_id!r}")

    def remove_worker(self, worker_id: str, *, origin: str | None = None) -> None:
        """Remove a worker; its in-flight jobs are cancelled with its connection.

        Raises:
            ConfigError: unknown worker id.
        """
        for pool in self.pools.values():
            if pool.get(worker_id) is not None:
                pool.remove(worker_id)
                del self.backends[worker_id]
                self._backend_scopes.pop(worker_id).cancel(reason="worker removed")
                kv_scope = self._kv_scopes.pop(worker_id, None)
                if kv_scope is not None:
                    kv_scope.cancel(reason="worker removed")
                self._changed(WorkerChange("remove", worker_id), origin)
                return
        raise ConfigError(f"unknown worker {worker_id!r}")


async def _first_ready(backend: ManagedBackend, scope: trio.CancelScope) -> None:
    await backend.wait_ready()
    scope.cancel(reason="a worker of the pool is connected")


async def _run_backend(
    backend: ManagedBackend,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        await backend.run()


def build_pools(config: RouterConfig) -> dict[str, WorkerPool]:
    """One empty pool per configured stage and model, by pool name (``RouterConfig.pool_name``).

    Each has its routing policy, limits and requirement: its workers must
    announce a role its stage actor serves (``worker_roles``, from the stage
    registry) and the pool's model.
    """
    pools: dict[str, WorkerPool] = {}
    for pool in config.pools:
        name = config.pool_name(pool)
        model = config.pool_model(pool)
        try:
            policy = build_policy(stage_policy(pool.stage, pool.policy), pool.policy_options)
        except ConfigError as exc:
            raise ConfigError(f"pools.{pool.stage}.policy: {exc}") from None
        pools[name] = WorkerPool(
            pool.stage,
            policy,
            max_in_flight_per_worker=pool.max_in_flight_per_worker,
            health=config.health,
            requirement=worker_requirement(
                pool.stage, model, loadable=_loadable(config, pool, model)
            ),
            model=model,
            name=name,
        )
    return pools


def bind_kv_views(pools: dict[str, WorkerPool], kv_feeds: RouterKVFeeds) -> None:
    """Hand each pool's KV feeds to its policy, when the policy reads them (``kv_aware``)."""
    for name, feeds in kv_feeds.pools.items():
        policy = pools[name].policy
        if isinstance(policy, KVViewConsumer):
            policy.bind_kv_view(feeds)


def bind_local_prefill(
    config: RouterConfig, pools: dict[str, WorkerPool], supervisor: Supervisor
) -> list[LocalPrefillRule]:
    """Give each pool with ``local_prefill_below_tokens`` its rule (conditional disaggregation).

    Raises:
        ConfigError: the pool's stage hands no KV on, no pool of its model
            takes the hand-off, or that pool's policy cannot estimate prefills.
    """
    rules = []
    for pool in config.pools:
        if not pool.local_prefill_below_tokens:
            continue
        name = config.pool_name(pool)
        rule = LocalPrefillRule(name, pool.local_prefill_below_tokens)
        supervisor.actors[name].use_local_prefill(rule)  # refuses a stage that hands nothing on
        rule.bind(consumer_pool(pools, pools[name]))
        rules.append(rule)
    return rules


def _loadable(config: RouterConfig, pool: PoolConfig, model: str) -> tuple[LoraAdapter, ...]:
    """The adapters the pool's backends may load at run time (those with a path)."""
    if not pool.lora_loading:
        return ()
    return tuple(a for a in config.lora_adapters(model) if a.path is not None)


def build_encoder_caches(config: RouterConfig) -> dict[str, EncoderCache]:
    """A memory of encoder outputs for each pool whose ``encoder_reuse`` is on, by pool name."""
    return {
        config.pool_name(pool): EncoderCache(pool.encoder_reuse)
        for pool in config.pools
        if pool.encoder_reuse.enabled
    }


def build_catalog(config: RouterConfig, pools: dict[str, WorkerPool]) -> ModelCatalog:
    """The models of ``pools`` and the configured adapters of each."""
    adapters = {
        adapter.name: model.name for model in config.models for adapter in model.lora_adapters
    }
    return ModelCatalog(pools.values(), default_model=config.model, adapters=adapters)


def worker_requirement(
    stage: str, model: str, *, loadable: tuple[LoraAdapter, ...] = ()
) -> WorkerRequirement:
    """What the workers of ``stage``'s pool must announce (any role for an unknown stage)."""
    actor = STAGE_ACTORS.get(stage)
    return WorkerRequirement(
        stage,
        roles=frozenset() if actor is None else actor.worker_roles,
        model=model,
        loadable_adapters=loadable,
        consumes_kv_handoff=actor is not None and actor.consumes_kv_handoff,
    )


@asynccontextmanager
async def open_router(
    config: RouterConfig,
    *,
    backend_factory: BackendFactory | None = None,
    fleet_store: FleetStore | None = None,
    tracing: RequestTracing | None = None,
    kv_source_factory: KVSourceFactory | None = None,
) -> AsyncIterator[Router]:
    """Start a router for ``config``; stop it when the block exits.

    Args:
        config: pools, workers, deadlines and limits.
        backend_factory: builds a backend per worker (default: a
            :class:`DefaultBackendFactory`, by each worker's ``backend`` kind).
        fleet_store: where this router shares state with its replicas
            (default: ``config.shared``'s Redis, or nothing when it names none);
            see :mod:`epd_actors.core.fleet`.
        kv_source_factory: builds the KV event source of each worker of a
            pool with ``kv_events`` on (default: :func:`~.kv_feeds.zmq_source`,
            which needs pyzmq, the ``kv-events`` extra).
        tracing: traces the router's requests (default: what ``config.tracing``
            sets up, nothing unless it is enabled); shut down with the router.

    Cancellation: leaving the block cancels every request and connection;
    workers are told to abort within shielded, bounded cleanups.
    """
    factory = backend_factory or DefaultBackendFactory()
    pools = build_pools(config)
    metrics = RouterMetrics()
    if tracing is None:
        tracing = open_tracing(config.tracing)
    supervisor = Supervisor(
        pools,
        deadlines=config.deadlines,
        limits=config.actors,
        observer=metrics,
        retry=config.retries,
        admission=config.admission,
        catalog=build_catalog(config, pools),
        encoder_caches=build_encoder_caches(config),
        tracing=tracing,
    )
    metrics.registry.register(EncoderCacheCollector(supervisor.encoder_caches))
    rules = bind_local_prefill(config, pools, supervisor)
    if rules:
        metrics.registry.register(LocalPrefillCollector(rules))
    kv_feeds = build_kv_feeds(config, kv_source_factory or zmq_source)
    bind_kv_views(pools, kv_feeds)
    if kv_feeds.pools:
        metrics.registry.register(KVFeedCollector(kv_feeds.subscribers, kv_feeds))
    async with closing_tracing(tracing):
        with single_exception():
            async with trio.open_nursery() as nursery:
                router = Router(config, supervisor, pools, nursery, factory, metrics, kv_feeds)
                metrics.watch(router.statistics)
                for pool in config.pools:
                    for endpoint in pool.workers:
                        await router.add_worker(pool.stage, endpoint, model=pool.model)
                await nursery.start(supervisor.run)
                store = fleet_store if fleet_store is not None else open_store(config.shared)
                if store is not None:
                    await nursery.start(FleetSync(router, store, config.shared).run)
                try:
                    yield router
                finally:
                    nursery.cancel_scope.cancel(reason="router closed")
