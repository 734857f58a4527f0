"""The kv_aware policy: cost over the exact index, fallbacks, the gate, near-equals; tokenizers."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from epd_actors.core.routing import Candidate, KVAware, RouteKey, make_policy, prompt_tokenizer
from epd_actors.core.routing.tokenizers import SimTokenizer, build_tokenizer
from epd_actors.errors import ConfigError
from epd_actors.kv_events import BlockStored, FeedState, KVBlockIndex
from epd_actors.protocol import ChatMessage, MediaItem, Prompt
from epd_actors.request import GenerationRequest
from epd_actors.simulator.prefix_cache import prompt_token_ids

if TYPE_CHECKING:
    from pathlib import Path

BS = 4
PROMPT = tuple(range(100, 132))  # 8 blocks of 4


class FakeView:
    """A pool's feeds as the policy reads them: an index, and a state per worker."""

    def __init__(self) -> None:
        self.index = KVBlockIndex()
        self.states: dict[str, FeedState] = {}

    def state(self, worker_id: str) -> FeedState:
        return self.states.get(worker_id, FeedState.FALLBACK)

    def holds(self, worker_id: str, tokens: tuple[int, ...], *, first_hash: int = 0) -> None:
        """``worker_id``'s engine stored every full block of ``tokens`` (an exact feed)."""
        blocks = len(tokens) // BS
        hashes = tuple(first_hash + i for i in range(blocks))
        event = BlockStored(hashes, None, tokens[: blocks * BS], BS, None, "GPU", None)
        self.index.apply(worker_id, [event])
        self.states[worker_id] = FeedState.EXACT


def policy(view: FakeView | None = None, **options: object) -> KVAware:
    built = make_policy("kv_aware", rng=random.Random(7), **options)
    assert isinstance(built, KVAware)
    if view is not None:
        built.bind_kv_view(view)
    return built


def key(tokens: tuple[int, ...] | None = PROMPT, n: int = 0) -> RouteKey:
    return RouteKey(f"r{n}", affinity=f"a{n}", prompt=tokens, token_ids=tokens)


def exact_view(*workers: str) -> FakeView:
    view = FakeView()
    for w in workers:
        view.states[w] = FeedState.EXACT
    return view


def test_the_worker_holding_the_prefix_gets_the_call() -> None:
    view = exact_view("a", "b", "c")
    view.holds("b", PROMPT[:24], first_hash=50)  # 6 of 8 blocks
    view.holds("c", PROMPT[:8], first_hash=90)  # 2 of 8 blocks
    chosen = policy(view).choose([Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)], key())
    assert chosen is not None
    assert chosen.worker_id == "b"


def primed(kv: KVAware) -> KVAware:
    """One cold call of 8 blocks: the mean prefill work per call is 8 blocks from now on."""
    kv.choose([Candidate("a", 0)], key(tuple(range(900, 932)), 99))
    assert kv.stats.cold == 1
    return kv


def test_the_first_call_knows_no_load_cost_yet() -> None:
    view = exact_view("a", "b")
    view.holds("a", PROMPT[:8])
    chosen = policy(view).choose([Candidate("a", 3), Candidate("b", 0)], key())
    assert chosen is not None
    assert chosen.worker_id == "a"


def test_load_outweighs_a_small_cache_advantage() -> None:
    view = exact_view("a", "b")
    view.holds("a", PROMPT[:8])  # 2 blocks saved on a
    kv = primed(policy(view))
    # a: 6 uncached + 3 in flight x 8 blocks; b: 8 uncached + 0.
    chosen = kv.choose([Candidate("a", 3), Candidate("b", 0)], key())
    assert chosen is not None
    assert chosen.worker_id == "b"
    assert kv.stats.exact == 1


def test_a_heavier_load_weight_moves_the_call_off_a_full_hit() -> None:
    view = exact_view("a", "b")
    view.holds("a", PROMPT)
    candidates = [Candidate("a", 2), Candidate("b", 0)]
    cheap = primed(policy(view, load_weight=0.1)).choose(candidates, key())
    dear = primed(policy(view, load_weight=1.0)).choose(candidates, key())
    assert cheap is not None
    assert cheap.worker_id == "a"
    assert dear is not None
    assert dear.worker_id == "b"


def test_a_prompt_nobody_holds_enough_of_goes_by_rendezvous() -> None:
    view = exact_view("a", "b", "c")
    view.holds("a", PROMPT[:4])  # 1 of 8 blocks: under min_match 0.25
    kv = policy(view, min_match=0.25)
    candidates = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    rendezvous = make_policy("consistent_hash").choose(candidates, key())
    chosen = kv.choose(candidates, key())
    assert chosen == rendezvous
    assert kv.stats.cold == 1
    assert kv.stats.exact == 0


def test_without_any_exact_feed_the_choice_is_cache_aware_s() -> None:
    view = FakeView()  # every worker in fallback
    kv = policy(view)
    twin = make_policy("cache_aware")
    candidates = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    for n in range(6):
        k = key(PROMPT[: 8 + n], n)
        assert kv.choose(candidates, k) == twin.choose(candidates, k)
    assert kv.stats.approximate == 6


def test_without_a_view_or_tokens_the_choice_is_cache_aware_s() -> None:
    candidates = [Candidate("a", 0), Candidate("b", 0)]
    unbound = policy()
    assert unbound.choose(candidates, key()) is not None
    view = exact_view("a", "b")
    view.holds("a", PROMPT)
    no_tokens = RouteKey("r", affinity="x", prompt="some text")
    bound = policy(view)
    bound.choose(candidates, no_tokens)
    assert unbound.stats.approximate == 1
    assert bound.stats.approximate == 1
    assert bound.choose([], key()) is None


