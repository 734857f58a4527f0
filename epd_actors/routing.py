"""Worker-selection policies: which worker of a pool gets the next stage call.

Theory of operation: every stage actor owns one pool of workers and one
:class:`Policy` instance.  For each stage call (one media item for E, one
request for P, D or PD) it builds a snapshot of the workers that may take work
right now -- healthy, not draining, circuit closed -- as a sequence of
:class:`Candidate` values, and asks ``policy.choose(candidates, key)``.  The
policy answers one of those candidates, or ``None`` only when the sequence is
empty (the caller then refuses the request with ``NoHealthyWorker``).

Policies are pure and synchronous: no ``await``, no I/O, no clock and no global
randomness.  Whatever they need arrives as an argument: load as
``Candidate.in_flight``, affinity as ``RouteKey.affinity``, randomness as a
``random.Random`` given at construction (seed it in tests).  A policy's only
state is a cursor (round robin and the tie-break of least-in-flight) that lives
on the instance, so ``choose`` is a small state update in the sense of
convention 14.  The caller owns the load numbers: it increments ``in_flight``
when it assigns a call and decrements it when the call ends, so a fan-out of
several items within one request sees the effect of its own earlier choices.

Retrying elsewhere needs no special API: call ``choose`` again with the failed
worker removed from the candidates.  For :class:`ConsistentHash` that yields the
next worker in the key's rendezvous order, so a retried item still lands on a
predictable worker.

The policies, by configured name:

* ``round_robin`` (:class:`RoundRobin`): strict rotation by worker id; ignores
  load and weight.
* ``random`` (:class:`RandomChoice`): weighted random.
* ``least_in_flight`` (:class:`LeastInFlight`): lowest weighted load; ties
  rotate.
* ``power_of_two`` (:class:`PowerOfTwoChoices`): two weighted random samples,
  the lighter one wins.
* ``consistent_hash`` (:class:`ConsistentHash`): weighted rendezvous hashing of
  the affinity key with a load bound, for encoder-cache, prefix-cache and
  session affinity.

"Load" everywhere means ``(in_flight + 1) / weight``: the load a worker would
carry after taking this call, per unit of capacity.  The ``+ 1`` makes an idle
big worker preferable to an idle small one (HAProxy's weighted ``leastconn``
ranks servers the same way); with equal weights it orders like ``in_flight``.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    "POLICY_NAMES",
    "Candidate",
    "ConsistentHash",
    "LeastInFlight",
    "Policy",
    "PowerOfTwoChoices",
    "RandomChoice",
    "RoundRobin",
    "RouteKey",
    "affinity_for_prompt",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A snapshot of one eligible worker as a policy sees it.

    Attributes:
        worker_id: unique within the pool; round robin and hashing order by it.
        in_flight: stage calls this router has assigned to the worker and not
            yet seen finish.
        weight: relative capacity (> 0, finite); a worker with weight 2 should
            carry twice the load of one with weight 1.

    Raises:
        ValueError: ``in_flight`` is negative or ``weight`` is not a positive,
            finite number.
    """

    worker_id: str
    in_flight: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.in_flight < 0:
            raise ValueError(f"worker {self.worker_id!r}: in_flight must be >= 0")
        if not (0.0 < self.weight < math.inf):
            raise ValueError(f"worker {self.worker_id!r}: weight must be positive and finite")


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a stage call offers a policy for affinity.

    Attributes:
        request_id: the request the call belongs to (for logs and tracing).
        affinity: a stable string that should map to the same worker each time:
            a media item's content hash (E), :func:`affinity_for_prompt` of the
            prompt (P, PD), or a session key.  ``None`` means "no preference".
        adapter: the LoRA adapter the request names, or None; the pool offers
            the policy only the workers that have it loaded, when any has
            room (``WorkerPool.try_lease``).
    """

    request_id: str
    affinity: str | None = None
    adapter: str | None = None


class Policy(Protocol):
    """A worker-selection policy; see the module docstring for the contract."""

    @property
    def name(self) -> str:
        """The configured name of the policy, one of :data:`POLICY_NAMES`."""
        ...

    @property
    def uses_affinity(self) -> bool:
        """Whether ``choose`` reads ``key.affinity`` (callers skip computing it if not)."""
        ...

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Pick one of ``candidates`` for the call described by ``key``.

        Args:
            candidates: the eligible workers, in any order, unique ids.
            key: the call's request id and affinity.

        Returns:
            One element of ``candidates``; ``None`` only when it is empty.
        """
        ...


