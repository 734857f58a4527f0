"""Routing on the engines' real cache state, from their KV events: :class:`KVAware`.

Theory of operation
-------------------
A pool with ``kv_events`` on keeps an exact index of every worker's cached
blocks (:mod:`epd_actors.kv_events`, wired by :mod:`epd_actors.core.kv_feeds`)
and hands it to its policy as a :class:`KVView` (``bind_kv_view``).  The
request's token ids come from the policy's tokenizer
(:mod:`.tokenizers`, the ``tokenizer`` option), computed by the actor into
``RouteKey.token_ids``.  For each candidate the policy then knows how many
prompt tokens it holds:

- a worker whose feed is ``exact``: its leading matched blocks, from the index;
- any other worker (``degraded``, ``fallback``): the approximate estimate, the
  share of the prompt the approximate ``cache_aware`` index says it was sent,
  times the prompt's tokens.

The decision, in the shape of Dynamo's KV router (``overlap_weight x prefill
blocks + decode blocks``, lower is better):

1. **No exact feed or no tokens**: the approximate ``cache_aware`` choice
   (balance, its own prefix index, rendezvous for cold prefixes).
   **A cold prompt** -- no candidate holds (or, not exact, is estimated to
   hold) at least ``min_match`` of the prompt's tokens: rendezvous hashing of
   the prompt's affinity key within ``load_factor`` (``consistent_hash``), so
   several routers agree on where a new prefix goes.
2. **Cost** per candidate: ``overlap_weight x uncached blocks +
   load_weight x (in_flight / weight) x mean prefill blocks``.  The router
   cannot see a worker's queue; a worker's in-flight calls times the mean
   prefill work (uncached blocks) of the calls this policy placed stands in
   for the work ahead of the new call there.
3. **Power of two among near-equals**: of the candidates whose cost is within
   ``tie_tolerance`` of the best (relative, at least one block), two are drawn
   at random and the cheaper one wins (the less loaded on a tie), so routers
   that see the same index do not all pile onto one worker.

Whatever is chosen is recorded in the approximate index as well, so a worker
that falls back finds it warm.  Pure and synchronous; randomness passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from ...errors import ConfigError
from ...kv_events.feed import FeedState
from .base import number_option, register_policy
from .cache_aware import BLOCK_TOKENS, CacheAware
from .hashing import ConsistentHash
from .simple import LeastInFlight
from .tokenizers import build_tokenizer

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ...kv_events.index import KVBlockIndex
    from ...request import GenerationRequest
    from .base import Candidate, Policy, PromptTokenizer, RouteKey

__all__ = ["KVAware", "KVAwareStatistics", "KVView", "KVViewConsumer"]

_TOKENIZER_OPTIONS = frozenset({"media_tokens_per_item", "tokenizer_path", "add_special_tokens"})
_OWN_OPTIONS = frozenset(
    {"tokenizer", "overlap_weight", "load_weight", "min_match", "tie_tolerance"}
)


class KVView(Protocol):
    """What the policy reads of a pool's KV feeds (``kv_feeds.PoolKVFeeds``)."""

    @property
    def index(self) -> KVBlockIndex:
        """The pool's block index."""
        ...

    def state(self, worker_id: str) -> FeedState:
        """How far the index can be trusted for ``worker_id``."""
        ...


@runtime_checkable
class KVViewConsumer(Protocol):
    """A policy that reads a pool's KV feeds; the router binds them at start-up."""

    def bind_kv_view(self, view: KVView) -> None:
        """Read ``view`` from now on."""
        ...


@dataclass(slots=True)
class KVAwareStatistics:
    """Decisions of one :class:`KVAware` by kind (totals since it was built).

    Attributes:
        exact: calls decided by the cost over the index.
        cold: calls with tokens and an exact feed whose prompt no candidate
            held enough of (rendezvous).
        approximate: calls without tokens, or without any exact feed among
            the candidates (``cache_aware``).
    """

    exact: int = 0
    cold: int = 0
    approximate: int = 0


