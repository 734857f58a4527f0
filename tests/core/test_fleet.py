"""Shared state between router replicas, over the in-process store (fast, on an autojump clock).

The same behaviour over a real Redis is in tests/core/test_fleet_redis.py.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors import GenerationRequest, Prompt, SamplingParams
from epd_actors.core.fleet import FleetStoreError, MemoryFleetStore, ReplicaReport, SharedSettings
from epd_actors.core.fleet.changes import WorkerChange
from epd_actors.core.fleet.settings import redacted_url
from epd_actors.core.fleet.store import open_store
from epd_actors.errors import ConfigError, Overloaded
from epd_actors.frontends.admin import RouterAdmin
from epd_actors.frontends.http_app import RouterHttpApp
from epd_actors.program.config_file import parse_config
from epd_actors.request import ErrorEvent
from tests.fleet.replicas import (
    Workers,
    held,
    holding_one_each,
    replica,
    replicas,
    settle,
    short_request,
)

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from epd_actors.core.fleet.state import FleetConnection
    from epd_actors.core.router import Router

FAST = SharedSettings(publish_interval_s=0.1, ttl_s=0.5, timeout_s=0.2)


def metric(router: Router, name: str) -> float:
    value = router.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


# ---------------------------------------------------------------- load


async def test_three_routers_balance_fleet_wide_through_the_store(autojump_clock: object) -> None:
    workers = Workers(3)
    store = MemoryFleetStore()
    async with replicas(3, workers, FAST, store) as routers:
        await settle(routers)
        async with holding_one_each(routers) as placed:
            assert routers[2].fleet is not None
            assert routers[2].fleet.status().remote_in_flight == {"pd-0": 1, "pd-1": 1}
            assert routers[2].supervisor.remote_requests_in_flight == 2
    assert sorted(placed) == ["pd-0", "pd-1", "pd-2"]


async def test_without_the_store_each_router_sees_only_its_own_load(autojump_clock: object) -> None:
    workers = Workers(3)
    async with replicas(3, workers, SharedSettings(), None) as routers:
        assert all(router.fleet is None for router in routers)
        async with holding_one_each(routers, settle_between=False) as placed:
            pass
    assert placed == ["pd-0", "pd-0", "pd-0"]  # the skew the shared counts remove


@pytest.mark.parametrize("policy", ["power_of_two", "cache_aware"])
async def test_other_policies_see_the_remote_load(autojump_clock: object, policy: str) -> None:
    workers = Workers(2)
    async with replicas(2, workers, FAST, MemoryFleetStore(), policy=policy) as (a, b):
        await settle([a, b])
        async with held(a, "first") as first:
            await settle([a, b])
            async with held(b, "second") as second:
                assert second != first


# ---------------------------------------------------------------- admin changes


async def test_admin_changes_reach_the_other_routers_and_a_late_one(autojump_clock: object) -> None:
    workers = Workers(4, configured=3)
    store = MemoryFleetStore()
    async with replicas(2, workers, FAST, store) as (a, b):
        admin = RouterAdmin(a)
        assert await admin("POST", "/admin/workers/pd-1/drain", None) == (
            200,
            {"id": "pd-1", "status": "draining"},
        )
        body = {"stage": "pd", "id": "pd-3", "address": "tcp://127.0.0.1:1"}
        status, _ = await admin("POST", "/admin/workers", body)
        assert status == 201
        assert (await admin("DELETE", "/admin/workers/pd-2", None))[0] == 200
        await settle([a, b])
        pool = b.pools["pd"]
        member = pool.get("pd-1")
        assert member is not None
        assert member.drained
        assert sorted(m.worker_id for m in pool.members) == ["pd-0", "pd-1", "pd-3"]
        assert b.fleet is not None
        assert b.fleet.status().changes_applied == 3
        assert a.fleet is not None
        assert a.fleet.status().changes_applied == 0

        # A router that starts later replays the log; changes that no longer
        # apply (pd-3 exists already, pd-2 is gone) are skipped.
        async with replica(workers, _named("late"), store) as c:
            assert c.fleet is not None
            await c.fleet.wait_exchanges(2)
            pool = c.pools["pd"]
            assert sorted(m.worker_id for m in pool.members) == ["pd-0", "pd-1", "pd-3"]
            member = pool.get("pd-1")
            assert member is not None
            assert member.drained
        # b applied each change once, and did not echo them back
        assert b.fleet.status().pending_changes == 0
        assert a.fleet.status().changes_applied == 0


async def test_changes_made_while_the_store_is_away_are_sent_when_it_is_back(
    autojump_clock: object,
) -> None:
    store = MemoryFleetStore()
    async with replicas(2, Workers(2), FAST, store) as (a, b):
        await settle([a, b])
        store.failing = True
        a.drain_worker("pd-0")
        assert a.fleet is not None
        await a.fleet.wait_cycles(3)
        assert a.fleet.status().pending_changes == 1
        member = b.pools["pd"].get("pd-0")
        assert member is not None
        assert not member.drained
        store.failing = False
        await settle([a, b])
        assert a.fleet.status().pending_changes == 0
        assert member.drained


async def test_the_outbox_is_bounded(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryFleetStore()
    store.failing = True
    settings = SharedSettings(publish_interval_s=0.1, ttl_s=0.5, timeout_s=0.2, admin_history=2)
    async with replica(Workers(2), settings, store) as router:
        for _ in range(3):
            router.drain_worker("pd-0")
        assert router.fleet is not None
        status = router.fleet.status()
        assert (status.pending_changes, status.changes_dropped) == (2, 1)
    assert "the oldest is dropped" in caplog.text


# ---------------------------------------------------------------- live routers


async def test_live_routers_are_listed_and_expire(autojump_clock: object) -> None:
    workers = Workers(1)
    store = MemoryFleetStore()
    async with replicas(2, workers, FAST, store) as (a, b):
        async with replica(workers, _named("c"), store) as c:
            await settle([a, b, c])
            assert a.fleet is not None
            assert [r.router_id for r in a.fleet.status().routers] == ["c", "r0", "r1"]
            view = (await RouterAdmin(a)("GET", "/admin/routers", None))[1]
            assert isinstance(view, dict)
            assert [(r["id"], r["this"]) for r in view["routers"]] == [
                ("c", False),
                ("r0", True),
                ("r1", False),
            ]
            assert metric(a, "epd_fleet_routers") == 3
        await trio.sleep(FAST.ttl_s)  # c stopped publishing: its entry expires by itself
        await settle([a, b])
        assert [r.router_id for r in a.fleet.status().routers] == ["r0", "r1"]
        status, health = RouterHttpApp(a).health()
        assert status == 200
        fleet = health["fleet"]
        assert isinstance(fleet, dict)
        assert fleet["store_up"] is True
        assert [r["id"] for r in fleet["routers"]] == ["r0", "r1"]  # type: ignore[index]


def _named(router_id: str) -> SharedSettings:
    return SharedSettings(publish_interval_s=0.1, ttl_s=0.5, timeout_s=0.2, router_id=router_id)


async def test_a_router_without_shared_state_says_so() -> None:
    async with replica(Workers(1), SharedSettings(), None) as router:
        assert await RouterAdmin(router)("GET", "/admin/routers", None) == (200, {"shared": False})
        assert "fleet" not in RouterHttpApp(router).health()[1]


# ---------------------------------------------------------------- admission


async def test_the_fleet_wide_admission_limit_counts_every_router(autojump_clock: object) -> None:
    settings = SharedSettings(
        publish_interval_s=0.1, ttl_s=0.5, timeout_s=0.2, max_requests_in_flight=2
    )
    store = MemoryFleetStore()
    async with (
        replicas(3, Workers(3), settings, store) as (a, b, c),
        held(a, "one"),
        held(b, "two"),
    ):
        await settle([a, b, c])
        async with c.generate(short_request_of("three")) as events:
            event = await events.receive()
        assert isinstance(event, ErrorEvent)
        assert isinstance(event.error, Overloaded)
        assert "the fleet is serving its limit of 2" in str(event.error)
        # The store goes away: past the TTL, c counts only its own requests.
        store.failing = True
        await trio.sleep(settings.ttl_s)
        assert c.fleet is not None
        await c.fleet.wait_cycles(2)
        assert c.supervisor.remote_requests_in_flight == 0
        assert await short_request(c, "four")


def short_request_of(tag: str) -> GenerationRequest:
    return GenerationRequest(
        Prompt(text=tag), sampling=SamplingParams(max_tokens=2), request_id=tag
    )


# ---------------------------------------------------------------- the store going away


async def load(router: Router, tag: str, stop: trio.Event, outcomes: list[bool]) -> None:
    n = 0
    while not stop.is_set():
        outcomes.append(await short_request(router, f"{tag}-{n}"))
        n += 1


async def test_a_failing_store_fails_no_request_logs_once_and_reconverges(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_actors.core.fleet")
    store = MemoryFleetStore()
    outcomes: list[bool] = []
    async with replicas(2, Workers(2), FAST, store) as (a, b):
        assert a.fleet is not None
        assert b.fleet is not None
        await settle([a, b])
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, a, "a", stop, outcomes)
            nursery.start_soon(load, b, "b", stop, outcomes)
            store.failing = True
            await a.fleet.wait_cycles(10)  # several failed cycles, well past the TTL
            during = len(outcomes)
            assert not a.fleet.up
            assert metric(a, "epd_fleet_store_up") == 0
            assert a.fleet.status().routers == ()  # the local view only
            assert metric(a, "epd_fleet_store_failures_total") >= 10
            store.failing = False
            store.clear()  # as a restarted Redis without persistence
            await settle([a, b])
            stop.set()
        assert metric(a, "epd_fleet_store_outages_total") == 1
        assert metric(a, "epd_fleet_store_up") == 1
        assert [r.router_id for r in a.fleet.status().routers] == ["r0", "r1"]
    assert during > 0
    assert all(outcomes)
    assert len(outcomes) > during
    down = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    back = [r for r in caplog.records if "answers again after" in r.getMessage()]
    assert len(down) == 2
    assert len(back) == 2
    assert a.fleet is None  # unset when the router closed


async def test_a_stalled_store_times_out_and_requests_go_on(autojump_clock: object) -> None:
    store = MemoryFleetStore()
    async with replicas(2, Workers(2), FAST, store) as (a, b):
        await settle([a, b])
        store.stalled = True
        assert a.fleet is not None
        await a.fleet.wait_cycles(2)
        assert not a.fleet.up
        assert "no answer within 0.2 s" in (a.fleet.status().last_error or "")
        assert await short_request(a, "while-stalled")
        store.stalled = False
        await settle([a, b])
        assert [r.router_id for r in a.fleet.status().routers] == ["r0", "r1"]


class BreakingStore(MemoryFleetStore):
    """Its first connection's exchange fails with an error the store did not translate."""

    def __init__(self) -> None:
        super().__init__()
        self.connections = 0

    def connect(self) -> AbstractAsyncContextManager[FleetConnection]:
        self.connections += 1
        opened = super().connect()
        if self.connections > 1:
            return opened
        return _Breaking(opened)


