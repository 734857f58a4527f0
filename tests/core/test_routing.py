"""Tests for the worker-selection policies in epd_actors.core.routing.

Every test is synchronous and deterministic: randomness comes from seeded
``random.Random`` instances, and the load-balancing tests simulate assignment
and completion by hand instead of running anything.
"""

from __future__ import annotations

import collections
import math
import random
from typing import TYPE_CHECKING

import pytest

from epd_actors.core.routing import (
    POLICY_NAMES,
    CacheAware,
    Candidate,
    ConsistentHash,
    LeastInFlight,
    Policy,
    PowerOfTwoChoices,
    RandomChoice,
    RoundRobin,
    RouteKey,
    affinity_for_prompt,
    make_policy,
)
from epd_actors.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

KEY = RouteKey("req-1")
ENCODERS = ("enc-a", "enc-b", "enc-c")
# With ENCODERS idle and equal weights, the rendezvous order of "img-1" is
# enc-a, enc-b, enc-c (pinned by test_fixed_choice and checked again below).
IMG1 = RouteKey("req-1", affinity="img-1")


def idle(*worker_ids: str) -> list[Candidate]:
    return [Candidate(w, 0) for w in worker_ids]


def loaded(loads: dict[str, int], weights: dict[str, float] | None = None) -> list[Candidate]:
    weights = weights or {}
    return [Candidate(w, n, weights.get(w, 1.0)) for w, n in loads.items()]


def with_load(candidates: Sequence[Candidate], counts: dict[str, int]) -> list[Candidate]:
    return [Candidate(c.worker_id, counts[c.worker_id], c.weight) for c in candidates]


def chosen_id(policy: Policy, candidates: Sequence[Candidate], key: RouteKey = KEY) -> str:
    choice = policy.choose(candidates, key)
    assert choice is not None
    assert choice in candidates
    return choice.worker_id


def seeded(factory: Callable[..., Policy]) -> Callable[[], Policy]:
    return lambda: factory(rng=random.Random(1234))


# ----------------------------------------------------------- common contract


@pytest.mark.parametrize("affinity", [None, "img-1"], ids=["no-affinity", "affinity"])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_candidates_return_none(name: str, affinity: str | None) -> None:
    policy = make_policy(name, rng=random.Random(0))
    assert policy.choose([], RouteKey("r", affinity)) is None


@pytest.mark.parametrize("affinity", [None, "img-1"], ids=["no-affinity", "affinity"])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_single_candidate_is_always_chosen(name: str, affinity: str | None) -> None:
    policy = make_policy(name, rng=random.Random(0))
    only = [Candidate("w", 7, 0.5)]
    for _ in range(5):
        assert policy.choose(only, RouteKey("r", affinity)) is only[0]


@pytest.mark.parametrize(
    ("factory", "candidates", "key", "expected"),
    [
        pytest.param(RoundRobin, idle("c", "a", "b"), KEY, "a", id="round-robin-starts-lowest-id"),
        pytest.param(
            LeastInFlight, loaded({"a": 3, "b": 1, "c": 2}), KEY, "b", id="least-in-flight-lowest"
        ),
        pytest.param(
            LeastInFlight,
            loaded({"a": 3, "b": 1}, {"a": 4.0}),
            KEY,
            "a",
            id="least-in-flight-per-weight",
        ),
        pytest.param(
            LeastInFlight,
            loaded({"a": 0, "b": 0}, {"b": 2.0}),
            KEY,
            "b",
            id="least-in-flight-idle-prefers-bigger",
        ),
        pytest.param(
            seeded(PowerOfTwoChoices),
            loaded({"a": 5, "b": 1}),
            KEY,
            "b",
            id="power-of-two-pair-takes-lighter",
        ),
        pytest.param(
            seeded(RandomChoice),
            loaded({"a": 0, "b": 0}, {"a": 1e-12}),
            KEY,
            "b",
            id="random-negligible-weight-never-drawn",
        ),
        pytest.param(ConsistentHash, idle(*ENCODERS), IMG1, "enc-a", id="hash-img-1"),
        pytest.param(
            ConsistentHash, idle(*ENCODERS), RouteKey("r", "img-3"), "enc-c", id="hash-img-3"
        ),
        pytest.param(
            ConsistentHash, idle(*ENCODERS), RouteKey("r", "img-4"), "enc-b", id="hash-img-4"
        ),
        pytest.param(
            ConsistentHash,
            loaded({"enc-a": 2, "enc-b": 0, "enc-c": 1}),
            KEY,
            "enc-b",
            id="hash-no-affinity-falls-back-to-least-in-flight",
        ),
        pytest.param(
            lambda: ConsistentHash(fallback=RoundRobin()),
            loaded({"enc-c": 0, "enc-b": 9, "enc-a": 9}),
            KEY,
            "enc-a",
            id="hash-no-affinity-custom-fallback",
        ),
    ],
)
def test_fixed_choice(
    factory: Callable[[], Policy], candidates: list[Candidate], key: RouteKey, expected: str
) -> None:
    assert chosen_id(factory(), candidates, key) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"weight": 0.0}, id="zero-weight"),
        pytest.param({"weight": -1.0}, id="negative-weight"),
        pytest.param({"weight": math.nan}, id="nan-weight"),
        pytest.param({"weight": math.inf}, id="infinite-weight"),
        pytest.param({"in_flight": -1}, id="negative-in-flight"),
    ],
)
def test_candidate_rejects_bad_values(kwargs: dict[str, float]) -> None:
    fields: dict[str, float] = {"in_flight": 0, "weight": 1.0, **kwargs}
    with pytest.raises(ValueError, match="worker 'w'"):
        Candidate("w", int(fields["in_flight"]), fields["weight"])


