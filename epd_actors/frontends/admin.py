"""Admin routes over a running router: list, register, drain and remove workers.

Served by the HTTP front end under ``/admin/`` (only when an admin key is
configured; every call must present it as ``Authorization: Bearer KEY``):

=======  ===============================  ==========================================
method   path                             effect
=======  ===============================  ==========================================
GET      /admin/workers                   every pool's workers and their state
POST     /admin/workers                   add ``{"stage", "id", "address", "backend"}``
                                          (and optionally ``kv_events_endpoint``,
                                          ``kv_events_replay_endpoint``)
POST     /admin/workers/{id}/drain        no new jobs to that worker; in-flight finish
POST     /admin/workers/{id}/undrain      new jobs to that worker again (undoes drain)
DELETE   /admin/workers/{id}              remove it (its in-flight jobs are cancelled)
GET      /admin/routers                   the live router replicas (``[shared]``)
=======  ===============================  ==========================================

With ``[shared]`` configured, adding, draining, undraining and removing reach the other
replicas too (``epd_actors.core.fleet``).

Errors answer ``{"error": {"message", "type"}}`` with 400 (bad body), 404
(unknown worker or route) or 405.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from ..core.backend_kinds import backend_kind_names
from ..core.config import WorkerEndpoint
from ..core.fleet.view import fleet_view
from ..core.kv_settings import check_zmq_endpoint
from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..core.router import Router

WORKERS = "/admin/workers"
ROUTERS = "/admin/routers"
KV_ENDPOINT_FIELDS = ("kv_events_endpoint", "kv_events_replay_endpoint")
"""Optional fields of an add: where the worker's engine publishes KV events (ZMQ)."""


def _error(status: int, message: str) -> tuple[int, object]:
    kind = {400: "invalid_request_error", 404: "not_found", 405: "method_not_allowed"}[status]
    return status, {"error": {"message": message, "type": kind}}


class RouterAdmin:
    """The admin hook of :class:`~epd_actors.frontends.http_app.RouterHttpApp`."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def __call__(self, method: str, path: str, body: object) -> tuple[int, object]:
        """Dispatch one admin call (see the module docstring)."""
        if path == WORKERS:
            if method == "GET":
                return 200, self.workers()
            if method == "POST":
                return await self._add(body)
            return _error(405, f"{method} is not allowed on {path}")
        if path == ROUTERS and method == "GET":
            return 200, fleet_view(self.router.fleet)
        if path.startswith(WORKERS + "/"):
            rest = path[len(WORKERS) + 1 :]
            worker_id, _, action = rest.partition("/")
            if method == "POST" and action == "drain":
                return self._apply(self.router.drain_worker, worker_id, "draining")
            if method == "POST" and action == "undrain":
                return self._apply(self.router.resume_worker, worker_id, "serving")
            if method == "DELETE" and not action:
                return self._apply(self.router.remove_worker, worker_id, "removed")
        return _error(404, f"no admin route {method} {path}")

    def workers(self) -> dict[str, object]:
        stats = self.router.statistics()
        return {
            "pools": {
                stage: [asdict(member) for member in members]
                for stage, members in stats.pools.items()
            }
        }

    async def _add(self, body: object) -> tuple[int, object]:
        if not isinstance(body, dict):
            return _error(400, "expected a JSON object")
        fields = {}
        for name in ("stage", "id", "address"):
            value = body.get(name)
            if not isinstance(value, str) or not value:
                return _error(400, f"{name!r} must be a non-empty string")
            fields[name] = value
        backend = body.get("backend", "native")
        if backend not in backend_kind_names():
            return _error(400, f"'backend' must be one of {', '.join(backend_kind_names())}")
        kv: dict[str, str | None] = {}
        for name in KV_ENDPOINT_FIELDS:
            value = body.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                return _error(400, f"{name!r} must be a non-empty string")
            if value is not None:
                try:
                    check_zmq_endpoint(value, key=name)
                except ConfigError as exc:
                    return _error(400, str(exc))
            kv[name] = value
        if kv["kv_events_replay_endpoint"] is not None and kv["kv_events_endpoint"] is None:
            return _error(400, "'kv_events_replay_endpoint' needs kv_events_endpoint")
        endpoint = WorkerEndpoint(
            fields["id"],
            fields["address"],
            backend,
            kv["kv_events_endpoint"],
            kv["kv_events_replay_endpoint"],
        )
        try:
            await self.router.add_worker(fields["stage"], endpoint)
        except ConfigError as exc:
            return _error(400, str(exc))
        return 201, {"id": endpoint.worker_id, "stage": fields["stage"], "status": "added"}

    def _apply(
        self, action: Callable[[str], None], worker_id: str, status: str
    ) -> tuple[int, object]:
        try:
            action(worker_id)
        except ConfigError as exc:
            return _error(404, str(exc))
        return 200, {"id": worker_id, "status": status}
