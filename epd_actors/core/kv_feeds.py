"""The router's KV event feeds: one index per pool, one subscriber per worker.

Theory of operation
-------------------
For every pool whose ``kv_events`` is on, :func:`build_kv_feeds` makes a
:class:`PoolKVFeeds`: the pool's :class:`~epd_actors.kv_events.KVBlockIndex`
and, per worker, a :class:`~epd_actors.kv_events.subscriber.KVEventSubscriber`
over a source built by the router's :data:`KVSourceFactory` (default:
:func:`zmq_source`, pyzmq's SUB + DEALER).  The router starts a worker's
subscriber with the worker (``Router.add_worker``) in its own cancel scope and
cancels it with the worker (``remove_worker``); a worker without a running
subscriber reads as ``fallback``.  A subscriber whose source fails is logged
and replaced after a backoff (:meth:`PoolKVFeeds.run`): the feeds never fail
the router or a request.  :class:`PoolKVFeeds` is the view the
``kv_aware`` policy reads (``index`` and ``state(worker_id)``), and
:class:`RouterKVFeeds` gathers every pool's feeds for the metrics
(``epd_kv_*``, one :class:`~epd_actors.kv_events.metrics.KVFeedCollector`).

Cancellation: a subscriber's task ends within the source's poll interval
after its scope is cancelled (see the subscriber); its worker is purged from
the index and its source closed.  Backpressure: the subscriber's own bounded
channel; nothing here queues.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..errors import ConfigError
from ..kv_events.feed import FeedState
from ..kv_events.index import KVBlockIndex
from ..kv_events.subscriber import KVEventSource, KVEventSubscriber

if TYPE_CHECKING:
    from .config import RouterConfig, WorkerEndpoint
    from .kv_settings import KVEventsSettings

__all__ = [
    "KVSourceFactory",
    "KVSourceSpec",
    "PoolKVFeeds",
    "RouterKVFeeds",
    "Subscription",
    "build_kv_feeds",
    "zmq_source",
]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_START_S = 1.0
"""The wait before a failed subscriber is replaced (doubling per failure in a row)."""

RESTART_BACKOFF_MAX_S = 30.0
"""The longest wait between two tries."""


@dataclass(frozen=True, slots=True)
class KVSourceSpec:
    """Where one worker's engine publishes its KV events."""

    worker_id: str
    endpoint: str
    replay_endpoint: str | None
    topic: str


KVSourceFactory = Callable[[KVSourceSpec], AbstractContextManager[KVEventSource]]
"""Builds the source of one worker's events; entered when the worker's subscriber starts."""


@contextlib.contextmanager
def zmq_source(spec: KVSourceSpec) -> Iterator[KVEventSource]:
    """A connected :class:`~epd_actors.kv_events.subscriber.ZmqEventSource` for ``spec``.

    Raises:
        ConfigError: pyzmq is not installed (the ``kv-events`` extra), or
            libzmq refused the endpoint.
    """
    from ..kv_events.subscriber import ZmqEventSource

    source = ZmqEventSource(spec.endpoint, spec.replay_endpoint, topic=spec.topic)
    try:
        source.__enter__()
    except Exception as exc:  # zmq.ZMQError: libzmq refused the endpoint
        source.close()
        raise ConfigError(f"worker {spec.worker_id!r}: KV events endpoint: {exc}") from None
    try:
        yield source
    finally:
        source.close()


