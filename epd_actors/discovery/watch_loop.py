"""What every discovery kind does while its source is away: keep the last view, say so once, retry.

Theory of operation: a discovery reads its source (the Kubernetes API server,
Redis) per pool, over and over.  A pool's :class:`SourceHealth` is told the
outcome of each attempt.  The first failure after an answer (or the first one
of all) is logged once at warning level, naming the source, the reason and
how many workers the router keeps meanwhile; further failures of the same
outage at debug level; the first answer after an outage once at info level.
Every failure counts in ``epd_discovery_errors_total{pool}``, and
``epd_discovery_up{pool}`` is 1 while the source answers and 0 otherwise
(:class:`SourceMetrics`, the same metrics for every kind).  Between failed
attempts a kind waits its :class:`Backoff`: ``start_s`` doubling to
``max_s``, each delay drawn from its upper half when given a random source
(the ``kubernetes`` kind), or a fixed period (``redis``: start and max
equal, no jitter).  :class:`StartOnce` reports a discovery started after its
first attempt, whatever the outcome: a router starts while its source is down.

Nothing here touches the router: the kinds keep their workers (their last
view) by doing nothing while the source is away.

Cancellation: only :meth:`Backoff.wait` awaits (a plain ``trio.sleep``);
cancelled, it leaves the delay sequence where it was.
Backpressure: none; one attempt at a time per pool, by the kind's own task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    import logging
    import random

    from prometheus_client import CollectorRegistry


class SourceMetrics:
    """``epd_discovery_errors_total{pool}`` and ``epd_discovery_up{pool}`` in ``registry``.

    Args:
        errors_help: the errors counter's help text (what one attempt is, for the kind).
    """

    def __init__(self, registry: CollectorRegistry, *, errors_help: str) -> None:
        self.errors = Counter("epd_discovery_errors", errors_help, ["pool"], registry=registry)
        self.up = Gauge(
            "epd_discovery_up",
            "1 while the discovery source answers for the pool, 0 while it does not",
            ["pool"],
            registry=registry,
        )


class SourceHealth:
    """Whether one pool's source answers, with its log lines and metrics.

    Args:
        label: the pool's label (the metrics' ``pool`` and the log lines' name).
        metrics: where the counts go.
        source: the source as the log lines name it (``"the API server"``).
        attempts: what one attempt is called in the plural (``"reads"``).
        logger: the kind's logger, so its lines carry the kind's name.

    Attributes:
        up: the last attempt succeeded (False before the first).
        failures: failed attempts since the last success.
        errors: failed attempts in all.
    """

    def __init__(
        self,
        label: str,
        metrics: SourceMetrics,
        *,
        source: str,
        attempts: str,
        logger: logging.Logger,
    ) -> None:
        self.label = label
        self.source = source
        self.attempts = attempts
        self.up = False
        self.failures = 0
        self.errors = 0
        self._logger = logger
        self._errors = metrics.errors.labels(label)
        self._up = metrics.up.labels(label)
        self._up.set(0)

    def succeeded(self) -> None:
        """The source answered: up again (one info line when it ends an outage)."""
        if not self.up and self.failures:
            self._logger.info(
                "discovery of pool %s: %s answers again after %d failed %s",
                self.label,
                self.source,
                self.failures,
                self.attempts,
            )
        self.up = True
        self.failures = 0
        self._up.set(1)

    def failed(self, reason: str, *, workers: int) -> None:
        """An attempt failed for ``reason``; the router keeps its ``workers`` of the pool.

        One warning per outage (the first failure after an answer, or the very
        first attempt); the rest of the outage at debug level.
        """
        self.errors += 1
        self._errors.inc()
        self._up.set(0)
        self.failures += 1
        if self.up or self.failures == 1:
            self._logger.warning(
                "discovery of pool %s: %s is unreachable or refused (%s); "
                "keeping the last view of %d workers and retrying",
                self.label,
                self.source,
                reason,
                workers,
            )
        else:
            self._logger.debug("discovery of pool %s: still failing: %s", self.label, reason)
        self.up = False


class Backoff:
    """The waits between failed attempts: ``start_s`` doubling up to ``max_s``.

    With ``rng``, each wait is drawn from the upper half of its step
    (``step * (0.5 + 0.5 * rng.random())``), so pools and routers that failed
    together do not retry together; without, the waits are exactly the steps.
    """

    def __init__(self, start_s: float, max_s: float, *, rng: random.Random | None = None) -> None:
        self.start_s = start_s
        self.max_s = max_s
        self._rng = rng
        self._step = start_s

    def next_delay(self) -> float:
        """The next wait, and move the step on."""
        step = self._step
        self._step = min(step * 2, self.max_s)
        if self._rng is None:
            return step
        return step * (0.5 + 0.5 * self._rng.random())

    def reset(self) -> None:
        """An attempt succeeded: the next wait is ``start_s`` again."""
        self._step = self.start_s

    async def wait(self) -> None:
        """Sleep the next wait.

        Cancellation: a plain ``trio.sleep``; the step has moved on already.
        """
        await trio.sleep(self.next_delay())


class StartOnce:
    """Report a task started the first time it is called; later calls do nothing."""

    def __init__(self, task_status: trio.TaskStatus[None]) -> None:
        self._task_status = task_status
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self._task_status.started()
