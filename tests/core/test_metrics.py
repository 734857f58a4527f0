"""Prometheus metrics of a router over a simulated fleet."""

from __future__ import annotations

import trio
from prometheus_client.parser import text_string_to_metric_families

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.request import DoneEvent
from epd_actors.testing import build_sim_fleet, sim_config


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_follow_requests_and_state() -> None:
    fleet = build_sim_fleet({"prefill": 1, "decode": 2})
    fleet.engines["decode-1"].config = sim_config(generate_error_rate=1.0)
    fleet.backends["decode-1"].disconnect()
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        request = GenerationRequest(
            Prompt(text="hello there"), sampling=SamplingParams(max_tokens=6)
        )
        async with router.generate(request) as events:
            last = [event async for event in events][-1]
        assert isinstance(last, DoneEvent)
        router.metrics.observe_http("/v1/completions", 200)
        values = samples(router.metrics.render())
    assert values[("epd_requests_total", (("outcome", "done"),))] == 1.0
    assert values[("epd_output_tokens_total", ())] == 6.0
    assert (
        values[("epd_http_requests_total", (("route", "/v1/completions"), ("status", "200")))]
        == 1.0
    )
    assert values[("epd_stage_duration_seconds_count", (("stage", "decode"),))] == 1.0
    assert values[("epd_stage_duration_seconds_count", (("stage", "prefill"),))] == 1.0
    assert values[("epd_time_to_first_token_seconds_count", ())] == 1.0
    assert values[("epd_inter_token_latency_seconds_count", ())] == 1.0
    assert values[("epd_worker_healthy", (("stage", "decode"), ("worker", "decode-0")))] == 1.0
    assert values[("epd_worker_healthy", (("stage", "decode"), ("worker", "decode-1")))] == 0.0
    assert values[("epd_pool_usable_workers", (("stage", "decode"),))] == 1.0
    assert values[("epd_requests_in_flight", ())] == 0.0
    assert values[("epd_actor_restarts_total", (("stage", "decode"),))] == 0.0


async def test_failed_requests_are_counted_by_error_type() -> None:
    fleet = build_sim_fleet({"pd": 1})
    fleet.engines["pd-0"].config = sim_config(generate_error_rate=1.0)
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        async with router.generate(GenerationRequest(Prompt(text="x"))) as events:
            async for _ in events:
                pass
        await trio.lowlevel.checkpoint()
        values = samples(router.metrics.render())
    assert values[("epd_requests_total", (("outcome", "RemoteWorkerError"),))] == 1.0


async def test_retries_and_refusals_are_exported() -> None:
    from epd_actors.core.config import AdmissionLimits

    fleet = build_sim_fleet({"prefill": 2, "decode": 1})
    fleet.engines["prefill-0"].config = sim_config(prefill_error_rate=1.0)
    config = fleet.router_config()
    config = type(config)(config.pools, admission=AdmissionLimits(max_requests_in_flight=1))
    async with open_router(config, backend_factory=fleet.backend_factory) as router:
        for n in range(2):
            request = GenerationRequest(Prompt(text="x"), request_id=f"r{n}")
            async with router.generate(request) as events:
                assert isinstance([e async for e in events][-1], DoneEvent)
        async with router.generate(GenerationRequest(Prompt(text="a"))) as first:
            async with router.generate(GenerationRequest(Prompt(text="b"))) as second:
                refused = [e async for e in second]
            [e async for e in first]
        values = samples(router.metrics.render())
    assert len(refused) == 1
    assert values[("epd_retries_total", (("stage", "prefill"),))] >= 1.0
    assert values[("epd_admission_refusals_total", ())] == 1.0
    assert values[("epd_actor_queued_jobs", (("stage", "decode"),))] == 0.0
