"""Worker discovery: the interface every kind implements, and the registry of kinds.

Theory of operation: a *discovery* watches some source of truth (Kubernetes
EndpointSlices; another kind could read TTL'd registrations from Redis) and
keeps the router's pools in step with it through the router's own worker
operations, the ones the admin API uses: ``add_worker``, ``drain_worker``,
``resume_worker`` and ``remove_worker`` (:class:`WorkerSink`; a
:class:`~epd_actors.core.router.Router` is one).  It never touches a pool directly.

A *kind* is one :class:`DiscoveryKind` registered by name
(:func:`register_discovery_kind`); the configuration file's
``[discovery] kind = "NAME"`` picks it (:func:`discovery_kind`), the kind reads
the rest of that table into its :class:`DiscoverySettings`, and
:func:`open_discovery` runs it next to a router.  Nothing branches on a kind's
name.  A kind's module imports its client library only in ``open``, so
checking a configuration needs none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import trio

from .._groups import single_exception
from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from prometheus_client import CollectorRegistry

    from ..config_tables import ConfigTable
    from ..core.config import RouterConfig, WorkerEndpoint
    from ..core.router import Router


class WorkerSink(Protocol):
    """The router operations a discovery applies (``Router`` implements them).

    Each raises ``ConfigError`` for an operation the router refuses (no such
    pool, a duplicate or unknown worker id); a discovery logs it and goes on.
    """

    async def add_worker(
        self, stage: str, endpoint: WorkerEndpoint, *, model: str | None = None
    ) -> None: ...

    def drain_worker(self, worker_id: str) -> None: ...

    def resume_worker(self, worker_id: str) -> None: ...

    def remove_worker(self, worker_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """What ``[discovery]`` says; each kind subclasses it with its own keys.

    Attributes:
        kind: the registered kind's name.
    """

    kind: str

    def describe(self) -> list[str]:
        """Lines for ``check-config``'s summary."""
        return [f"discovery:  {self.kind}"]


class Discovery(ABC):
    """One running discovery, built by its kind's ``open``."""

    @abstractmethod
    async def run(
        self, sink: WorkerSink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep ``sink``'s workers in step with the source until cancelled.

        Reports started once the source has been read once (or failed to be:
        a router starts while its source is down, and keeps its last view).

        Cancellation: the only way it ends; nothing is left running.
        """


class DiscoveryKind(ABC):
    """A way of finding workers, registered under ``name``."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, table: ConfigTable, router: RouterConfig) -> DiscoverySettings:
        """Read the ``[discovery]`` table (its ``kind`` already taken).

        Raises:
            ConfigError: naming the key.
        """

    @abstractmethod
    def open(self, settings: DiscoverySettings, registry: CollectorRegistry) -> Discovery:
        """Build the discovery; its metrics go into ``registry``.

        Raises:
            ConfigError: the kind's client library is missing, or its
                credentials cannot be read.
        """


DISCOVERY_KINDS: dict[str, DiscoveryKind] = {}


def register_discovery_kind(cls: type[DiscoveryKind]) -> type[DiscoveryKind]:
    """Register a kind under ``cls.name`` (usable as a decorator).

    Raises:
        ConfigError: another class is registered under that name.
    """
    taken = DISCOVERY_KINDS.get(cls.name)
    if taken is not None and type(taken) is not cls:
        raise ConfigError(f"discovery kind {cls.name!r} is already registered")
    DISCOVERY_KINDS[cls.name] = cls()
    return cls


def discovery_kind(name: str, *, key: str = "discovery.kind") -> DiscoveryKind:
    """The kind registered under ``name``.

    Raises:
        ConfigError: no such kind (naming ``key`` and the known kinds).
    """
    try:
        return DISCOVERY_KINDS[name]
    except KeyError:
        known = ", ".join(sorted(DISCOVERY_KINDS)) or "none"
        raise ConfigError(f"{key}: unknown discovery kind {name!r} (known: {known})") from None


@asynccontextmanager
async def open_discovery(
    router: Router, settings: DiscoverySettings | None
) -> AsyncIterator[Discovery | None]:
    """Run the discovery of ``settings`` against ``router`` for the block (None: none).

    Enters once the discovery has read its source once (or failed to);
    leaving the block cancels it.  Workers it added stay in the router.

    Raises:
        ConfigError: from the kind's ``open``.
    """
    if settings is None:
        yield None
        return
    discovery = discovery_kind(settings.kind).open(settings, router.metrics.registry)
    with single_exception():
        async with trio.open_nursery() as nursery:
            await nursery.start(discovery.run, router)
            try:
                yield discovery
            finally:
                nursery.cancel_scope.cancel(reason="discovery closed")
