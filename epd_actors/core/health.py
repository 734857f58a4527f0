"""Per-worker circuit breakers: pure state machines fed by request outcomes.

Theory of operation: every pool member has a :class:`CircuitBreaker`.  It is
*closed* (traffic flows) until ``failure_threshold`` consecutive worker-side
failures (a lost connection, a retryable worker error) open it.
While *open* the pool routes around the worker.  After ``open_cooldown_s`` the
breaker goes *half-open* and lets exactly one job through as a probe: a
success counts towards ``success_threshold`` (then the breaker closes), a
failure opens it again for another cooldown.  Client errors (a request that
would fail on any worker) are never recorded, so a bad request cannot take a
healthy worker out of service, and one slow or failed request does not either.
Nor are a worker's refusals for load (``overloaded``, ``draining``:
:func:`is_backpressure`): a full worker is busy, not broken, and taking it out
of service would only push its share of the load onto the others.

The breaker complements the connection-level health of a backend (heartbeats,
reconnects): a worker is usable when its backend is connected and ready *and*
its breaker allows traffic.  Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import ConfigError, EpdError, RemoteWorkerError
from ..protocol import BACKPRESSURE_CODES


def is_backpressure(error: EpdError) -> bool:
    """Whether ``error`` is a worker saying it is full (``overloaded``) or leaving (``draining``).

    Such a refusal says nothing about the worker's health: it never counts
    against its breaker, and the job may go to another worker at once.
    """
    return isinstance(error, RemoteWorkerError) and error.code in BACKPRESSURE_CODES


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Breaker thresholds.

    Attributes:
        failure_threshold: consecutive failures that open a closed breaker.
        success_threshold: consecutive successful probes that close it again.
        open_cooldown_s: how long an open breaker refuses traffic before probing.
    """

    failure_threshold: int = 3
    success_threshold: int = 2
    open_cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ConfigError("health.failure_threshold must be >= 1")
        if self.success_threshold < 1:
            raise ConfigError("health.success_threshold must be >= 1")
        if not self.open_cooldown_s > 0:
            raise ConfigError("health.open_cooldown_s must be > 0")


class CircuitBreaker:
    """One worker's breaker; see the module docstring."""

    __slots__ = ("_failures", "_opened_at", "_policy", "_probing", "_successes", "state", "trips")

    def __init__(self, policy: HealthPolicy) -> None:
        self._policy = policy
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probing = False
        self.trips = 0

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.state.value} failures={self._failures}>"

    def allows(self, now: float) -> bool:
        """Whether a new job may go to this worker now (no side effects)."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN:
            return now >= self._opened_at + self._policy.open_cooldown_s
        return not self._probing

    def on_dispatch(self, now: float) -> None:
        """A job was sent to this worker (turns an expired open state into a probe)."""
        if self.state == BreakerState.OPEN and self.allows(now):
            self.state = BreakerState.HALF_OPEN
            self._successes = 0
        if self.state == BreakerState.HALF_OPEN:
            self._probing = True

    def record_success(self) -> None:
        self._failures = 0
        if self.state == BreakerState.HALF_OPEN:
            self._probing = False
            self._successes += 1
            if self._successes >= self._policy.success_threshold:
                self.state = BreakerState.CLOSED

    def record_failure(self, now: float) -> None:
        if self.state == BreakerState.HALF_OPEN:
            self._open(now)
            return
        self._failures += 1
        if self.state == BreakerState.CLOSED and self._failures >= self._policy.failure_threshold:
            self._open(now)

    def release_probe(self) -> None:
        """A probe ended without a verdict (cancelled): allow another one."""
        self._probing = False

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
        self._failures = 0
        self._successes = 0
        self._probing = False
        self.trips += 1
