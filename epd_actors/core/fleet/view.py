"""The fleet as ``/health`` and ``GET /admin/routers`` show it (plain JSON values)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sync import FleetSync


def fleet_view(sync: FleetSync | None) -> dict[str, object]:
    """``{"shared": false}`` without shared state, else this router's view of the fleet."""
    if sync is None:
        return {"shared": False}
    status = sync.status()
    return {
        "shared": True,
        "router_id": status.router_id,
        "store": status.store,
        "store_up": status.up,
        "last_error": status.last_error,
        "routers": [
            {
                "id": r.router_id,
                "requests_in_flight": r.requests_in_flight,
                "expires_in_s": round(r.expires_in_s, 3),
                "this": r.this,
            }
            for r in status.routers
        ],
        "remote_requests_in_flight": status.remote_requests_in_flight,
        "pending_changes": status.pending_changes,
    }
