"""Worker discovery: pools kept in step with an outside source (see ``base``).

Importing this package registers the built-in kinds: ``kubernetes``
(:mod:`.kubernetes_kind`; its watch needs the optional ``kubernetes`` extra)
and ``redis`` (:mod:`.redis_kind`, workers that register themselves; its
reader needs the optional ``redis`` extra).
"""

from .base import (
    DISCOVERY_KINDS,
    Discovery,
    DiscoveryKind,
    DiscoverySettings,
    WorkerSink,
    discovery_kind,
    open_discovery,
    register_discovery_kind,
)
from .kubernetes_kind import KubernetesKind
from .kubernetes_settings import KubernetesPool, KubernetesSettings
from .redis_kind import RedisKind
from .redis_settings import RedisDiscoverySettings, RedisPool

__all__ = [
    "DISCOVERY_KINDS",
    "Discovery",
    "DiscoveryKind",
    "DiscoverySettings",
    "KubernetesKind",
    "KubernetesPool",
    "KubernetesSettings",
    "RedisDiscoverySettings",
    "RedisKind",
    "RedisPool",
    "WorkerSink",
    "discovery_kind",
    "open_discovery",
    "register_discovery_kind",
]
