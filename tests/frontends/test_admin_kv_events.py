"""Workers added through the admin API (and shared changes) may name their KV event endpoints."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from epd_actors import open_router
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.fleet.changes import WorkerChange
from epd_actors.core.fleet.sync import APPLY
from epd_actors.core.kv_settings import KVEventsSettings
from epd_actors.frontends.admin import RouterAdmin
from tests.core.test_kv_routing import kv_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.core.kv_feeds import KVSourceSpec
    from epd_actors.core.router import Router

PUB, REPLAY = "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"


@contextlib.asynccontextmanager
async def kv_router() -> AsyncIterator[tuple[Router, list[KVSourceSpec], list[WorkerChange]]]:
    """prefill-0 names its own endpoint; the pool has no port rule; prefill-1 is left out."""
    fleet, publishers = kv_fleet()
    specs: list[KVSourceSpec] = []

    def factory(spec: KVSourceSpec):  # type: ignore[no-untyped-def]
        specs.append(spec)
        return contextlib.nullcontext(publishers[spec.worker_id])

    prefill = PoolConfig(
        "prefill",
        (WorkerEndpoint("prefill-0", "tcp://127.0.0.1:1", "native", "ipc:///tmp/p0"),),
        policy="round_robin",
        kv_events=KVEventsSettings(enabled=True),
    )
    decode = PoolConfig("decode", (WorkerEndpoint("decode-0", "tcp://127.0.0.1:1"),))
    changes: list[WorkerChange] = []
    async with open_router(
        RouterConfig((prefill, decode)),
        backend_factory=fleet.backend_factory,
        kv_source_factory=factory,
    ) as router:
        router.on_worker_change = changes.append
        yield router, specs, changes


def add_body(**fields: object) -> dict[str, object]:
    return {"stage": "prefill", "id": "prefill-1", "address": "tcp://127.0.0.1:1", **fields}


async def test_an_added_worker_is_subscribed_on_the_endpoints_it_names() -> None:
    with trio.fail_after(10):
        async with kv_router() as (router, specs, changes):
            admin = RouterAdmin(router)
            status, body = await admin(
                "POST",
                "/admin/workers",
                add_body(kv_events_endpoint=PUB, kv_events_replay_endpoint=REPLAY),
            )
            subscribed = set(router.kv_feeds.pools["prefill"].subscribers)
    assert (status, body) == (201, {"id": "prefill-1", "stage": "prefill", "status": "added"})
    assert [(s.worker_id, s.endpoint, s.replay_endpoint) for s in specs] == [
        ("prefill-0", "ipc:///tmp/p0", None),
        ("prefill-1", PUB, REPLAY),
    ]
    assert subscribed == {"prefill-0", "prefill-1"}
    (change,) = changes
    assert (change.kv_events_endpoint, change.kv_events_replay_endpoint) == (PUB, REPLAY)
    assert WorkerChange.from_json(change.to_json()) == change


async def test_bad_or_missing_endpoints_are_refused_naming_the_field() -> None:
    cases = [
        ({"kv_events_endpoint": "10.0.0.7:5557"}, "kv_events_endpoint: '10.0.0.7:5557' is not"),
        ({"kv_events_endpoint": PUB, "kv_events_replay_endpoint": "tcp://h:x"}, "replay_endpoint"),
        ({"kv_events_endpoint": 5557}, "'kv_events_endpoint' must be a non-empty string"),
        ({"kv_events_endpoint": ""}, "'kv_events_endpoint' must be a non-empty string"),
        ({"kv_events_replay_endpoint": REPLAY}, "'kv_events_replay_endpoint' needs"),
        ({}, "no KV events endpoint"),  # and the pool has no kv_events_port
    ]
    with trio.fail_after(10):
        async with kv_router() as (router, specs, changes):
            admin = RouterAdmin(router)
            answers = [await admin("POST", "/admin/workers", add_body(**f)) for f, _ in cases]
            members = [m.worker_id for m in router.pools["prefill"].members]
    for (status, body), (_, message) in zip(answers, cases, strict=True):
        assert status == 400
        assert message in body["error"]["message"]  # type: ignore[index]
    assert members == ["prefill-0"]
    assert [s.worker_id for s in specs] == ["prefill-0"]
    assert changes == []


async def test_a_shared_add_carries_the_endpoints_to_the_other_replicas() -> None:
    change = WorkerChange(
        "add",
        "prefill-1",
        "prefill",
        address="tcp://127.0.0.1:1",
        origin="other",
        kv_events_endpoint=PUB,
    )
    with trio.fail_after(10):
        async with kv_router() as (router, specs, _changes):
            await APPLY["add"](router, WorkerChange.from_json(change.to_json()))
            subscribed = set(router.kv_feeds.pools["prefill"].subscribers)
    assert [(s.endpoint, s.replay_endpoint) for s in specs[1:]] == [(PUB, None)]
    assert subscribed == {"prefill-0", "prefill-1"}


def test_an_older_replicas_change_without_the_fields_still_reads() -> None:
    old = '{"action":"add","worker_id":"w","stage":"pd","address":"tcp://h:1"}'
    change = WorkerChange.from_json(old)
    assert (change.kv_events_endpoint, change.kv_events_replay_endpoint) == ("", "")
