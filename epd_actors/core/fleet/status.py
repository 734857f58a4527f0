"""What one router knows of its fleet: the live routers and the state of the shared store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping


@dataclass(frozen=True, slots=True)
class LiveRouter:
    """One router the store lists as alive."""

    router_id: str
    requests_in_flight: int
    expires_in_s: float
    this: bool


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """What this router knows of the fleet, for ``/health``, the admin API and metrics."""

    router_id: str
    store: str
    up: bool
    routers: tuple[LiveRouter, ...]
    remote_requests_in_flight: int
    remote_in_flight: Mapping[str, int]
    pending_changes: int
    failures: int
    outages: int
    exchanges: int
    changes_applied: int
    changes_dropped: int
    last_error: str | None
