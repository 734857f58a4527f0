"""A worker that announces a role or model its pool cannot use is refused, loudly, until fixed.

Native workers are real ``WorkerServer``s over memory streams (``memory_fleet``),
on ``autojump_clock``; the router reconnects a refused worker after
``reconnect_backoff_max_s`` (1 s here).
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from epd_actors.backends.base import WorkerRequirement
from epd_actors.core.router import open_router, worker_requirement
from epd_actors.errors import NoHealthyWorker
from epd_actors.frontends.http_app import RouterHttpApp
from epd_actors.protocol import Role
from epd_actors.request import DoneEvent, ErrorEvent
from tests.fakes import ScriptedEngine
from tests.memory_fleet import MODEL, MemoryFleet, final_event, worker

GUARD_S = 600.0  # virtual seconds


def test_the_requirement_names_what_was_announced_and_what_is_needed() -> None:
    needs = WorkerRequirement("pd", frozenset({"pd"}), "m")
    assert needs.problem(role="pd", models=("m",), max_concurrency=4) is None
    assert needs.problem(role="decode", models=("m",)) == (
        "it announced role 'decode', the pd pool needs role 'pd'"
    )
    assert needs.problem(role="pd", models=("x", "y")) == (
        "it serves model 'x', 'y', the router serves 'm'"
    )
    assert needs.problem(role="pd", models=("m",), max_concurrency=-1) == (
        "it announced max_concurrency -1 (must be >= 0)"
    )
    assert WorkerRequirement().problem(role="decode", models=("x",)) is None


def test_each_built_in_stage_takes_its_own_role_only() -> None:
    for stage in ("encode", "prefill", "decode", "pd"):
        assert worker_requirement(stage, MODEL).roles == {stage}
    assert worker_requirement("audit", MODEL).roles == frozenset()  # an unknown stage: any


@pytest.mark.parametrize(
    ("role", "model", "announced"),
    [(Role.DECODE, MODEL, "role 'decode'"), (Role.PD, "other-model", "model 'other-model'")],
    ids=["wrong-role", "wrong-model"],
)
async def test_a_misfit_worker_gets_no_requests_until_it_comes_back_right(
    autojump_clock: object,
    caplog: pytest.LogCaptureFixture,
    role: Role,
    model: str,
    announced: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    good, misfit = ScriptedEngine(role=Role.PD), ScriptedEngine(role=role, model=model)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            servers = {"pd-0": worker(good, "pd-0"), "pd-1": worker(misfit, "pd-1")}
            fleet = MemoryFleet(nursery, servers)
            async with open_router(fleet.config("pd"), backend_factory=fleet.backend) as router:
                await router.wait_ready()
                await trio.testing.wait_all_tasks_blocked()
                # Round robin would give pd-1 every other request.
                for n in range(4):
                    assert isinstance(await final_event(router, n), DoneEvent)
                assert (len(good.started), misfit.started) == (4, [])

                status, body = RouterHttpApp(router).health()
                pd_1 = body["pools"]["pd"]["workers"][1]  # type: ignore[index]
                assert (status, pd_1["id"], pd_1["usable"]) == (200, "pd-1", False)
                assert announced in pd_1["refused"]
                metrics = router.metrics.render().decode()
                assert 'epd_worker_refused{stage="pd",worker="pd-1"} 1.0' in metrics
                errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
                assert len(errors) == 1  # one error line, not one per reconnect
                assert "pd-1" in errors[0]
                assert announced in errors[0]
                assert "pool" in errors[0]

                # Restarted with the right role and model: accepted on its next connection.
                servers["pd-1"] = worker(ScriptedEngine(role=Role.PD), "pd-1")
                fixed = servers["pd-1"].engine
                await router.backends["pd-1"].wait_ready()
                assert router.statistics().pools["pd"][1].refused is None
                for n in range(4, 8):
                    assert isinstance(await final_event(router, n), DoneEvent)
                assert len(fixed.started) == 2  # type: ignore[attr-defined]
            nursery.cancel_scope.cancel(reason="test finished")


async def test_a_pool_whose_only_worker_is_refused_is_unhealthy(autojump_clock: object) -> None:
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            decoder = worker(ScriptedEngine(role=Role.DECODE), "pd-0")
            fleet = MemoryFleet(nursery, {"pd-0": decoder})
            async with open_router(fleet.config("pd"), backend_factory=fleet.backend) as router:
                await trio.sleep(0.5)
                status, body = RouterHttpApp(router).health()
                assert (status, body["status"]) == (503, "unavailable")
                worker_0 = body["pools"]["pd"]["workers"][0]  # type: ignore[index]
                assert "role 'decode'" in worker_0["refused"]
                final = await final_event(router, 0)
                assert isinstance(final, ErrorEvent)
                assert isinstance(final.error, NoHealthyWorker)
            nursery.cancel_scope.cancel(reason="test finished")


async def test_a_connected_worker_is_refused_when_its_pool_claims_it(
    autojump_clock: object,
) -> None:
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            fleet = MemoryFleet(nursery, {"w": worker(ScriptedEngine(role=Role.DECODE), "w")})
            backend = fleet.client("w")
            await nursery.start(backend.run)
            await backend.wait_connected()
            backend.expect(WorkerRequirement("prefill", frozenset({"prefill"})))
            await trio.testing.wait_all_tasks_blocked()
            status = backend.status()
            assert (status.connected, status.refusals) == (False, 1)
            assert (
                status.refused
                == "it announced role 'decode', the prefill pool needs role 'prefill'"
            )
            assert backend.statistics().refusals == 1
            nursery.cancel_scope.cancel(reason="test finished")