# --------------------------------------------------------------- round robin


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [("a b c", "a"), ("a b c", "b"), ("a b c", "c"), ("a b c", "a")], id="steady-rotation"
        ),
        pytest.param([("c a b", "a"), ("b c a", "b"), ("a c b", "c")], id="input-order-irrelevant"),
        pytest.param(
            [("a b c", "a"), ("a b c", "b"), ("a c", "c"), ("a c", "a")],
            id="last-chosen-leaves-nobody-skipped",
        ),
        pytest.param(
            [("a b c", "a"), ("a c", "c"), ("a b c", "a"), ("a b c", "b")],
            id="next-in-line-leaves-only-it-skipped",
        ),
        pytest.param(
            [("a b c", "a"), ("a b c", "b"), ("a b c", "c"), ("b c", "b")],
            id="first-leaves-at-wrap",
        ),
        pytest.param(
            [("a c", "a"), ("a b c", "b"), ("a b c", "c"), ("a b c", "a")],
            id="joiner-after-cursor-gets-its-turn-now",
        ),
        pytest.param(
            [("b c", "b"), ("a b c", "c"), ("a b c", "a"), ("a b c", "b")],
            id="joiner-before-cursor-waits-for-wrap",
        ),
        pytest.param([("a b c", "a"), ("d", "d"), ("a b c d", "a")], id="whole-pool-replaced"),
        pytest.param([("w1 w10 w2", "w1"), ("w1 w10 w2", "w10")], id="ids-order-as-strings"),
    ],
)
def test_round_robin_continues_across_membership_changes(steps: list[tuple[str, str]]) -> None:
    policy = RoundRobin()
    got = [chosen_id(policy, idle(*pool.split())) for pool, _ in steps]
    assert got == [expected for _, expected in steps]


