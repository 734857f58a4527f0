"""The prefix-cache-aware policy: its block keys, its bounded index, and how it decides."""

from __future__ import annotations

import pytest

from epd_actors.core.actors.base import routed_prompt
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.router import open_router
from epd_actors.core.routing import (
    CacheAware,
    Candidate,
    PrefixIndex,
    RouteKey,
    build_policy,
    make_policy,
    prompt_blocks,
)
from epd_actors.errors import ConfigError
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, SamplingParams
from epd_actors.request import GenerationRequest
from epd_actors.testing import build_sim_fleet

WORKERS = ("p-a", "p-b", "p-c")
SYSTEM = "You are a careful assistant. " * 40  # about 1,200 characters: 18 blocks of 64


def idle(*loads: int) -> list[Candidate]:
    return [Candidate(w, n) for w, n in zip(WORKERS, loads or (0,) * len(WORKERS), strict=True)]


def key(prompt: str | tuple[int, ...] | None, affinity: str | None = None) -> RouteKey:
    return RouteKey("r", affinity, prompt)


def blocks(prompt: str | tuple[int, ...]) -> list[int]:
    return prompt_blocks(prompt, block_tokens=16, block_chars=64)


# ---------------------------------------------------------------- block keys


def test_block_keys_name_whole_prefixes() -> None:
    a, b = blocks(SYSTEM + "first question"), blocks(SYSTEM + "another one")
    assert len(a) == len(SYSTEM + "first question") // 64
    shared = len(SYSTEM) // 64
    assert a[:shared] == b[:shared]
    # The same block text after a different prefix is a different key.
    assert blocks("x" * 64 + "y" * 64)[1] != blocks("z" * 64 + "y" * 64)[1]


def test_a_partial_block_and_short_prompts_give_no_key() -> None:
    assert blocks("x" * 63) == []
    assert blocks(tuple(range(15))) == []
    assert len(blocks(tuple(range(40)))) == 2


def test_token_ids_and_text_never_share_keys() -> None:
    assert not set(blocks(tuple(range(64)))) & set(blocks("".join(map(chr, range(64)))))


# ---------------------------------------------------------------- the index


def test_matches_count_leading_blocks_in_a_row() -> None:
    index = PrefixIndex()
    long_prompt = blocks("a" * 64 * 6)
    index.record(long_prompt[:4], "p-a")
    index.record(long_prompt[:2], "p-b")
    assert index.matches(long_prompt, WORKERS) == {"p-a": 4, "p-b": 2, "p-c": 0}


def test_the_index_stays_within_its_bound_under_a_flood_of_distinct_prompts() -> None:
    index = PrefixIndex(max_blocks=100)
    for n in range(1000):
        index.record(blocks(f"prompt {n:06d} " * 20), WORKERS[n % 3])
    assert len(index) == 100
    assert index.evicted == 1000 * len(blocks("prompt 000000 " * 20)) - 100
    newest = blocks("prompt 000999 " * 20)
    assert index.matches(newest, WORKERS)["p-a"] == len(newest)  # 999 % 3 == 0


def test_the_least_recently_used_blocks_go_first() -> None:
    index = PrefixIndex(max_blocks=4)
    old, kept = blocks("o" * 128), blocks("k" * 128)
    index.record(old, "p-a")
    index.record(kept, "p-b")
    index.record(old, "p-a")  # used again: now the most recent
    index.record(blocks("n" * 128), "p-c")
    assert index.matches(old, WORKERS)["p-a"] == 2
    assert index.matches(kept, WORKERS)["p-b"] == 0


# ---------------------------------------------------------------- decisions


def test_a_shared_prefix_goes_back_to_the_worker_that_has_it() -> None:
    policy = CacheAware()
    first = policy.choose(idle(), key(SYSTEM + "question one", "aff-1"))
    assert first is not None
    # Other workers idle, the holder a little busier: the cache still wins.
    loads = {w: (2 if w == first.worker_id else 0) for w in WORKERS}
    candidates = [Candidate(w, loads[w]) for w in WORKERS]
    again = policy.choose(candidates, key(SYSTEM + "question two", "aff-2"))
    assert again is not None
    assert again.worker_id == first.worker_id
    stats = policy.statistics()
    assert (stats.lookups, stats.hits, stats.evicted) == (2, 1, 0)
    assert stats.blocks == len(blocks(SYSTEM + "question two"))  # shared blocks held once


