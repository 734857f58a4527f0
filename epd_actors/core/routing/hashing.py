"""Affinity routing: weighted rendezvous hashing with a load bound, and prompt affinity keys."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, ClassVar, Final

from ...errors import ConfigError
from .base import make_policy, number_option, policy_names, register_policy
from .simple import LeastInFlight

if TYPE_CHECKING:
    import random
    from collections.abc import Mapping, Sequence

    from .base import Candidate, Policy, RouteKey


# 2**53: the scores use the top 53 bits of a hash, all a float holds exactly.
_UNIT: Final = float(1 << 53)


def _rendezvous_order(candidates: Sequence[Candidate], affinity: str) -> list[Candidate]:
    """``candidates`` from most to least preferred for ``affinity``.

    Weighted rendezvous hashing (the "logarithmic method"): each worker scores
    ``weight / -ln(u)`` with ``u`` uniform in (0, 1) drawn from a BLAKE2b digest
    of (affinity, worker id); the highest score wins.  A worker's share of keys
    is its share of the total weight, and adding or removing one worker moves
    only the keys that worker gains or loses.  BLAKE2b, unlike ``hash()``, is
    the same in every process and every router.
    """
    raw = affinity.encode("utf-8", "surrogatepass")
    # Length-prefixing the affinity keeps (affinity, worker id) pairs unambiguous.
    prefix = hashlib.blake2b(len(raw).to_bytes(8, "big") + raw, digest_size=8)
    scored: list[tuple[float, str, Candidate]] = []
    for c in candidates:
        h = prefix.copy()
        h.update(c.worker_id.encode("utf-8", "surrogatepass"))
        u = ((int.from_bytes(h.digest(), "big") >> 11) + 0.5) / _UNIT
        scored.append((c.weight / -math.log(u), c.worker_id, c))
    scored.sort(key=lambda item: (-item[0], item[1]))
    return [c for _, _, c in scored]


@register_policy
class ConsistentHash:
    """Affinity routing: the same ``key.affinity`` goes to the same worker.

    Uses weighted rendezvous hashing over worker ids (see
    :func:`_rendezvous_order`), so when a worker leaves only its keys move, and
    when one joins it takes about ``1/n`` of the keys from the others.

    Bounded load: a worker keeps a key only while
    ``in_flight <= load_factor * (fair_share + 1)``, where ``fair_share`` is the
    pool's total ``in_flight`` times the worker's share of the total weight (with
    equal weights: the mean ``in_flight``).  Otherwise the key spills to the next
    worker in its rendezvous order that is within the bound.  The worker with
    the lowest ``in_flight / weight`` always is (``load_factor >= 1``), so a
    choice always exists.  The
    ``+ 1`` keeps affinity intact at low load, where one call more or less is
    noise.

    Calls without an affinity go to ``fallback``.

    Args:
        load_factor: how far above its fair share a worker may run before its
            keys spill (>= 1); ``None`` disables the bound (pure affinity).
        fallback: the policy for calls whose ``key.affinity`` is ``None``;
            a new :class:`LeastInFlight` by default.

    Raises:
        ConfigError: ``load_factor`` is below 1 or not a number.
    """

    __slots__ = ("_fallback", "_load_factor")

    name: ClassVar[str] = "consistent_hash"
    options: ClassVar[frozenset[str]] = frozenset({"load_factor", "fallback"})
    uses_affinity: ClassVar[bool] = True
    uses_prompt: ClassVar[bool] = False

    def __init__(self, *, load_factor: float | None = 1.25, fallback: Policy | None = None) -> None:
        if load_factor is not None and not load_factor >= 1.0:
            raise ConfigError(
                f"consistent_hash load_factor must be >= 1 (or None), got {load_factor!r}"
            )
        self._load_factor = load_factor
        self._fallback: Policy = fallback if fallback is not None else LeastInFlight()

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """From ``load_factor`` (>= 1, or ``None`` for no bound) and ``fallback`` (a name)."""
        load_factor: float | None = None
        if options.get("load_factor", 1.25) is not None:
            load_factor = number_option(options, "load_factor", 1.25, minimum=1.0)
        fallback: Policy | None = None
        if "fallback" in options:
            name = options["fallback"]
            if not isinstance(name, str) or name == cls.name:
                choices = ", ".join(n for n in policy_names() if n != cls.name)
                raise ConfigError(f"routing option fallback must be one of {choices}; got {name!r}")
            fallback = make_policy(name, rng=rng)
        return cls(load_factor=load_factor, fallback=fallback)

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the key's preferred worker within the load bound (see class doc)."""
        if not candidates:
            return None
        if key.affinity is None:
            return self._fallback.choose(candidates, key)
        ranked = _rendezvous_order(candidates, key.affinity)
        factor = self._load_factor
        if factor is None:
            return ranked[0]
        total_in_flight = sum(c.in_flight for c in candidates)
        total_weight = math.fsum(c.weight for c in candidates)
        for c in ranked:
            fair_share = total_in_flight * c.weight / total_weight
            if c.in_flight <= factor * (fair_share + 1.0):
                return c
        # Unreachable in exact arithmetic (see class doc); keep affinity if rounding bites.
        return ranked[0]

    def __repr__(self) -> str:
        return f"ConsistentHash(load_factor={self._load_factor!r}, fallback={self._fallback!r})"


def affinity_for_prompt(text: str, prefix_chars: int = 256) -> str:
    """A stable affinity key for prefix-cache routing of P and PD calls.

    Prompts that share their first ``prefix_chars`` characters (a system prompt,
    a few-shot preamble, an earlier turn of the conversation) get the same key,
    so :class:`ConsistentHash` sends them to the worker whose prefix cache
    already holds those blocks.  Pass the text in the order the model sees it
    (the rendered chat, or the messages concatenated); shorter prompts hash
    whole.  Characters, not tokens: cheap, and close enough to pick a worker.

    Args:
        text: the prompt text.
        prefix_chars: how many leading characters decide the key (> 0).

    Returns:
        32 hex digits (a 128-bit BLAKE2b digest), the same in every process.

    Raises:
        ValueError: ``prefix_chars`` is not positive.
    """
    if prefix_chars <= 0:
        raise ValueError(f"prefix_chars must be positive, got {prefix_chars}")
    prefix = text[:prefix_chars].encode("utf-8", "surrogatepass")
    return hashlib.blake2b(prefix, digest_size=16, person=b"epd-prompt").hexdigest()