@pytest.mark.parametrize(
    ("workers", "requests", "fanout"),
    [
        pytest.param(3, 999, 1, id="3-workers-single-calls"),
        pytest.param(3, 600, 2, id="3-workers-fanout-2"),
        pytest.param(4, 500, 3, id="4-workers-fanout-3"),
        pytest.param(5, 100, 5, id="5-workers-fanout-5"),
    ],
)
def test_round_robin_is_exactly_fair(workers: int, requests: int, fanout: int) -> None:
    policy = RoundRobin()
    pool = idle(*(f"w{i}" for i in range(workers)))
    counts: collections.Counter[str] = collections.Counter()
    for r in range(requests):
        for _ in range(fanout):
            counts[chosen_id(policy, pool, RouteKey(f"req-{r}"))] += 1
    assert set(counts.values()) == {requests * fanout // workers}


def test_round_robin_stays_fair_through_leave_and_rejoin() -> None:
    policy = RoundRobin()
    phases = [("w0 w1 w2 w3", 400), ("w0 w1 w3", 300), ("w0 w1 w2 w3", 400)]
    for pool, calls in phases:
        counts = collections.Counter(chosen_id(policy, idle(*pool.split())) for _ in range(calls))
        assert set(counts.values()) == {calls // len(pool.split())}, pool


# ------------------------------------------------------------ random choices


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param([1.0, 1.0, 1.0, 1.0], id="equal"),
        pytest.param([1.0, 2.0, 3.0], id="1-2-3"),
        pytest.param([0.5, 0.5, 3.0], id="one-big"),
    ],
)
def test_random_choice_follows_weights(weights: list[float]) -> None:
    policy = RandomChoice(rng=random.Random(42))
    pool = [Candidate(f"w{i}", 0, w) for i, w in enumerate(weights)]
    draws = 20_000
    counts = collections.Counter(chosen_id(policy, pool) for _ in range(draws))
    total = sum(weights)
    for i, w in enumerate(weights):
        assert counts[f"w{i}"] / draws == pytest.approx(w / total, abs=0.015)


@pytest.mark.parametrize("name", ["random", "power_of_two"])
def test_same_seed_same_choices(name: str) -> None:
    pool = loaded({"a": 1, "b": 2, "c": 0, "d": 3})
    first = make_policy(name, rng=random.Random(7))
    second = make_policy(name, rng=random.Random(7))
    assert [chosen_id(first, pool) for _ in range(50)] == [
        chosen_id(second, pool) for _ in range(50)
    ]


def simulate(
    policy: Policy,
    pool: Sequence[Candidate],
    *,
    steps: int,
    concurrency: int,
    seed: int = 99,
) -> tuple[collections.Counter[str], int]:
    """Assign ``steps`` calls; keep at most ``concurrency`` in flight by completing
    a uniformly random in-flight call after each assignment.  Returns
    (assignments per worker, the largest spread of in_flight / weight seen right
    after an assignment, rounded up)."""
    sim = random.Random(seed)
    in_flight = {c.worker_id: 0 for c in pool}
    running: list[str] = []
    assigned: collections.Counter[str] = collections.Counter()
    spread = 0.0
    for _ in range(steps):
        worker = chosen_id(policy, with_load(pool, in_flight))
        in_flight[worker] += 1
        running.append(worker)
        assigned[worker] += 1
        per_weight = [in_flight[c.worker_id] / c.weight for c in pool]
        spread = max(spread, max(per_weight) - min(per_weight))
        if len(running) > concurrency:
            done = running.pop(sim.randrange(len(running)))
            in_flight[done] -= 1
    return assigned, math.ceil(spread)


@pytest.mark.parametrize(
    ("weights", "max_spread"),
    [
        pytest.param([1.0, 1.0, 1.0, 1.0], 10, id="equal"),
        pytest.param([1.0, 1.0, 2.0], 10, id="one-double"),
    ],
)
def test_power_of_two_balances_under_load(weights: list[float], max_spread: int) -> None:
    pool = [Candidate(f"w{i}", 0, w) for i, w in enumerate(weights)]
    steps = 8_000
    assigned, spread = simulate(
        PowerOfTwoChoices(rng=random.Random(5)), pool, steps=steps, concurrency=40
    )
    _, blind_spread = simulate(
        RandomChoice(rng=random.Random(5)), pool, steps=steps, concurrency=40
    )
    total = sum(weights)
    for i, w in enumerate(weights):
        assert assigned[f"w{i}"] / steps == pytest.approx(w / total, abs=0.03)
    # Two looks at the load keep the spread far below load-blind random choice.
    assert spread <= max_spread
    assert spread * 2 <= blind_spread


# ----------------------------------------------------------- least in flight


