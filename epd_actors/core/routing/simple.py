"""The policies that look at load only: round robin, random, least in flight, power of two."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from .base import (
    StatelessPolicy,
    load_after_one,
    next_after,
    register_policy,
    weighted_index,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from .base import Candidate, Policy, RouteKey


class RotatingPolicy(StatelessPolicy):
    """A policy with a cursor: the id of the last worker it chose (see :func:`next_after`)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: str | None = None

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """A new instance (no options, no randomness)."""
        return cls()

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Each rotating policy narrows the candidates in its own way, then rotates."""
        raise NotImplementedError

    def _rotate(self, candidates: Iterable[Candidate]) -> Candidate:
        """The candidate after the cursor in id order (``candidates`` not empty); moves it."""
        chosen = next_after(candidates, self._last)
        self._last = chosen.worker_id
        return chosen


@register_policy
class RoundRobin(RotatingPolicy):
    """Strict rotation over the candidates in worker-id order.

    The cursor is the id of the last worker chosen, and it persists across
    calls, so a stream of calls (the items of one fan-out included) spreads
    exactly evenly and never restarts at the first worker per request.  Load
    and weight are ignored; use :class:`LeastInFlight` when calls differ in cost.
    """

    __slots__ = ()

    name = "round_robin"

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the worker after the previous choice in id order (see class doc)."""
        return self._rotate(candidates) if candidates else None

    def __repr__(self) -> str:
        return f"RoundRobin(last={self._last!r})"


class RandomizedPolicy(StatelessPolicy):
    """A policy that draws: it takes the ``rng`` it is built with (OS-seeded when None)."""

    __slots__ = ("_rng",)

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    @classmethod
    def build(cls, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """A new instance drawing from ``rng`` (no options)."""
        return cls(rng=rng)

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Each randomized policy draws in its own way."""
        raise NotImplementedError


@register_policy
class RandomChoice(RandomizedPolicy):
    """A random candidate, with probability proportional to its weight.

    Args:
        rng: the source of randomness; a fresh, OS-seeded one by default.
    """

    __slots__ = ()

    name = "random"

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return a weighted random candidate (see class doc)."""
        if not candidates:
            return None
        return candidates[weighted_index(self._rng, candidates)]

    def __repr__(self) -> str:
        return "RandomChoice()"


@register_policy
class LeastInFlight(RotatingPolicy):
    """The candidate with the lowest load ``(in_flight + 1) / weight``.

    Ties rotate in worker-id order (the cursor of :class:`RoundRobin`), so idle
    workers share short calls instead of the first one taking them all.
    """

    __slots__ = ()

    name = "least_in_flight"

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the least-loaded candidate (see class doc)."""
        if not candidates:
            return None
        best = min(load_after_one(c) for c in candidates)
        return self._rotate([c for c in candidates if load_after_one(c) == best])

    def __repr__(self) -> str:
        return f"LeastInFlight(last={self._last!r})"


@register_policy
class PowerOfTwoChoices(RandomizedPolicy):
    """Sample two distinct candidates (weighted), keep the one with lower load.

    Nearly as balanced as :class:`LeastInFlight` while looking at two workers
    only, and it keeps several routers that see the same stale load from
    piling onto the same "least loaded" worker.  A tie goes to the first sample.

    Args:
        rng: the source of randomness; a fresh, OS-seeded one by default.
    """

    __slots__ = ()

    name = "power_of_two"

    def choose(self, candidates: Sequence[Candidate], key: RouteKey) -> Candidate | None:
        """Return the lighter of two weighted random samples (see class doc)."""
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        first = weighted_index(self._rng, candidates)
        second = weighted_index(self._rng, candidates, skip=first)
        a, b = candidates[first], candidates[second]
        return b if load_after_one(b) < load_after_one(a) else a

    def __repr__(self) -> str:
        return "PowerOfTwoChoices()"
