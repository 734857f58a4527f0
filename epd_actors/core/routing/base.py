"""The routing contract: candidates, route keys, the :class:`Policy` protocol, the registry.

Everything a policy module needs and nothing else; pure and synchronous.  See
the package docstring for the theory of operation.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final, Protocol, TypeVar, runtime_checkable

from ...errors import ConfigError

if TYPE_CHECKING:
    import random
    from collections.abc import Iterable, Mapping, Sequence

    from ...request import GenerationRequest


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
        prompt: the prompt as the model will see it, in order -- token ids
            when the router has them, else text (media named by content hash)
            -- for policies that match it against what each worker was sent
            (:class:`~.cache_aware.CacheAware`).  ``None``: not computed,
            because the pool's policy does not read it.
        adapter: the LoRA adapter the request names, or None; the pool offers
            the policy only the workers that have it loaded, when any has
            room (``WorkerPool.try_lease``).
        token_ids: the prompt's token ids as the engines will see them, from
            the policy's own tokenizer (``policy.tokenizer``, see
            :func:`prompt_tokenizer`); None when the policy has none or it
            could not tokenize the prompt.
    """

    request_id: str
    affinity: str | None = None
    prompt: str | tuple[int, ...] | None = None
    adapter: str | None = None
    token_ids: tuple[int, ...] | None = None


class Policy(Protocol):
    """A worker-selection policy; see the module docstring for the contract."""

    @property
    def name(self) -> str:
        """The configured name of the policy (its registry key)."""
        ...

    @property
    def uses_affinity(self) -> bool:
        """Whether ``choose`` reads ``key.affinity`` (callers skip computing it if not)."""
        ...

    @property
    def uses_prompt(self) -> bool:
        """Whether ``choose`` reads ``key.prompt`` (callers skip computing it if not)."""
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


@runtime_checkable
class PromptTokenizer(Protocol):
    """Turns a request into the token ids its engines will prefill (see ``routing.tokenizers``)."""

    def token_ids(self, request: GenerationRequest) -> tuple[int, ...] | None:
        """The prompt's token ids, or None when this tokenizer cannot say."""
        ...


def prompt_tokenizer(policy: object) -> PromptTokenizer | None:
    """The tokenizer a policy reads ``RouteKey.token_ids`` from (its ``tokenizer``), if any.

    Policies that need no token ids have no such attribute, so they stay as
    they are and their callers tokenize nothing.
    """
    tokenizer = getattr(policy, "tokenizer", None)
    # What ``isinstance(tokenizer, PromptTokenizer)`` checks, without its walk
    # of the protocol's members on every call (one per routed job).
    if tokenizer is None or not callable(getattr(tokenizer, "token_ids", None)):
        return None
    found: PromptTokenizer = tokenizer
    return found


def load_after_one(candidate: Candidate) -> float:
    """The load ``candidate`` would carry after one more call, per unit of weight."""
    return (candidate.in_flight + 1) / candidate.weight


def next_after(candidates: Iterable[Candidate], last: str | None) -> Candidate:
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


def weighted_index(
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


# ---------------------------------------------------------------- the registry


class PolicyClass(Protocol):
    """What :func:`register_policy` needs of a policy class.

    ``name`` is the configured name; ``options`` the option names
    :meth:`build` accepts (each checked by the class itself).
    """

    name: str
    options: frozenset[str]

    def build(self, rng: random.Random | None, options: Mapping[str, object]) -> Policy:
        """A new instance from configured ``options`` (already known to be in ``options``)."""
        ...


_REGISTRY: Final[dict[str, PolicyClass]] = {}

P = TypeVar("P")


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` (a :class:`PolicyClass`) configurable by its ``name``.

    A new policy is one class plus this decorator; nothing else chooses by name.

    Raises:
        ValueError: another class holds the name already.
    """
    policy = typing.cast("PolicyClass", cls)
    if policy.name in _REGISTRY and _REGISTRY[policy.name] is not policy:
        raise ValueError(f"routing policy {policy.name!r} is registered already")
    _REGISTRY[policy.name] = policy
    return cls


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, in registration order."""
    return tuple(_REGISTRY)


def make_policy(name: str, *, rng: random.Random | None = None, **options: object) -> Policy:
    """Build a policy from its configured name and options (:func:`build_policy` by keywords)."""
    return build_policy(name, options, rng=rng)


def build_policy(
    name: str, options: Mapping[str, object], *, rng: random.Random | None = None
) -> Policy:
    """Build a policy from its configured name and options.

    Args:
        name: a registered name (:func:`policy_names`).
        options: the policy's options (each class lists its own:
            ``consistent_hash`` takes ``load_factor`` and ``fallback``,
            ``cache_aware`` its thresholds; docs/routing.md has them all).
        rng: randomness for the policies that draw (``random``,
            ``power_of_two``, a random ``fallback``); ignored by the others.
            OS-seeded when ``None``.

    Returns:
        A new policy instance; give each pool its own.

    Raises:
        ConfigError: unknown name, unknown option, or an invalid option value.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown routing policy {name!r}; choose one of: {', '.join(policy_names())}"
        )
    unknown = sorted(set(options) - cls.options)
    if unknown:
        accepted = ", ".join(sorted(cls.options)) or "none"
        raise ConfigError(
            f"routing policy {name!r} has no option {', '.join(unknown)} (accepted: {accepted})"
        )
    return cls.build(rng, options)


def number_option(
    options: Mapping[str, object], option: str, default: float, *, minimum: float
) -> float:
    """A numeric option of at least ``minimum``, or ``default`` when absent.

    Raises:
        ConfigError: not a number, or below ``minimum``.
    """
    if option not in options:
        return default
    value = options[option]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"routing option {option} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= minimum):
        raise ConfigError(f"routing option {option} must be >= {minimum:g}, got {value!r}")
    return float(value)


class StatelessPolicy:
    """Defaults for a policy that reads neither affinity nor prompt and takes no options."""

    __slots__ = ()

    name: ClassVar[str]
    options: ClassVar[frozenset[str]] = frozenset()
    uses_affinity: ClassVar[bool] = False
    uses_prompt: ClassVar[bool] = False
