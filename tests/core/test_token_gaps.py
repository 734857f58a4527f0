"""Inter-token latency as vLLM shapes it: one observation per gap between output tokens."""

from __future__ import annotations

import trio
import trio.testing

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.metrics import RouterMetrics
from epd_actors.core.output_relay import OutputRelay
from epd_actors.core.token_gaps import TOKEN_GAP_BUCKETS, TokenGaps
from epd_actors.protocol import Delta
from epd_actors.request import DoneEvent, GenerationEvent
from epd_actors.testing import build_sim_fleet, sim_config
from tests.core.test_metrics import samples
from tests.core.test_output_relay import Progress

LE_10MS = TOKEN_GAP_BUCKETS.index(0.01)
LE_25MS = TOKEN_GAP_BUCKETS.index(0.025)


def test_a_delta_of_k_tokens_is_k_gaps_of_its_share() -> None:
    gaps = TokenGaps()
    gaps.add(0.0, 3)  # the first delta: no gap before it, its own tokens none either
    assert gaps.observed == 0
    assert gaps.total_s == 0.0
    gaps.add(0.01, 1)  # exactly on a bound: counted in that bucket (le)
    gaps.add(0.05, 2)  # 40 ms over 2 tokens: 2 gaps of 20 ms
    gaps.add(10.05, 1)  # longer than every bound
    assert gaps.counts[LE_10MS] == 1
    assert gaps.counts[LE_25MS] == 2
    assert gaps.counts[-1] == 1
    assert gaps.observed == 4
    assert abs(gaps.total_s - 10.05) < 1e-9


async def test_the_relay_counts_gaps_of_deltas_with_tokens_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send, receive = trio.open_memory_channel[GenerationEvent](8)
    gaps = TokenGaps()
    relay = OutputRelay(send, Progress(), 2.0, gaps=gaps)
    assert relay.offer(Delta("r", token_ids=(1,), text="a"))
    await trio.sleep(0.005)
    assert relay.offer(Delta("r"))  # a sign of life, no token: no gap
    await trio.sleep(0.005)
    assert relay.offer(Delta("r", text="b"))  # text without token ids: no gap either
    await trio.sleep(0.01)
    await relay.put(Delta("r", token_ids=(2, 3), text="cd"))
    assert gaps.observed == 2
    assert gaps.counts[LE_10MS] == 2  # 20 ms since the last token, shared by 2
    assert abs(gaps.total_s - 0.02) < 1e-9
    receive.close()


def test_finished_requests_add_up_in_the_histogram() -> None:
    metrics = RouterMetrics()
    for _ in range(2):
        gaps = TokenGaps()
        for n, at in enumerate((0.0, 0.004, 0.024, 0.040)):  # 4 ms, 20 ms, 2 x 8 ms
            gaps.add(at, 1 + (n == 3))
        metrics.inter_token.add(gaps.counts, gaps.total_s)
    values = samples(metrics.render())
    bucket = "epd_inter_token_latency_seconds_bucket"
    assert values[(bucket, (("le", "0.001"),))] == 0.0
    assert values[(bucket, (("le", "0.005"),))] == 2.0
    assert values[(bucket, (("le", "0.01"),))] == 6.0  # cumulative, as Prometheus reads it
    assert values[(bucket, (("le", "0.025"),))] == 8.0
    assert values[(bucket, (("le", "+Inf"),))] == 8.0
    assert values[("epd_inter_token_latency_seconds_count", ())] == 8.0
    assert abs(values[("epd_inter_token_latency_seconds_sum", ())] - 0.08) < 1e-9


async def test_a_paced_stream_gives_one_observation_per_gap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = build_sim_fleet({"pd": 1}, config=sim_config(output_token_s=0.02))
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        for n in range(3):
            request = GenerationRequest(
                Prompt(text="paced"), sampling=SamplingParams(max_tokens=5), request_id=f"r{n}"
            )
            async with router.generate(request) as events:
                assert isinstance([event async for event in events][-1], DoneEvent)
        values = samples(router.metrics.render())
    bucket = "epd_inter_token_latency_seconds_bucket"
    assert values[("epd_inter_token_latency_seconds_count", ())] == 3 * 4
    assert values[(bucket, (("le", "0.01"),))] == 0.0
    assert values[(bucket, (("le", "0.025"),))] == 12.0
    assert abs(values[("epd_inter_token_latency_seconds_sum", ())] - 12 * 0.02) < 1e-6