class _Breaking:
    def __init__(self, inner: AbstractAsyncContextManager[FleetConnection]) -> None:
        self._inner = inner

    async def __aenter__(self) -> FleetConnection:
        connection = await self._inner.__aenter__()

        async def broken(*args: object) -> list[ReplicaReport]:
            raise RuntimeError("the client's connection task died")

        connection.exchange = broken  # type: ignore[method-assign]
        return connection

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._inner.__aexit__(*exc)  # type: ignore[arg-type]


async def test_a_broken_client_is_opened_again(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    store = BreakingStore()
    async with replica(Workers(1), FAST, store) as router:
        assert router.fleet is not None
        await router.fleet.wait_exchanges(1)
        assert store.connections == 2
        assert router.fleet.status().outages == 1
        assert await short_request(router, "after")
    assert "the connection broke: RuntimeError" in caplog.text


# ---------------------------------------------------------------- configuration and formats


def test_shared_is_off_by_default_and_read_from_the_file() -> None:
    minimal = {"pools": {"pd": {"workers": [{"id": "pd-0", "address": "tcp://127.0.0.1:1"}]}}}
    assert not parse_config(minimal, environ={}).router.shared.enabled
    assert open_store(SharedSettings()) is None
    data = {
        **minimal,
        "shared": {
            "redis_url_env": "REDIS_URL",
            "router_id": "east-1",
            "publish_interval_s": 0.1,
            "ttl_s": 1,
            "max_requests_in_flight": 500,
        },
    }
    shared = parse_config(data, environ={"REDIS_URL": "redis://:pw@127.0.0.1:6379/0"}).router.shared
    assert shared.enabled
    assert shared.redis_url.endswith("6379/0")
    assert (shared.router_id, shared.ttl_s, shared.max_requests_in_flight) == ("east-1", 1.0, 500)
    with pytest.raises(ConfigError, match=r"shared.ttl_s must be at least twice"):
        parse_config({**minimal, "shared": {"publish_interval_s": 1, "ttl_s": 1}}, environ={})
    with pytest.raises(ConfigError, match="scheme 'http'"):
        parse_config({**minimal, "shared": {"redis_url": "http://x"}}, environ={})
    with pytest.raises(ConfigError, match=r"shared\.redis_ur"):
        parse_config({**minimal, "shared": {"redis_ur": "redis://x"}}, environ={})


def test_a_redis_url_without_coredis_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "coredis", None)
    monkeypatch.delitem(sys.modules, "epd_actors.core.fleet.redis_state", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'epd_actors\[redis\]'"):
        open_store(SharedSettings(redis_url="redis://127.0.0.1:1"))


def test_router_ids_default_to_unique_ones_and_urls_are_redacted() -> None:
    settings = SharedSettings()
    assert settings.resolved_router_id() != settings.resolved_router_id()
    assert redacted_url("rediss://user:s3cret@host:6380/0") == "rediss://user:***@host:6380/0"
    assert redacted_url("redis://host:6379") == "redis://host:6379"


def test_shared_formats_refuse_garbage() -> None:
    change = WorkerChange("add", "pd-9", "pd", "m", "tcp://h:1", "native", "r#1")
    assert WorkerChange.from_json(change.to_json()) == change
    assert WorkerChange.from_json('{"action": "drain", "worker_id": "w"}').backend == "native"
    for text in (
        "nope",
        "[]",
        '{"action": "explode", "worker_id": "w"}',
        '{"action": "drain", "worker_id": ""}',
        '{"action": "drain", "worker_id": 3}',
    ):
        with pytest.raises(ConfigError):
            WorkerChange.from_json(text)
    report = ReplicaReport("r", "r#1", 2, {"pd-0": 2})
    assert ReplicaReport.from_json(report.to_json()) == report
    for text in (
        "{}",
        '{"id": "r", "instance": "i", "requests_in_flight": -1, "workers": {}}',
        '{"id": "r", "instance": "i", "requests_in_flight": 1, "workers": []}',
        "x",
    ):
        with pytest.raises(FleetStoreError):
            ReplicaReport.from_json(text)