class PoolKVFeeds:
    """One pool's KV index and its workers' subscribers.

    Args:
        pool: the pool's name (for logs).
        settings: the pool's ``kv_events`` settings.
        source_factory: builds each worker's source.
    """

    def __init__(
        self, pool: str, settings: KVEventsSettings, source_factory: KVSourceFactory
    ) -> None:
        self.pool = pool
        self.settings = settings
        self._factory = source_factory
        self.index = KVBlockIndex(
            max_blocks_per_worker=settings.max_blocks_per_worker, max_blocks=settings.max_blocks
        )
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.failures: dict[str, int] = {}
        """Subscribers that failed, per worker, since the router started."""

    def state(self, worker_id: str) -> FeedState:
        """How far the index can be trusted for ``worker_id`` (``fallback`` without a feed)."""
        subscriber = self.subscribers.get(worker_id)
        return FeedState.FALLBACK if subscriber is None else subscriber.state

    def spec(self, endpoint: WorkerEndpoint) -> KVSourceSpec:
        """Where ``endpoint``'s engine publishes.

        Raises:
            ConfigError: the worker names no endpoint and the pool's port rule
                gives none.
        """
        found = self.settings.endpoints(
            endpoint.address, endpoint.kv_events_endpoint, endpoint.kv_events_replay_endpoint
        )
        if found is None:
            raise ConfigError(
                f"worker {endpoint.worker_id!r} of pool {self.pool!r}: no KV events endpoint "
                "(set its kv_events_endpoint, or the pool's kv_events_port)"
            )
        return KVSourceSpec(endpoint.worker_id, found[0], found[1], self.settings.topic)

    def attach(self, spec: KVSourceSpec) -> Subscription:
        """Build and enter ``spec``'s source now and register its subscriber (state ``fallback``).

        Run it with :meth:`run`; errors building the source surface here.

        Raises:
            ConfigError: the factory refused it.
        """
        stack = contextlib.ExitStack()
        source = stack.enter_context(self._factory(spec))
        subscriber = KVEventSubscriber(spec.worker_id, source, self.index)
        self.subscribers[spec.worker_id] = subscriber
        return Subscription(spec, subscriber, stack)

    async def run(
        self,
        subscription: Subscription,
        *,
        task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run an attached subscription until cancelled; reports the scope that stops it.

        A subscriber that fails (its source raised: a broken socket, a bug) is
        logged and counted (``failures``), its worker reads ``fallback``, and
        after a backoff (:data:`RESTART_BACKOFF_START_S`, doubling to
        :data:`RESTART_BACKOFF_MAX_S`; back to the start once a new one applied
        a batch) a new source and subscriber replace it: a broken feed costs
        routing precision, never the router.

        Cancellation: see the module docstring; the worker is purged and
        unregistered and its source closed on every exit.
        """
        spec = subscription.spec
        current: Subscription | None = subscription
        latest = subscription.subscriber
        backoff = RESTART_BACKOFF_START_S
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                while True:
                    if current is None:
                        try:
                            current = self.attach(spec)
                        except ConfigError as exc:
                            logger.warning("KV events of %s: %s", spec.worker_id, exc)
                    if current is not None:
                        latest = current.subscriber
                        await self._run_once(current)
                        if latest.statistics().batches:
                            backoff = RESTART_BACKOFF_START_S
                        current = None
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
            finally:
                if self.subscribers.get(spec.worker_id) is latest:
                    del self.subscribers[spec.worker_id]
                logger.debug("KV events of %s (pool %s) stopped", spec.worker_id, self.pool)

    async def _run_once(self, subscription: Subscription) -> None:
        """Run one subscriber until it fails (returns) or is cancelled (raises)."""
        try:
            with subscription.stack:
                await subscription.subscriber.run()
        except Exception as exc:  # anything its source raised; never the router's problem
            self.failures[subscription.spec.worker_id] = (
                self.failures.get(subscription.spec.worker_id, 0) + 1
            )
            logger.warning(
                "KV events of %s (pool %s) failed; the worker is routed approximately "
                "until they resume: %r",
                subscription.spec.worker_id,
                self.pool,
                exc,
            )


@dataclass(frozen=True, slots=True)
class Subscription:
    """A registered subscriber and the stack that closes its source."""

    spec: KVSourceSpec
    subscriber: KVEventSubscriber
    stack: contextlib.ExitStack


class RouterKVFeeds:
    """Every pool's feeds, by pool name; what the ``epd_kv_*`` metrics read."""

    def __init__(self, pools: dict[str, PoolKVFeeds]) -> None:
        self.pools = pools

    def subscribers(self) -> list[KVEventSubscriber]:
        """Every running subscriber, of every pool."""
        return [sub for feeds in self.pools.values() for sub in feeds.subscribers.values()]

    def blocks(self, worker_id: str) -> int:
        """The entries indexed for ``worker_id``, in whichever pool it serves."""
        return sum(feeds.index.blocks(worker_id) for feeds in self.pools.values())


def build_kv_feeds(config: RouterConfig, source_factory: KVSourceFactory) -> RouterKVFeeds:
    """A :class:`PoolKVFeeds` for each pool whose ``kv_events`` is on, by pool name."""
    return RouterKVFeeds(
        {
            config.pool_name(pool): PoolKVFeeds(
                config.pool_name(pool), pool.kv_events, source_factory
            )
            for pool in config.pools
            if pool.kv_events.enabled
        }
    )
