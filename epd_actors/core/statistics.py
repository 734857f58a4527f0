"""What a running router counts, in one snapshot, for `/health`, the admin API and `/metrics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .actors import ActorStatistics
    from .pool import MemberStatistics
    from .supervisor import SupervisorStatistics


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    """Everything the router counts, for /health and /metrics."""

    supervisor: SupervisorStatistics
    pools: dict[str, list[MemberStatistics]]
    actors: dict[str, ActorStatistics]
    """Both by pool name: the stage, or ``stage@model`` for a model other than the default."""