def test_a_worker_that_is_not_exact_is_judged_by_what_it_was_sent() -> None:
    view = exact_view("a")
    view.holds("a", PROMPT[:4])  # a: exact, 1 block
    view.states["b"] = FeedState.DEGRADED  # b: entries incomplete
    kv = policy(view, min_match=0.1)
    candidates = [Candidate("a", 0), Candidate("b", 0)]
    kv.approximate.index.record(kv.approximate.prompt_keys(PROMPT), "b")  # b was sent it all
    chosen = kv.choose(candidates, key())
    assert chosen is not None
    assert chosen.worker_id == "b"
    assert kv.stats.exact == 1


def test_near_equals_split_by_power_of_two_and_the_choice_is_recorded() -> None:
    view = exact_view("a", "b", "c", "d")
    for w in "abcd":
        view.holds(w, PROMPT, first_hash=ord(w) * 100)
    kv = policy(view)
    candidates = [Candidate(w, 0) for w in "abcd"]
    picks = {kv.choose(candidates, key(PROMPT, n)).worker_id for n in range(40)}  # type: ignore[union-attr]
    assert picks == set("abcd")
    depth = kv.approximate.index.matches(kv.approximate.prompt_keys(PROMPT), list("abcd"))
    assert max(depth.values()) == 2  # 32 tokens = 2 blocks of 16 in the approximate index


def test_of_two_near_equals_the_less_loaded_wins() -> None:
    view = exact_view("a", "b")
    view.holds("a", PROMPT, first_hash=1)
    view.holds("b", PROMPT, first_hash=500)
    kv = policy(view, load_weight=0.0)  # costs equal whatever the load
    for n in range(10):
        chosen = kv.choose([Candidate("a", 5), Candidate("b", 1)], key(PROMPT, n))
        assert chosen is not None
        assert chosen.worker_id == "b"


def test_blocks_of_another_adapter_do_not_match() -> None:
    view = exact_view("a", "b")
    view.holds("a", PROMPT)
    kv = policy(view)
    k = RouteKey("r", affinity="x", prompt=PROMPT, adapter="sql", token_ids=PROMPT)
    kv.choose([Candidate("a", 0), Candidate("b", 0)], k)
    assert kv.stats.cold == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tokenizer": "nope"}, "unknown tokenizer 'nope'"),
        ({"tokenizer": 3}, "tokenizer must be a name"),
        ({"min_match": 1.5}, "min_match must be <= 1"),
        ({"overlap_weight": -1}, "overlap_weight must be >= 0"),
        ({"load_factor": 0.5}, "load_factor must be >= 1"),
        ({"cache_threshold": 2}, "cache_threshold must be <= 1"),
        ({"media_tokens_per_item": -1}, "media_tokens_per_item"),
        ({"tokenizer_path": "x"}, "tokenizer 'sim' takes no option tokenizer_path"),
        ({"tokenizer": "hf"}, "tokenizer_path"),
        ({"tokenizer": "hf", "tokenizer_path": "/nonexistent.json"}, "cannot load"),
        ({"tokenizer": "hf", "tokenizer_path": "x", "add_special_tokens": 1}, "boolean"),
        ({"nonsense": 1}, "has no option nonsense"),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_policy("kv_aware", **options)


# -- tokenizers


def test_the_sim_tokenizer_gives_the_simulator_s_own_token_ids() -> None:
    image = MediaItem.from_bytes(b"png", "image/png")
    chat = Prompt(messages=(ChatMessage("user", ("look at", 0, "this")),))
    request = GenerationRequest(chat, media=(image,))
    tokenizer = SimTokenizer(media_tokens_per_item=8)
    assert tokenizer.token_ids(request) == tuple(prompt_token_ids(chat, (image,), 8))
    assert len(tokenizer.token_ids(request) or ()) == 2 + 8 + 1
    ids = GenerationRequest(Prompt(token_ids=(5, 6, 7)))
    assert tokenizer.token_ids(ids) == (5, 6, 7)


def test_the_hf_tokenizer_reads_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tokenizer = build_tokenizer("hf", {"tokenizer_path": str(path)})
    assert tokenizer.token_ids(GenerationRequest(Prompt(text="hello world what"))) == (1, 2, 0)
    assert tokenizer.token_ids(GenerationRequest(Prompt(token_ids=(9, 9)))) == (9, 9)
    chat = Prompt(messages=(ChatMessage("user", ("hello",)),))
    assert tokenizer.token_ids(GenerationRequest(chat)) is None  # the template is the engine's
    policy = make_policy("kv_aware", tokenizer="hf", tokenizer_path=str(path))
    assert isinstance(policy, KVAware)


def test_a_missing_tokenizers_library_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ConfigError, match=r"pip install 'epd_actors\[hf-tokenizer\]'"):
        build_tokenizer("hf", {"tokenizer_path": "tokenizer.json"})


class _Holder:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer


class _NotATokenizer:
    token_ids = "not callable"


def test_a_policy_s_tokenizer_is_found_by_its_token_ids_method() -> None:
    sim = SimTokenizer()
    assert prompt_tokenizer(_Holder(sim)) is sim
    assert prompt_tokenizer(object()) is None  # a policy without a tokenizer
    assert prompt_tokenizer(_Holder(None)) is None
    assert prompt_tokenizer(_Holder(object())) is None
    assert prompt_tokenizer(_Holder(_NotATokenizer())) is None
