"""Prefix-cache-aware routing from what each worker was sent: :class:`CacheAware`.

Theory of operation
-------------------
An engine that has prefilled a prompt keeps its KV blocks until it needs the
memory; a later prompt that starts the same way (a system prompt, a few-shot
preamble, the earlier turns of a conversation) reuses them and skips most of
its prefill.  The router cannot see an engine's cache without its KV events,
but it knows what it sent where.  :class:`PrefixIndex` remembers that, in
blocks: a prompt is cut into blocks (``block_tokens`` token ids, or
``block_chars`` characters when the router has text only), each block is keyed
by a hash chained over every block before it -- so a key names the whole
prefix up to its block, as an engine's block hash does -- and each key maps to
the workers that were sent it.  The keys live in one LRU of at most
``max_blocks`` entries; a prompt's match with a worker is the number of its
leading blocks in a row that the worker has.  This is the approximate tree of
the SGLang gateway's and vllm-router's ``cache_aware`` policies, held as hash
chains rather than a character radix tree (one dictionary lookup per block).

:class:`CacheAware` decides in three steps, with the thresholds of those
routers (their defaults, and ours, in docs/routing.md):

1. **Balance first.**  When the pool is out of balance -- the busiest
   worker's in-flight count exceeds the idlest one's by more than
   ``balance_abs_threshold`` *and* by a factor of more than
   ``balance_rel_threshold`` -- the call goes to the least loaded worker, cache
   or not: one hot prefix must not pile onto one worker.
2. **Cache hits.**  Otherwise, if some worker holds at least
   ``cache_threshold`` of the prompt's blocks, the call goes to the worker
   with the longest match (the least loaded among equals).
3. **Cold prefixes** go where rendezvous hashing of the prompt's affinity key
   sends them (:class:`~.hashing.ConsistentHash`, with its load bound), so
   several routers that never talk pick the same worker for a prefix none of
   them has seen; without an affinity key, to the least loaded worker.

Whatever it chose, the prompt's blocks are recorded for that worker.  Pure
and synchronous, like every policy: the index is the policy's own state, and a
call updates it in the same step it decides.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final

from ...errors import ConfigError
from .base import number_option, register_policy
from .hashing import ConsistentHash
from .simple import LeastInFlight

if TYPE_CHECKING:
    import random
    from collections.abc import Mapping, Sequence

    from .base import Candidate, Policy, RouteKey

BLOCK_TOKENS: Final = 16
"""Token ids per block: vLLM's default KV block size."""

BLOCK_CHARS: Final = 64
"""Characters per block when only text is known (about 16 tokens of English)."""

MAX_BLOCKS: Final = 1 << 18
"""Block keys the index keeps (262,144: under 60 MiB however long the prompts)."""

MAX_PROMPT_BLOCKS: Final = 4096
"""Blocks of one prompt that are matched and recorded (64 Ki tokens at 16 per block)."""


def prompt_blocks(
    prompt: str | tuple[int, ...], *, block_tokens: int, block_chars: int
) -> list[int]:
    """The chained block keys of ``prompt`` (only whole blocks; at most MAX_PROMPT_BLOCKS).

    Key ``i`` hashes key ``i - 1`` with block ``i``, so equal keys mean equal
    prefixes (up to a 64-bit hash collision).  Token ids and text never share
    keys: their blocks are tuples of different element types.  Python's
    ``hash`` is enough: the index is local to this process.
    """
    size = block_chars if isinstance(prompt, str) else block_tokens
    count = min(len(prompt) // size, MAX_PROMPT_BLOCKS)
    keys: list[int] = []
    previous = 0
    for index in range(count):
        previous = hash((previous, prompt[index * size : (index + 1) * size]))
        keys.append(previous)
    return keys


@dataclass(frozen=True, slots=True)
class PrefixIndexStatistics:
    """The index's size and traffic.

    Attributes:
        blocks: block keys held now.
        evicted: block keys dropped to stay within the bound, ever.
        lookups / hits: calls matched, and those that found a worker over the
            cache threshold.
    """

    blocks: int
    evicted: int
    lookups: int
    hits: int


class PrefixIndex:
    """Which workers were sent which prompt blocks; bounded, least recently used first out.

    Args:
        max_blocks: block keys kept (>= 1); the oldest goes when a new one would exceed it.
    """

    __slots__ = ("_blocks", "evicted", "max_blocks")

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, set[str]] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def matches(self, keys: Sequence[int], workers: Sequence[str]) -> dict[str, int]:
        """For each of ``workers``: how many of ``keys``, from the first, it holds in a row."""
        depth = dict.fromkeys(workers, 0)
        alive = set(workers)
        for index, key in enumerate(keys):
            holders = self._blocks.get(key)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            for worker in alive:
                depth[worker] = index + 1
        return depth

    def record(self, keys: Sequence[int], worker: str) -> None:
        """Note that ``worker`` was sent the blocks ``keys`` (they become the most recent)."""
        blocks = self._blocks
        for key in keys:
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = {worker}
            else:
                holders.add(worker)
                blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.evicted += 1


