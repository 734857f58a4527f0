"""Worker-selection policies: which worker of a pool gets the next stage call.

Theory of operation: every stage actor owns one pool of workers and one
:class:`Policy` instance.  For each stage call (one media item for E, one
request for P, D or PD) it builds a snapshot of the workers that may take work
right now -- healthy, not draining, circuit closed -- as a sequence of
:class:`Candidate` values, and asks ``policy.choose(candidates, key)``.  The
policy answers one of those candidates, or ``None`` only when the sequence is
empty (the caller then refuses the request with ``NoHealthyWorker``).

Policies are pure and synchronous: no ``await``, no I/O, no clock and no global
randomness. Whatever they need arrives as an argument: load as
``Candidate.in_flight``, affinity as ``RouteKey.affinity``, the prompt as
``RouteKey.prompt`` (computed only for a policy with ``uses_prompt``),
randomness as a ``random.Random`` given at construction (seed it in tests). A
policy's only state is a cursor (round robin and the tie-break of
least-in-flight) or the prefix index of :class:`CacheAware`, living on the
instance, so ``choose`` is a small state update in the sense of convention 14.
The caller owns the load numbers: it increments ``in_flight`` when it assigns a
call and decrements it when the call ends, so a fan-out of several items within
one request sees the effect of its own earlier choices.

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
* ``cache_aware`` (:class:`CacheAware`): the worker that was sent the longest
  prefix of the prompt, unless the pool is out of balance; cold prefixes by
  rendezvous hashing (:mod:`.cache_aware`).

Each policy is one class registered by name (:func:`register_policy`): the
class lists its options and builds itself from them (``build``), so a new
policy needs no edit anywhere else, and :func:`make_policy` is the only place
a name is looked up.  The package's modules: :mod:`.base` (the contract and
the registry), :mod:`.simple` (load-only policies), :mod:`.hashing`
(rendezvous hashing), :mod:`.cache_aware` (the prefix index).

"Load" everywhere means ``(in_flight + 1) / weight``: the load a worker would
carry after taking this call, per unit of capacity.  The ``+ 1`` makes an idle
big worker preferable to an idle small one (HAProxy's weighted ``leastconn``
ranks servers the same way); with equal weights it orders like ``in_flight``.
"""

from __future__ import annotations

from .base import (
    Candidate,
    Policy,
    PolicyClass,
    PromptTokenizer,
    RouteKey,
    StatelessPolicy,
    build_policy,
    make_policy,
    policy_names,
    prompt_tokenizer,
    register_policy,
)
from .cache_aware import CacheAware, PrefixIndex, prompt_blocks
from .hashing import ConsistentHash, affinity_for_prompt
from .kv_aware import KVAware
from .simple import LeastInFlight, PowerOfTwoChoices, RandomChoice, RoundRobin
from .tokenizers import register_tokenizer, tokenizer_names

POLICY_NAMES = policy_names()
"""The built-in policy names (:func:`policy_names` also lists ones registered later)."""

__all__ = [
    "POLICY_NAMES",
    "CacheAware",
    "Candidate",
    "ConsistentHash",
    "KVAware",
    "LeastInFlight",
    "Policy",
    "PolicyClass",
    "PowerOfTwoChoices",
    "PrefixIndex",
    "PromptTokenizer",
    "RandomChoice",
    "RoundRobin",
    "RouteKey",
    "StatelessPolicy",
    "affinity_for_prompt",
    "build_policy",
    "make_policy",
    "policy_names",
    "prompt_blocks",
    "prompt_tokenizer",
    "register_policy",
    "register_tokenizer",
    "tokenizer_names",
]
