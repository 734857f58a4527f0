"""Labels stay bounded: removed workers drop their series, models are configured ones only."""

from __future__ import annotations

import trio

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig
from epd_actors.errors import ModelNotFound
from epd_actors.request import DoneEvent, ErrorEvent
from epd_actors.testing import build_sim_fleet, sim_config
from tests.core.test_metrics import samples
from tests.core.test_models import (
    ALPHA,
    BETA,
    GUARD_S,
    endpoints,
    final,
    request,
    sim_worker,
    two_models,
)


def label_values(text: bytes, family: str, label: str) -> set[str]:
    return {
        dict(labels)[label]
        for (name, labels), _ in samples(text).items()
        if name.startswith(family) and label in dict(labels)
    }


async def test_a_removed_worker_drops_its_series_and_failures_are_per_worker() -> None:
    fleet = build_sim_fleet({"pd": 2}, policies={"pd": "round_robin"})
    fleet.engines["pd-1"].config = sim_config(generate_error_rate=1.0)
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        for n in range(4):
            req = GenerationRequest(
                Prompt(text="x"), sampling=SamplingParams(max_tokens=2), request_id=f"r{n}"
            )
            async with router.generate(req) as events:
                assert isinstance([event async for event in events][-1], DoneEvent)
        before = router.metrics.render()
        router.remove_worker("pd-1")
        await trio.testing.wait_all_tasks_blocked()
        after = router.metrics.render()
    values = samples(before)
    failures = "epd_worker_job_failures_total"
    jobs = "epd_worker_jobs_total"
    assert values[(failures, (("stage", "pd"), ("worker", "pd-1")))] >= 1.0
    assert values[(failures, (("stage", "pd"), ("worker", "pd-0")))] == 0.0
    assert values[(jobs, (("stage", "pd"), ("worker", "pd-0")))] == 4.0
    assert label_values(before, "epd_worker_", "worker") == {"pd-0", "pd-1"}
    assert label_values(after, "epd_worker_", "worker") == {"pd-0"}
    assert label_values(after, "epd_aborts_sent", "worker") == {"pd-0"}


async def test_token_counters_are_labelled_by_configured_models_only() -> None:
    engines = {
        "alpha-0": sim_worker("alpha-0", ALPHA, adapters=("sql",)),  # announced, not configured
        "beta-0": sim_worker("beta-0", BETA),
    }
    pools = (
        PoolConfig("pd", endpoints("alpha-0")),
        PoolConfig("pd", endpoints("beta-0"), model=BETA),
    )
    with trio.fail_after(GUARD_S):
        async with two_models(engines, pools) as router:
            finals = [
                await final(router, request(n, model))
                for n, model in enumerate((ALPHA, BETA, None, "sql", "gamma", "x" * 200))
            ]
            text = router.metrics.render()
    assert [type(event) for event in finals] == [DoneEvent] * 4 + [ErrorEvent] * 2
    assert all(isinstance(event.error, ModelNotFound) for event in finals[4:])  # type: ignore[union-attr]
    values = samples(text)
    for family in ("epd_prompt_tokens_total", "epd_generation_tokens_total"):
        assert label_values(text, family, "model") == {ALPHA, BETA}
    # alpha: its own name, the default (None) and its adapter; beta: one request.
    assert values[("epd_generation_tokens_total", (("model", ALPHA),))] == 3 * 2
    assert values[("epd_generation_tokens_total", (("model", BETA),))] == 2
    assert values[("epd_prompt_tokens_total", (("model", BETA),))] > 0
    prompt = values[("epd_prompt_tokens_total", (("model", ALPHA),))]
    assert (
        prompt
        == sum(event.usage.prompt_tokens for event in finals[:4])
        - values[  # type: ignore[union-attr]
            ("epd_prompt_tokens_total", (("model", BETA),))
        ]
    )