def _load(candidate: Candidate) -> float:
    """The load ``candidate`` would carry after one more call, per unit of weight."""
    return (candidate.in_flight + 1) / candidate.weight


def _next_after(candidates: Iterable[Candidate], last: str | None) -> Candidate:
    """The candidate whose id follows ``last`` in id order, wrapping around.

    Choosing by id rather than by position keeps a rotation fair while workers
    come and go: a leaving worker shifts nobody's turn, a joining one gets its
    turn when the cursor passes its id.  ``candidates`` must not be empty.
    """
    lowest: Candidate | None = None
    after: Candidate | None = None
    for c in candidates:
        if lowest is None or c.worker_id < lowest.worker_id:
            lowest = c
        is_after = last is not None and c.worker_id > last
        if is_after and (after is None or c.worker_id < after.worker_id):
            after = c
    chosen = after if after is not None else lowest
    if chosen is None:
        raise ValueError("no candidates to choose from")
    return chosen


def _weighted_index(
    rng: random.Random, candidates: Sequence[Candidate], skip: int | None = None
) -> int:
    """An index drawn with probability proportional to weight, never ``skip``."""
    total = math.fsum(c.weight for i, c in enumerate(candidates) if i != skip)
    x = rng.random() * total
    for i, c in enumerate(candidates):
        if i == skip:
            continue
        x -= c.weight
        if x < 0.0:
            return i
    # Rounding left x a hair above zero: the draw belongs to the last eligible.
    last = len(candidates) - 1
    return last - 1 if skip == last else last


class RoundRobin:
    """Strict rotation over the candidates in worker-id order.

    The cursor is the id of the last worker chosen, and it persists across
    calls, so a stream of calls (the items of one fan-out included) spreads
    exactly evenly and never restarts at the first worker per request.  Load
    and weight are ignored; use :class:`LeastInFlight` when calls differ in cost.
    """

    __slots__ = ("_last",)

    name = "round_robin"
    uses_affinity = False

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the worker after the previous choice in id order (see class doc)."""
        if not candidates:
            return None
        chosen = _next_after(candidates, self._last)
        self._last = chosen.worker_id
        return chosen

    def __repr__(self) -> str:
        return f"RoundRobin(last={self._last!r})"


class RandomChoice:
    """A random candidate, with probability proportional to its weight.

    Args:
        rng: the source of randomness; a fresh, OS-seeded one by default.
    """

    __slots__ = ("_rng",)

    name = "random"
    uses_affinity = False

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return a weighted random candidate (see class doc)."""
        if not candidates:
            return None
        return candidates[_weighted_index(self._rng, candidates)]

    def __repr__(self) -> str:
        return "RandomChoice()"


