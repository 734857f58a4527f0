"""The admin API over HTTP on a simulated router: list, add, drain, undrain, remove."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from epd_actors.core.fleet import MemoryFleetStore, SharedSettings
from epd_actors.frontends.admin import RouterAdmin
from epd_actors.frontends.http_app import HttpSettings

from ..fleet.replicas import Workers, replicas, settle
from .test_http_frontend import Client, connected, sim_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.frontends.http_app import RouterHttpApp

ADMIN = (("authorization", "Bearer root"),)
SETTINGS = HttpSettings(admin_keys=("root",))
PD = {"pd": 2}
FAST = SharedSettings(publish_interval_s=0.1, ttl_s=0.5, timeout_s=0.2)


@asynccontextmanager
async def admin_client() -> AsyncIterator[tuple[Client, RouterHttpApp]]:
    async with sim_app(PD) as (_fleet, app):
        app.admin = RouterAdmin(app.router)
        async with connected(app, SETTINGS) as client:
            yield client, app


def drained(app: RouterHttpApp, worker_id: str) -> bool:
    member = app.router.pools["pd"].get(worker_id)
    assert member is not None
    return member.drained


async def test_list_drain_undrain_remove_over_http() -> None:
    with trio.fail_after(10):
        async with admin_client() as (client, app):
            listed = await client.request("GET", "/admin/workers", headers=ADMIN)
            drain = await client.request("POST", "/admin/workers/pd-0/drain", headers=ADMIN)
            was_drained = drained(app, "pd-0")
            undrain = await client.request("POST", "/admin/workers/pd-0/undrain", headers=ADMIN)
            now_drained = drained(app, "pd-0")
            remove = await client.request("DELETE", "/admin/workers/pd-1", headers=ADMIN)
            members = [m.worker_id for m in app.router.pools["pd"].members]
    assert listed.status == 200
    assert [w["worker_id"] for w in listed.json()["pools"]["pd"]] == ["pd-0", "pd-1"]  # type: ignore[index]
    assert (drain.status, drain.json()) == (200, {"id": "pd-0", "status": "draining"})
    assert was_drained
    assert (undrain.status, undrain.json()) == (200, {"id": "pd-0", "status": "serving"})
    assert not now_drained
    assert (remove.status, remove.json()) == (200, {"id": "pd-1", "status": "removed"})
    assert members == ["pd-0"]


async def test_add_a_worker_and_the_refusals() -> None:
    # The simulated fleet backs the workers it built: pd-1 is taken out, then added back.
    good = {"stage": "pd", "id": "pd-1", "address": "tcp://127.0.0.1:1"}
    with trio.fail_after(10):
        async with admin_client() as (client, app):
            await client.request("DELETE", "/admin/workers/pd-1", headers=ADMIN)
            added = await client.request("POST", "/admin/workers", json_body=good, headers=ADMIN)
            again = await client.request("POST", "/admin/workers", json_body=good, headers=ADMIN)
            no_id = await client.request(
                "POST", "/admin/workers", json_body={"stage": "pd"}, headers=ADMIN
            )
            bad_backend = await client.request(
                "POST", "/admin/workers", json_body={**good, "backend": "x"}, headers=ADMIN
            )
            unknown = await client.request("POST", "/admin/workers/nope/undrain", headers=ADMIN)
            wrong_method = await client.request("PUT", "/admin/workers", headers=ADMIN)
            no_route = await client.request("POST", "/admin/workers/pd-0/pause", headers=ADMIN)
            no_key = await client.request("POST", "/admin/workers/pd-0/undrain")
            members = sorted(m.worker_id for m in app.router.pools["pd"].members)
    assert (added.status, added.json()) == (201, {"id": "pd-1", "stage": "pd", "status": "added"})
    assert again.status == 400
    assert again.error()["message"] == "worker id 'pd-1' already exists"
    assert no_id.status == 400
    assert "'id' must be a non-empty string" in no_id.error()["message"]  # type: ignore[operator]
    assert bad_backend.status == 400
    assert unknown.status == 404
    assert unknown.error()["message"] == "unknown worker 'nope'"
    assert wrong_method.status == 405
    assert no_route.status == 404
    assert no_key.status == 401
    assert members == ["pd-0", "pd-1"]


async def test_an_undrain_reaches_the_other_routers(autojump_clock: object) -> None:
    workers = Workers(2, configured=2)
    async with replicas(2, workers, FAST, MemoryFleetStore()) as (a, b):
        admin = RouterAdmin(a)
        assert (await admin("POST", "/admin/workers/pd-1/drain", None))[0] == 200
        await settle([a, b])
        member = b.pools["pd"].get("pd-1")
        assert member is not None
        assert member.drained
        assert await admin("POST", "/admin/workers/pd-1/undrain", None) == (
            200,
            {"id": "pd-1", "status": "serving"},
        )
        await settle([a, b])
        assert not member.drained
        assert b.fleet is not None
        assert b.fleet.status().changes_applied == 2


def test_every_route_is_documented() -> None:
    from pathlib import Path

    import epd_actors.frontends.admin as module

    page = (Path(__file__).resolve().parents[2] / "docs" / "admin.md").read_text()
    assert module.__doc__ is not None
    routes = [
        line.split()[:2]
        for line in module.__doc__.splitlines()
        if line.startswith(("GET", "POST", "DELETE"))
    ]
    assert len(routes) == 6
    for method, path in routes:
        assert f"| {method} | `{path}` |" in page, (method, path)