@register_policy
class CacheAware:
    """Route a prompt to the worker most likely to hold its prefix (see the module docstring).

    Args:
        cache_threshold: the share of a prompt's blocks a worker must hold for
            the match to decide (0..1).
        balance_abs_threshold: in-flight calls by which the busiest worker
            must exceed the idlest one, before balance wins over the cache.
        balance_rel_threshold: and the factor by which it must (>= 1).
        block_tokens / block_chars: block sizes for token ids and for text.
        max_blocks: the index's bound (block keys).
        load_factor: the load bound of the rendezvous fallback (>= 1).

    Raises:
        ConfigError: an option out of range.
    """

    __slots__ = (
        "_block_chars",
        "_block_tokens",
        "_cold",
        "_least",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "cache_threshold",
        "hits",
        "index",
        "lookups",
    )

    name: ClassVar[str] = "cache_aware"
    options: ClassVar[frozenset[str]] = frozenset(
        {
            "cache_threshold",
            "balance_abs_threshold",
            "balance_rel_threshold",
            "block_tokens",
            "block_chars",
            "max_blocks",
            "load_factor",
        }
    )
    uses_affinity: ClassVar[bool] = True
    uses_prompt: ClassVar[bool] = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.1,
        block_tokens: int = BLOCK_TOKENS,
        block_chars: int = BLOCK_CHARS,
        max_blocks: int = MAX_BLOCKS,
        load_factor: float = 1.25,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._block_tokens = block_tokens
        self._block_chars = block_chars
        self.index = PrefixIndex(max_blocks)
        self._least = LeastInFlight()
        self._cold = ConsistentHash(load_factor=load_factor, fallback=self._least)
        self.lookups = 0
        self.hits = 0

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """From the options named in the class docstring (each checked for its range)."""
        share = number_option(options, "cache_threshold", 0.5, minimum=0.0)
        if share > 1.0:
            raise ConfigError(f"routing option cache_threshold must be <= 1, got {share!r}")
        return cls(
            cache_threshold=share,
            balance_abs_threshold=number_option(options, "balance_abs_threshold", 32, minimum=0),
            balance_rel_threshold=number_option(options, "balance_rel_threshold", 1.1, minimum=1),
            block_tokens=int(number_option(options, "block_tokens", BLOCK_TOKENS, minimum=1)),
            block_chars=int(number_option(options, "block_chars", BLOCK_CHARS, minimum=1)),
            max_blocks=int(number_option(options, "max_blocks", MAX_BLOCKS, minimum=1)),
            load_factor=number_option(options, "load_factor", 1.25, minimum=1),
        )

    def prompt_keys(self, prompt: str | tuple[int, ...]) -> list[int]:
        """The block keys this policy's index uses for ``prompt``."""
        return prompt_blocks(prompt, block_tokens=self._block_tokens, block_chars=self._block_chars)

    def statistics(self) -> PrefixIndexStatistics:
        return PrefixIndexStatistics(len(self.index), self.index.evicted, self.lookups, self.hits)

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Balance, then the longest cached prefix, then rendezvous; record the choice."""
        if not candidates:
            return None
        if key.prompt is None:
            return self._cold.choose(candidates, key)
        keys = prompt_blocks(
            key.prompt, block_tokens=self._block_tokens, block_chars=self._block_chars
        )
        chosen = self._decide(candidates, key, keys)
        self.index.record(keys, chosen.worker_id)
        return chosen

    def _decide(self, candidates: Sequence[Candidate], key: RouteKey, keys: list[int]) -> Candidate:
        if self._out_of_balance(candidates):
            return self._pick(self._least, candidates, key)
        self.lookups += 1
        if keys:
            depth = self.index.matches(keys, [c.worker_id for c in candidates])
            best = max(depth.values())
            if best > 0 and best >= self.cache_threshold * len(keys):
                self.hits += 1
                holders = [c for c in candidates if depth[c.worker_id] == best]
                return self._pick(self._least, holders, key)
        return self._pick(self._cold, candidates, key)

    def _out_of_balance(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.in_flight / c.weight for c in candidates]
        busiest, idlest = max(loads), min(loads)
        return (
            busiest - idlest > self.balance_abs_threshold
            and busiest > self.balance_rel_threshold * idlest
        )

    @staticmethod
    def _pick(policy: Policy, candidates: Sequence[Candidate], key: RouteKey) -> Candidate:
        chosen = policy.choose(candidates, key)
        assert chosen is not None  # candidates is never empty here
        return chosen

    def __repr__(self) -> str:
        return (
            f"CacheAware(cache_threshold={self.cache_threshold!r}, "
            f"balance=({self.balance_abs_threshold!r}, {self.balance_rel_threshold!r}), "
            f"blocks={len(self.index)})"
        )
