"""Conditional disaggregation: skip P when the decoder would prefill the prompt cheaply itself.

Theory of operation
-------------------
Handing a prompt's KV cache from P to D costs a transfer and a second worker;
for a short prompt, or one whose prefix the decoders already cache, letting D
prefill it locally is cheaper (vllm-router's rule: disaggregate only when more
than 256 tokens are not cached; llm-d decides per request the same way).  A
pool whose stage hands KV on (``prefill``) takes a
:class:`LocalPrefillRule` (``local_prefill_below_tokens`` in its config):
when the stage's turn comes, the rule asks the consumer pool's policy
(the pool of the same model whose stage consumes the hand-off, ``decode``;
its policy must be a :class:`PrefillEstimator`, ``kv_aware``) how many of
the prompt's tokens the best of its usable workers lacks, and below the
threshold the stage runs no job: the consumer gets no ``kv_transfer_params``
and prefills itself (vLLM: a ``kv_both`` instance; the simulator:
``local_prefill``).  Nothing here branches on a stage's name: the producer is
the actor that accepts the rule (``BaseActor.use_local_prefill``), the
consumer the pool whose requirement says ``consumes_kv_handoff``.

The decision counts into ``epd_prefill_plans_total{pool, plan}`` (``local``,
``disaggregated``), exported by :class:`LocalPrefillCollector`.

Pure and synchronous: the estimate reads the consumer pool's KV index and
tokenizes the prompt once; no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import trio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ...errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from prometheus_client.core import Metric

    from ...request import GenerationRequest
    from ..pool import WorkerPool
    from .jobs import StageContext

__all__ = ["LocalPrefillCollector", "LocalPrefillRule", "PrefillEstimator", "consumer_pool"]


@runtime_checkable
class PrefillEstimator(Protocol):
    """A policy that can tell how much of a prompt its workers would have to prefill."""

    def uncached_tokens(
        self, request: GenerationRequest, adapter: str | None, workers: Sequence[str]
    ) -> int | None:
        """The fewest prompt tokens any of ``workers`` lacks; None when it cannot say."""
        ...


class LocalPrefillRule:
    """Whether a request's hand-off stage is skipped (see the module docstring).

    Args:
        pool: the name of the pool whose stage is skipped (for the metrics).
        threshold_tokens: skip when fewer uncached tokens than this (> 0).

    Until :meth:`bind` names the consumer pool, nothing is skipped.
    """

    def __init__(self, pool: str, threshold_tokens: int) -> None:
        self.pool = pool
        self.threshold_tokens = threshold_tokens
        self.consumer: WorkerPool | None = None
        self.estimator: PrefillEstimator | None = None
        self.local = 0
        self.disaggregated = 0

    def bind(self, consumer: WorkerPool) -> None:
        """Estimate with ``consumer``'s policy, over its usable workers (:func:`consumer_pool`)."""
        policy = consumer.policy
        assert isinstance(policy, PrefillEstimator)
        self.consumer, self.estimator = consumer, policy

    def prefills_locally(self, context: StageContext) -> bool:
        """True (and counted) when the consumer should prefill ``context``'s prompt itself."""
        local = False
        if self.consumer is not None and self.estimator is not None:
            now = trio.current_time()
            workers = [m.worker_id for m in self.consumer.members if m.usable(now)]
            if workers:
                request, adapter = context.request, context.adapter
                uncached = self.estimator.uncached_tokens(request, adapter, workers)
                local = uncached is not None and uncached < self.threshold_tokens
        if local:
            self.local += 1
        else:
            self.disaggregated += 1
        return local


def consumer_pool(pools: Mapping[str, WorkerPool], producer: WorkerPool) -> WorkerPool:
    """The pool of ``producer``'s model whose stage consumes the KV hand-off.

    Raises:
        ConfigError: none, or its policy cannot estimate prefills.
    """
    key = f"pools.{producer.stage}.local_prefill_below_tokens"
    for pool in pools.values():
        if pool.model == producer.model and pool.requirement.consumes_kv_handoff:
            if not isinstance(pool.policy, PrefillEstimator):
                raise ConfigError(
                    f"{key}: the {pool.stage} pool's policy ({pool.policy.name}) cannot say what "
                    "its workers would prefill; use kv_aware there"
                )
            return pool
    raise ConfigError(f"{key}: no pool of model {producer.model!r} takes the KV hand-off")


class LocalPrefillCollector(Collector):
    """``epd_prefill_plans_total{pool, plan}`` from every rule, read at scrape time."""

    def __init__(self, rules: Sequence[LocalPrefillRule]) -> None:
        self._rules = rules

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "epd_prefill_plans",
            "Requests whose hand-off stage ran (disaggregated) or was skipped (local)",
            labels=["pool", "plan"],
        )
        for rule in self._rules:
            family.add_metric([rule.pool, "local"], rule.local)
            family.add_metric([rule.pool, "disaggregated"], rule.disaggregated)
        yield family
