"""State shared between router replicas: in-flight counts, admin changes, admission, live routers.

Off by default.  With ``[shared] redis_url`` set, each router runs a
:class:`~.sync.FleetSync` task beside it that publishes this router's load
and reads its replicas' through a :class:`~.state.FleetStore`
(``redis_state.py``: Redis through coredis, which runs on Trio;
``state.MemoryFleetStore``: routers in one process).  Everything shared
expires by itself, and nothing on the request path waits for the store:
when Redis is away each router serves on its local view.

Modules: ``settings.py`` (``[shared]``), ``changes.py`` (admin changes as
exchanged), ``state.py`` (reports, the store interface, the in-memory store),
``redis_state.py`` (the Redis store), ``store.py`` (the store a configuration
names), ``sync.py`` (the task), ``metrics.py`` (its Prometheus collector).
"""

from __future__ import annotations

from .changes import WorkerChange
from .settings import SharedSettings
from .state import FleetConnection, FleetStore, FleetStoreError, MemoryFleetStore, ReplicaReport

__all__ = [
    "FleetConnection",
    "FleetStore",
    "FleetStoreError",
    "MemoryFleetStore",
    "ReplicaReport",
    "SharedSettings",
    "WorkerChange",
]