def test_least_in_flight_rotates_ties() -> None:
    policy = LeastInFlight()
    pool = idle("c", "a", "b")
    assert [chosen_id(policy, pool) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("concurrency", [3, 10, 37], ids=lambda n: f"concurrency-{n}")
def test_least_in_flight_keeps_loads_within_one(concurrency: int) -> None:
    pool = idle("w0", "w1", "w2", "w3")
    _, spread = simulate(LeastInFlight(), pool, steps=2_000, concurrency=concurrency)
    assert spread <= 1


@pytest.mark.parametrize(
    ("weights", "calls", "expected"),
    [
        pytest.param({"a": 1.0, "b": 1.0}, 400, {"a": 200, "b": 200}, id="equal"),
        pytest.param({"a": 1.0, "b": 3.0}, 400, {"a": 100, "b": 300}, id="1-to-3"),
        pytest.param(
            {"a": 1.0, "b": 2.0, "c": 5.0}, 800, {"a": 100, "b": 200, "c": 500}, id="1-2-5"
        ),
    ],
)
def test_least_in_flight_fills_by_weight(
    weights: dict[str, float], calls: int, expected: dict[str, int]
) -> None:
    policy = LeastInFlight()
    in_flight = dict.fromkeys(weights, 0)
    for _ in range(calls):
        pool = [Candidate(w, in_flight[w], weight) for w, weight in weights.items()]
        in_flight[chosen_id(policy, pool)] += 1
    for worker, count in expected.items():
        assert abs(in_flight[worker] - count) <= 2, in_flight


# ----------------------------------------------------------- consistent hash


def keys(n: int) -> list[RouteKey]:
    return [RouteKey(f"req-{i}", affinity=f"sha256:{i:08x}") for i in range(n)]


def assignment(policy: Policy, pool: Sequence[Candidate], route_keys: list[RouteKey]) -> list[str]:
    return [chosen_id(policy, pool, key) for key in route_keys]


def test_consistent_hash_is_stable() -> None:
    pool = idle(*(f"w{i}" for i in range(5)))
    shuffled = list(reversed(pool))
    route_keys = keys(300)
    first = assignment(ConsistentHash(), pool, route_keys)
    assert assignment(ConsistentHash(), shuffled, route_keys) == first
    assert assignment(ConsistentHash(), pool, route_keys) == first
    assert len(set(first)) == 5


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param([1.0] * 5, id="equal-5"),
        pytest.param([1.0, 1.0, 2.0], id="one-double"),
        pytest.param([0.5, 1.0, 1.5, 3.0], id="mixed"),
    ],
)
def test_consistent_hash_spreads_keys_by_weight(weights: list[float]) -> None:
    pool = [Candidate(f"w{i}", 0, w) for i, w in enumerate(weights)]
    route_keys = keys(6_000)
    counts = collections.Counter(assignment(ConsistentHash(), pool, route_keys))
    total = sum(weights)
    for i, w in enumerate(weights):
        assert counts[f"w{i}"] / len(route_keys) == pytest.approx(w / total, abs=0.025)


@pytest.mark.parametrize("leaving", ["w0", "w2", "w4"])
def test_consistent_hash_leave_moves_only_the_leavers_keys(leaving: str) -> None:
    pool = idle(*(f"w{i}" for i in range(5)))
    route_keys = keys(3_000)
    before = assignment(ConsistentHash(), pool, route_keys)
    after = assignment(ConsistentHash(), [c for c in pool if c.worker_id != leaving], route_keys)
    moved = 0
    for old, new in zip(before, after, strict=True):
        if old == leaving:
            assert new != leaving
            moved += 1
        else:
            assert new == old
    assert moved / len(route_keys) == pytest.approx(1 / 5, abs=0.03)


@pytest.mark.parametrize("joining", ["w5", "a-new", "zz"])
def test_consistent_hash_join_moves_about_one_nth_to_the_joiner(joining: str) -> None:
    pool = idle(*(f"w{i}" for i in range(5)))
    route_keys = keys(3_000)
    before = assignment(ConsistentHash(), pool, route_keys)
    after = assignment(ConsistentHash(), [*pool, Candidate(joining, 0)], route_keys)
    moved = [new for old, new in zip(before, after, strict=True) if new != old]
    assert set(moved) == {joining}
    assert len(moved) / len(route_keys) == pytest.approx(1 / 6, abs=0.03)


def test_consistent_hash_weight_increase_moves_keys_only_to_that_worker() -> None:
    pool = idle(*(f"w{i}" for i in range(4)))
    heavier = [Candidate(c.worker_id, 0, 2.0 if c.worker_id == "w1" else 1.0) for c in pool]
    route_keys = keys(2_000)
    before = assignment(ConsistentHash(), pool, route_keys)
    after = assignment(ConsistentHash(), heavier, route_keys)
    assert {new for old, new in zip(before, after, strict=True) if new != old} == {"w1"}