def test_a_match_below_the_threshold_is_routed_as_cold() -> None:
    policy = CacheAware(cache_threshold=0.9)
    policy.index.record(blocks("s" * 64 * 5), "p-c")
    chosen = policy.choose(idle(), key("s" * 64 * 5 + "t" * 64 * 5, "cold"))
    assert chosen is not None
    assert policy.hits == 0
    assert (
        chosen.worker_id
        == make_policy("consistent_hash").choose(idle(), key(None, "cold")).worker_id
    )  # type: ignore[union-attr]


def test_an_out_of_balance_pool_sends_even_a_cached_prefix_to_the_idlest() -> None:
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy.index.record(blocks(SYSTEM), "p-a")
    chosen = policy.choose(idle(10, 3, 5), key(SYSTEM + "more", "aff"))
    assert chosen is not None
    assert chosen.worker_id == "p-b"
    # Within the thresholds (10 - 7 = 3 <= 4), the cache decides.
    fresh = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    fresh.index.record(blocks(SYSTEM), "p-a")
    again = fresh.choose(idle(10, 7, 8), key(SYSTEM + "more", "aff"))
    assert again is not None
    assert again.worker_id == "p-a"


def test_cold_prefixes_land_where_every_router_would_send_them() -> None:
    """Two routers that never talk pick the same worker for a prompt neither has seen."""
    one, two = CacheAware(), CacheAware()
    for n in range(20):
        prompt = f"conversation {n}: " * 10
        a = one.choose(idle(), key(prompt, f"aff-{n}"))
        b = two.choose(idle(), key(prompt, f"aff-{n}"))
        assert a is not None
        assert b is not None
        assert a.worker_id == b.worker_id


def test_without_a_prompt_it_routes_by_affinity_or_load() -> None:
    policy = CacheAware()
    assert policy.choose([], key("x")) is None
    chosen = policy.choose(idle(3, 0, 5), key(None))
    assert chosen is not None
    assert chosen.worker_id == "p-b"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"max_blocks": 0}, "max_blocks"),
        ({"block_size": 16}, "no option block_size"),
    ],
)
def test_options_are_checked(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_policy("cache_aware", options)


def test_options_are_taken() -> None:
    policy = build_policy("cache_aware", {"cache_threshold": 0.3, "balance_abs_threshold": 64})
    assert isinstance(policy, CacheAware)
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.3, 64.0)


# ---------------------------------------------------------------- from the router


def test_the_routed_prompt_of_a_chat_names_roles_text_and_images() -> None:
    image = MediaItem.from_bytes(b"picture", "image/png")
    request = GenerationRequest(
        Prompt(messages=(ChatMessage("system", ("be brief",)), ChatMessage("user", (0, "why?")))),
        media=(image,),
    )
    routed = routed_prompt(request)
    assert isinstance(routed, str)
    assert routed.index("be brief") < routed.index(image.content_hash) < routed.index("why?")
    other = GenerationRequest(request.prompt, media=(MediaItem.from_bytes(b"other", "image/png"),))
    assert routed_prompt(other) != routed
    assert routed_prompt(GenerationRequest(Prompt(token_ids=(1, 2)))) == (1, 2)


async def test_requests_sharing_a_system_prompt_land_on_one_prefill_worker() -> None:
    fleet = build_sim_fleet({"prefill": 3, "decode": 1}, policies={"prefill": "cache_aware"})
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        await router.wait_ready()
        for question in ("what is a block?", "and a page?", "why sixteen?", "who decides?"):
            request = GenerationRequest(
                Prompt(
                    messages=(ChatMessage("system", (SYSTEM,)), ChatMessage("user", (question,)))
                ),
                sampling=SamplingParams(max_tokens=2),
            )
            async with router.generate(request) as events:
                async for _ in events:
                    pass
    served = sorted(
        fleet.counters("prefill")[w].prefill_requests for w in fleet.counters("prefill")
    )
    assert served == [0, 0, 4]


def test_a_pool_s_policy_options_come_from_the_config() -> None:
    pool = PoolConfig(
        "prefill",
        (WorkerEndpoint("p0", "tcp://127.0.0.1:1"),),
        policy="cache_aware",
        policy_options={"cache_threshold": 2},
    )
    with pytest.raises(ConfigError, match=r"pools\.prefill\.policy: .*cache_threshold"):
        RouterConfig((pool,))
