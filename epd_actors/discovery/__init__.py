"""Worker discovery: pools kept in step with an outside source (see ``base``).

Importing this package registers the built-in kind, ``kubernetes``
(:mod:`.kubernetes_kind`; its watch needs the optional ``kubernetes`` extra).
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

__all__ = [
    "DISCOVERY_KINDS",
    "Discovery",
    "DiscoveryKind",
    "DiscoverySettings",
    "KubernetesKind",
    "KubernetesPool",
    "KubernetesSettings",
    "WorkerSink",
    "discovery_kind",
    "open_discovery",
    "register_discovery_kind",
]