class LeastInFlight:
    """The candidate with the lowest load ``(in_flight + 1) / weight``.

    Ties rotate in worker-id order (the cursor of :class:`RoundRobin`), so idle
    workers share short calls instead of the first one taking them all.
    """

    __slots__ = ("_last",)

    name = "least_in_flight"
    uses_affinity = False

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the least-loaded candidate (see class doc)."""
        if not candidates:
            return None
        best = min(_load(c) for c in candidates)
        chosen = _next_after((c for c in candidates if _load(c) == best), self._last)
        self._last = chosen.worker_id
        return chosen

    def __repr__(self) -> str:
        return f"LeastInFlight(last={self._last!r})"


class PowerOfTwoChoices:
    """Sample two distinct candidates (weighted), keep the one with lower load.

    Nearly as balanced as :class:`LeastInFlight` while looking at two workers
    only, and it keeps several routers that see the same stale load from
    piling onto the same "least loaded" worker.  A tie goes to the first sample.

    Args:
        rng: the source of randomness; a fresh, OS-seeded one by default.
    """

    __slots__ = ("_rng",)

    name = "power_of_two"
    uses_affinity = False

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the lighter of two weighted random samples (see class doc)."""
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        first = _weighted_index(self._rng, candidates)
        second = _weighted_index(self._rng, candidates, skip=first)
        a, b = candidates[first], candidates[second]
        return b if _load(b) < _load(a) else a

    def __repr__(self) -> str:
        return "PowerOfTwoChoices()"


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

    name = "consistent_hash"
    uses_affinity = True

    def __init__(self, *, load_factor: float | None = 1.25, fallback: Policy | None = None) -> None:
        if load_factor is not None and not load_factor >= 1.0:
            raise ConfigError(
                f"consistent_hash load_factor must be >= 1 (or None), got {load_factor!r}"
            )
        self._load_factor = load_factor
        self._fallback: Policy = fallback if fallback is not None else LeastInFlight()

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


POLICY_NAMES: Final = (
    "round_robin",
    "random",
    "least_in_flight",
    "power_of_two",
    "consistent_hash",
)


def _float_option(value: object, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"routing option {option} must be a number, got {value!r}")
    return float(value)


def _make_consistent_hash(rng: random.Random | None, options: dict[str, object]) -> Policy:
    load_factor: float | None = 1.25
    if "load_factor" in options:
        raw = options["load_factor"]
        load_factor = None if raw is None else _float_option(raw, "load_factor")
    fallback: Policy | None = None
    if "fallback" in options:
        name = options["fallback"]
        if not isinstance(name, str) or name == ConsistentHash.name:
            choices = ", ".join(n for n in POLICY_NAMES if n != ConsistentHash.name)
            raise ConfigError(f"routing option fallback must be one of {choices}; got {name!r}")
        fallback = make_policy(name, rng=rng)
    return ConsistentHash(load_factor=load_factor, fallback=fallback)


_OPTIONS: Final[dict[str, frozenset[str]]] = {
    "round_robin": frozenset(),
    "random": frozenset(),
    "least_in_flight": frozenset(),
    "power_of_two": frozenset(),
    "consistent_hash": frozenset({"load_factor", "fallback"}),
}


def make_policy(name: str, *, rng: random.Random | None = None, **options: object) -> Policy:
    """Build a policy from its configured name and options.

    Args:
        name: one of :data:`POLICY_NAMES`.
        rng: randomness for ``random`` and ``power_of_two`` (and for a random
            ``fallback``); ignored by the others.  OS-seeded when ``None``.
        **options: policy options; only ``consistent_hash`` has any:
            ``load_factor`` (number >= 1, or ``None``) and ``fallback`` (the
            name of another policy; default ``least_in_flight``).

    Returns:
        A new policy instance; give each pool its own.

    Raises:
        ConfigError: unknown name, unknown option, or an invalid option value.
    """
    allowed = _OPTIONS.get(name)
    if allowed is None:
        raise ConfigError(
            f"unknown routing policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}"
        )
    unknown = sorted(set(options) - allowed)
    if unknown:
        accepted = ", ".join(sorted(allowed)) or "none"
        raise ConfigError(
            f"routing policy {name!r} has no option {', '.join(unknown)} (accepted: {accepted})"
        )
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng=rng)
    if name == "least_in_flight":
        return LeastInFlight()
    if name == "power_of_two":
        return PowerOfTwoChoices(rng=rng)
    return _make_consistent_hash(rng, options)


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
