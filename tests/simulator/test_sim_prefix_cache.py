"""The simulator's prefix cache: prefill time on uncached tokens, counters, token ids."""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry

from epd_actors.protocol import (
    ChatMessage,
    GenerateRequest,
    MediaItem,
    PrefillRequest,
    Prompt,
    Role,
    SamplingParams,
)
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.kv_events import sim_worker_kv_events
from epd_actors.simulator.prefix_cache import prompt_token_ids
from epd_actors.simulator.store import create_sim_stores
from epd_actors.simulator.text import count_prompt_tokens

TEXT = " ".join(f"w{i}" for i in range(64))  # 64 tokens: 4 blocks of 16


def engine(role: Role = Role.PREFILL, **knobs) -> SimEngine:
    stores = create_sim_stores()
    config = SimConfig(prefill_token_s=0.001, prefix_cache_blocks=64, **knobs)
    return SimEngine(role, worker_id="w", config=config, ec_store=stores.ec, kv_store=stores.kv)


async def test_a_repeated_prompt_prefills_only_its_uncached_tokens(autojump_clock):
    sim = engine()
    first = await sim.prefill(PrefillRequest("a", Prompt(text=TEXT)))
    again = await sim.prefill(PrefillRequest("b", Prompt(text=TEXT)))
    longer = await sim.prefill(PrefillRequest("c", Prompt(text=TEXT + " tail words")))
    assert round(first.timings["prefill_s"], 6) == 0.064
    assert round(again.timings["prefill_s"], 6) == 0.001  # the last token is always computed
    assert round(longer.timings["prefill_s"], 6) == 0.002
    assert sim.prefix_cache is not None
    counters = sim.prefix_cache.counters()
    assert (counters.queries, counters.hit_tokens, counters.blocks) == (3, 127, 4)


async def test_pd_prefills_through_the_cache_and_decode_has_none(autojump_clock):
    pd = engine(Role.PD)
    sampling = SamplingParams(max_tokens=1)

    async def emit(delta):
        await trio.lowlevel.checkpoint()

    for rid in ("a", "b"):
        await pd.generate(GenerateRequest(rid, Prompt(text=TEXT), sampling=sampling), emit)
    assert pd.prefix_cache is not None
    assert pd.prefix_cache.counters().hit_tokens == 63
    assert engine(Role.DECODE).prefix_cache is None
    assert engine(Role.ENCODE).prefix_cache is None


def test_prompt_token_ids_are_deterministic_and_counted_like_the_text_model():
    image = MediaItem.from_bytes(b"png-a", "image/png")
    chat = Prompt(messages=(ChatMessage("user", ("look at", 0, "this picture")),))
    ids = prompt_token_ids(chat, (image,), 8)
    assert len(ids) == count_prompt_tokens(chat, (image,), 8) == 12
    assert ids == prompt_token_ids(chat, (image,), 8)
    other = MediaItem.from_bytes(b"png-b", "image/png")
    assert prompt_token_ids(chat, (other,), 8)[2:10] != ids[2:10]
    assert prompt_token_ids(Prompt(token_ids=(5, 6)), (), 0) == [5, 6]


def test_the_worker_exports_hit_counters():
    sim = engine()
    registry = CollectorRegistry()
    with sim_worker_kv_events(sim, registry=registry) as publisher:
        assert publisher is None  # no endpoint: metrics only
        assert sim.prefix_cache is not None
        sim.prefix_cache.begin([1] * 16)
        assert registry.get_sample_value("epd_sim_prefix_cache_queries_total", {"worker": "w"}) == 1
        assert registry.get_sample_value("epd_sim_prefix_cache_blocks", {"worker": "w"}) == 0
    assert registry.get_sample_value("epd_sim_prefix_cache_queries_total", {"worker": "w"}) is None