@register_policy
class KVAware:
    """Route to the worker whose cache, per its KV events, makes the call cheapest.

    Args:
        tokenizer: turns a request into the engines' token ids.
        approximate: the ``cache_aware`` policy used where the index is not exact.
        overlap_weight: weight of an uncached prompt block in the cost (>= 0).
        load_weight: weight of the in-flight load in the cost (>= 0).
        min_match: the share of the prompt (0..1) some candidate must hold
            for the cache to decide; below it the call is cold.
        tie_tolerance: how far above the best cost (relative) a candidate is
            still a near-equal (>= 0).
        load_factor: the load bound of the rendezvous for cold prompts (>= 1).
        rng: randomness for the power-of-two draw.
    """

    __slots__ = (
        "_approx",
        "_block",
        "_cold",
        "_mean_blocks",
        "_noted",
        "_rng",
        "_view",
        "load_weight",
        "min_match",
        "overlap_weight",
        "stats",
        "tie_tolerance",
        "tokenizer",
    )

    name: ClassVar[str] = "kv_aware"
    options: ClassVar[frozenset[str]] = CacheAware.options | _OWN_OPTIONS | _TOKENIZER_OPTIONS
    uses_affinity: ClassVar[bool] = True
    uses_prompt: ClassVar[bool] = True

    def __init__(
        self,
        *,
        tokenizer: PromptTokenizer,
        approximate: CacheAware | None = None,
        overlap_weight: float = 1.0,
        load_weight: float = 1.0,
        min_match: float = 0.1,
        tie_tolerance: float = 0.1,
        load_factor: float = 1.25,
        rng: random.Random | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._approx = approximate if approximate is not None else CacheAware()
        self._cold = ConsistentHash(load_factor=load_factor, fallback=LeastInFlight())
        self.overlap_weight = overlap_weight
        self.load_weight = load_weight
        self.min_match = min_match
        self.tie_tolerance = tie_tolerance
        self._rng = rng if rng is not None else random.Random()
        self._view: KVView | None = None
        self._mean_blocks = 0.0
        self._noted = False
        self._block = BLOCK_TOKENS  # the engines' block size, once an event told it
        self.stats = KVAwareStatistics()

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """From the options in docs/routing.md; the tokenizer's own are passed to it."""
        name = options.get("tokenizer", "sim")
        if not isinstance(name, str):
            raise ConfigError(f"routing option tokenizer must be a name, got {name!r}")
        tokenizer = build_tokenizer(
            name, {k: v for k, v in options.items() if k in _TOKENIZER_OPTIONS}
        )
        approx = CacheAware.build(
            rng, {k: v for k, v in options.items() if k in CacheAware.options}
        )
        assert isinstance(approx, CacheAware)
        share = number_option(options, "min_match", 0.1, minimum=0.0)
        if share > 1.0:
            raise ConfigError(f"routing option min_match must be <= 1, got {share!r}")
        return cls(
            tokenizer=tokenizer,
            approximate=approx,
            overlap_weight=number_option(options, "overlap_weight", 1.0, minimum=0.0),
            load_weight=number_option(options, "load_weight", 1.0, minimum=0.0),
            min_match=share,
            tie_tolerance=number_option(options, "tie_tolerance", 0.1, minimum=0.0),
            load_factor=number_option(options, "load_factor", 1.25, minimum=1),
            rng=rng,
        )

    @property
    def approximate(self) -> CacheAware:
        """The ``cache_aware`` policy used where the index is not exact."""
        return self._approx

    def bind_kv_view(self, view: KVView) -> None:
        """Read the pool's KV feeds from now on (the router calls this at start-up)."""
        self._view = view

    def uncached_tokens(
        self, request: GenerationRequest, adapter: str | None, workers: Sequence[str]
    ) -> int | None:
        """The fewest prompt tokens any of ``workers`` lacks, by the index.

        A worker whose feed is not exact counts as holding nothing (the
        estimate errs towards prefilling remotely).  None when the tokenizer
        gives no tokens.
        """
        tokens = self.tokenizer.token_ids(request)
        if tokens is None:
            return None
        view = self._view
        exact = [] if view is None else [w for w in workers if view.state(w) is FeedState.EXACT]
        if view is None or not exact:
            return len(tokens)
        index = view.index
        matched = index.match(tokens, lora_name=adapter, workers=exact)
        best = max(matched[w] * (index.block_size(w) or self._block) for w in exact)
        return max(0, len(tokens) - best)

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """The approximate choice, or the cheapest near-equal by the cost (module docstring)."""
        if not candidates:
            return None
        view, tokens = self._view, key.token_ids
        exact = (
            set()
            if view is None or not tokens
            else {c.worker_id for c in candidates if view.state(c.worker_id) is FeedState.EXACT}
        )
        if view is None or not tokens or not exact:
            self.stats.approximate += 1
            return self._approx.choose(candidates, key)
        cached, block = self._cached_tokens(view, candidates, exact, tokens, key)
        total = len(tokens)
        if max(cached.values()) < max(1.0, self.min_match * total):
            self.stats.cold += 1
            cold = self._cold.choose(candidates, key)
            assert cold is not None
            self._note_work((total - cached[cold.worker_id]) / block)
            self._record(key, cold.worker_id)
            return cold
        self.stats.exact += 1
        uncached = {c.worker_id: (total - cached[c.worker_id]) / block for c in candidates}
        costs = {
            c.worker_id: self.overlap_weight * uncached[c.worker_id]
            + self.load_weight * c.in_flight / c.weight * self._mean_blocks
            for c in candidates
        }
        chosen = self._near_equal_choice(candidates, costs)
        self._note_work(uncached[chosen.worker_id])
        self._record(key, chosen.worker_id)
        return chosen

    def _note_work(self, blocks: float) -> None:
        """Fold one call's prefill work (uncached blocks) into the running mean."""
        weight = 0.05 if self._noted else 1.0
        self._noted = True
        self._mean_blocks += (blocks - self._mean_blocks) * weight

    def _cached_tokens(
        self,
        view: KVView,
        candidates: Sequence[Candidate],
        exact: set[str],
        tokens: tuple[int, ...],
        key: RouteKey,
    ) -> tuple[dict[str, float], int]:
        """Prompt tokens each candidate holds (exact, or estimated), and the block size."""
        index = view.index
        matched = index.match(tokens, lora_name=key.adapter, workers=exact)
        sizes = [index.block_size(w) for w in exact]
        block = next((s for s in sizes if s), self._block)
        self._block = block
        cached: dict[str, float] = {
            w: float(matched[w] * (index.block_size(w) or block)) for w in exact
        }
        others = [c.worker_id for c in candidates if c.worker_id not in exact]
        if others:
            keys = self._approx_keys(key)
            depth = self._approx.index.matches(keys, others) if keys else {}
            for w in others:
                share = depth.get(w, 0) / len(keys) if keys else 0.0
                cached[w] = share * len(tokens)
        return cached, block

    def _near_equal_choice(
        self, candidates: Sequence[Candidate], costs: dict[str, float]
    ) -> Candidate:
        best = min(costs.values())
        bound = best + self.tie_tolerance * max(best, 1.0)
        near = [c for c in candidates if costs[c.worker_id] <= bound]
        if len(near) == 1:
            return near[0]
        first, second = self._rng.sample(near, 2)
        rank_first = (costs[first.worker_id], first.in_flight / first.weight)
        rank_second = (costs[second.worker_id], second.in_flight / second.weight)
        return first if rank_first <= rank_second else second

    def _approx_keys(self, key: RouteKey) -> list[int]:
        return [] if key.prompt is None else self._approx.prompt_keys(key.prompt)

    def _record(self, key: RouteKey, worker_id: str) -> None:
        keys = self._approx_keys(key)
        if keys:
            self._approx.index.record(keys, worker_id)

    def __repr__(self) -> str:
        return (
            f"KVAware(overlap_weight={self.overlap_weight!r}, load_weight={self.load_weight!r}, "
            f"min_match={self.min_match!r}, bound={self._view is not None})"
        )