def test_img1_rendezvous_order_is_a_b_c() -> None:
    pure = ConsistentHash(load_factor=None)
    assert chosen_id(pure, idle(*ENCODERS), IMG1) == "enc-a"
    assert chosen_id(pure, idle("enc-b", "enc-c"), IMG1) == "enc-b"


@pytest.mark.parametrize(
    ("loads", "weights", "load_factor", "expected"),
    [
        pytest.param((0, 0, 0), None, 1.25, "enc-a", id="idle-keeps-affinity"),
        pytest.param((1, 0, 0), None, 1.25, "enc-a", id="low-load-keeps-affinity"),
        pytest.param((3, 0, 0), None, 1.25, "enc-b", id="low-load-over-bound-spills"),
        pytest.param((16, 10, 10), None, 1.25, "enc-a", id="within-25-percent-keeps"),
        pytest.param((17, 10, 10), None, 1.25, "enc-b", id="over-25-percent-spills"),
        pytest.param((10, 10, 0), None, 1.25, "enc-c", id="spill-walks-rendezvous-order"),
        pytest.param((3, 0, 0), None, 2.0, "enc-a", id="looser-factor-keeps"),
        pytest.param((100, 0, 0), None, None, "enc-a", id="no-bound-pure-affinity"),
        pytest.param((6, 1, 1), None, 1.25, "enc-b", id="unweighted-spills"),
        pytest.param((6, 1, 1), (3.0, 1.0, 1.0), 1.25, "enc-a", id="weighted-share-keeps"),
    ],
)
def test_consistent_hash_bounded_load(
    loads: tuple[int, int, int],
    weights: tuple[float, float, float] | None,
    load_factor: float | None,
    expected: str,
) -> None:
    weights = weights or (1.0, 1.0, 1.0)
    pool = [Candidate(w, n, wt) for w, n, wt in zip(ENCODERS, loads, weights, strict=True)]
    assert chosen_id(ConsistentHash(load_factor=load_factor), pool, IMG1) == expected


def test_consistent_hash_spill_goes_to_next_in_rendezvous_order() -> None:
    pool = idle(*(f"w{i}" for i in range(6)))
    policy = ConsistentHash()
    for key in keys(300):
        preferred = chosen_id(policy, pool, key)
        hot = [Candidate(c.worker_id, 50 if c.worker_id == preferred else 2) for c in pool]
        rest = [c for c in pool if c.worker_id != preferred]
        assert chosen_id(policy, hot, key) == chosen_id(policy, rest, key)


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 3.0])
def test_consistent_hash_choice_always_within_bound(load_factor: float) -> None:
    sim = random.Random(11)
    policy = ConsistentHash(load_factor=load_factor)
    for key in keys(500):
        pool = [
            Candidate(f"w{i}", sim.choice([0, 0, 1, 5, 40]), sim.choice([0.5, 1.0, 2.0]))
            for i in range(sim.randint(1, 6))
        ]
        choice = policy.choose(pool, key)
        assert choice is not None
        total = sum(c.in_flight for c in pool)
        share = total * choice.weight / sum(c.weight for c in pool)
        assert choice.in_flight <= load_factor * (share + 1)


# ----------------------------------------------------------------- factory


POLICY_CLASSES: dict[str, type] = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_in_flight": LeastInFlight,
    "power_of_two": PowerOfTwoChoices,
    "consistent_hash": ConsistentHash,
    "cache_aware": CacheAware,
}


@pytest.mark.parametrize(("name", "cls"), POLICY_CLASSES.items(), ids=POLICY_CLASSES.keys())
def test_make_policy_builds_each_name(name: str, cls: type) -> None:
    policy = make_policy(name)
    assert isinstance(policy, cls)
    assert policy.name == name
    assert repr(policy).startswith(f"{cls.__name__}(")


def test_policy_names_are_exactly_the_factory_names() -> None:
    assert sorted(POLICY_NAMES) == sorted(POLICY_CLASSES)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        pytest.param(
            "round-robin",
            {},
            "choose one of: round_robin, random, least_in_flight, power_of_two, consistent_hash, "
            "cache_aware",
            id="unknown-name-lists-choices",
        ),
        pytest.param(
            "least_in_flight",
            {"load_factor": 2},
            "has no option load_factor \\(accepted: none\\)",
            id="option-on-policy-without-options",
        ),
        pytest.param(
            "consistent_hash",
            {"load_facter": 2},
            "accepted: fallback, load_factor",
            id="misspelled-option",
        ),
        pytest.param(
            "consistent_hash", {"load_factor": 0.5}, "must be >= 1", id="load-factor-below-one"
        ),
        pytest.param(
            "consistent_hash", {"load_factor": math.nan}, "must be >= 1", id="load-factor-nan"
        ),
        pytest.param(
            "consistent_hash", {"load_factor": "high"}, "must be a number", id="load-factor-text"
        ),
        pytest.param(
            "consistent_hash", {"load_factor": True}, "must be a number", id="load-factor-bool"
        ),
        pytest.param(
            "consistent_hash",
            {"fallback": "consistent_hash"},
            "fallback must be one of round_robin, random, least_in_flight, power_of_two",
            id="fallback-to-itself",
        ),
        pytest.param(
            "consistent_hash", {"fallback": 3}, "fallback must be one of", id="fallback-not-a-name"
        ),
        pytest.param(
            "consistent_hash",
            {"fallback": "fastest"},
            "unknown routing policy 'fastest'",
            id="fallback-unknown-name",
        ),
    ],
)
def test_make_policy_rejects_bad_config(
    name: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_policy(name, rng=None, **options)


def test_make_policy_consistent_hash_options_take_effect() -> None:
    policy = make_policy("consistent_hash", load_factor=None, fallback="round_robin")
    hot = loaded({"enc-a": 100, "enc-b": 0, "enc-c": 0})
    assert chosen_id(policy, hot, IMG1) == "enc-a"
    assert [chosen_id(policy, hot) for _ in range(4)] == ["enc-a", "enc-b", "enc-c", "enc-a"]


def test_make_policy_integer_load_factor() -> None:
    policy = make_policy("consistent_hash", load_factor=2)
    assert chosen_id(policy, loaded({"enc-a": 3, "enc-b": 0, "enc-c": 0}), IMG1) == "enc-a"


# ------------------------------------------------------------ prompt affinity


@pytest.mark.parametrize(
    ("first", "second", "prefix_chars", "same"),
    [
        pytest.param("S" * 256 + "question one", "S" * 256 + "two", 256, True, id="shared-prefix"),
        pytest.param("S" * 255 + "X tail", "S" * 255 + "Y tail", 256, False, id="differs-inside"),
        pytest.param("hello world", "hello there", 5, True, id="short-prefix-option"),
        pytest.param("abc", "abcd", 256, False, id="short-prompts-hash-whole"),
        pytest.param("caf\u00e9 \U0001f600", "caf\u00e9 \U0001f600", 256, True, id="unicode"),
    ],
)
def test_affinity_for_prompt_prefixes(
    first: str, second: str, prefix_chars: int, same: bool
) -> None:
    a = affinity_for_prompt(first, prefix_chars)
    b = affinity_for_prompt(second, prefix_chars)
    assert (a == b) is same


def test_affinity_for_prompt_is_a_pinned_digest() -> None:
    # Pinned: a change would reshuffle every prefix cache after an upgrade.
    assert affinity_for_prompt("You are a helpful assistant.") == "a742570f88a97502e65e1dd757233114"


@pytest.mark.parametrize("prefix_chars", [0, -1])
def test_affinity_for_prompt_rejects_bad_prefix(prefix_chars: int) -> None:
    with pytest.raises(ValueError, match="prefix_chars"):
        affinity_for_prompt("text", prefix_chars)


def test_consistent_hash_config_error_from_constructor() -> None:
    with pytest.raises(ConfigError, match="load_factor"):
        ConsistentHash(load_factor=0.9)


def test_only_the_affinity_policies_read_the_affinity_and_the_prompt() -> None:
    readers = {name for name in POLICY_NAMES if make_policy(name).uses_affinity}
    assert readers == {"consistent_hash", "cache_aware"}
    assert {name for name in POLICY_NAMES if make_policy(name).uses_prompt} == {"cache_aware"}
