"""When a failed stage attempt is tried again on another worker, and after how long.

Pure and synchronous: the actor asks :meth:`RetryPolicy.should_retry` after a
failure and sleeps :meth:`RetryPolicy.backoff_s` (randomness passed in) before
leasing a different worker.  The rules:

* only ``WorkerError``s that say ``retryable`` (connection lost, a worker error
  the worker marked retryable) and ``AttemptTimeout``s (a worker that did not
  answer within the stage's deadline is a failing worker) -- never a client
  error such as ``invalid_request``, which would fail the same way everywhere;
* a stage that produces output is retried only before its first token reached
  the requester (after that, a retry would repeat text);
* at most ``max_attempts`` attempts in all, each on a worker not tried before,
  and always inside the request's own deadline (the supervisor's scope).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import AttemptTimeout, ConfigError, EpdError, WorkerError
from .health import is_backpressure

if TYPE_CHECKING:
    import random


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry settings of the stage actors.

    Attributes:
        max_attempts: attempts per job, the first included (1 = no retries).
        backoff_start_s: delay before the first retry (seconds).
        backoff_max_s: cap of the doubling delay (seconds).
        jitter: each delay is scaled by a random factor in [1 - jitter, 1].
    """

    max_attempts: int = 3
    backoff_start_s: float = 0.02
    backoff_max_s: float = 1.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("retries.max_attempts must be >= 1")
        if self.backoff_start_s < 0 or self.backoff_max_s < self.backoff_start_s:
            raise ConfigError("retries: need 0 <= backoff_start_s <= backoff_max_s")
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError("retries.jitter must be in [0, 1]")

    def should_retry(self, error: EpdError, *, attempt: int, output_started: bool) -> bool:
        """Whether attempt number ``attempt`` (1-based) may be followed by another."""
        if attempt >= self.max_attempts or output_started:
            return False
        return _worker_failed(error)

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Delay before attempt ``attempt + 1``."""
        base = min(self.backoff_start_s * float(2 ** (attempt - 1)), self.backoff_max_s)
        return base * (1.0 - self.jitter * rng.random())


def counts_against_worker(error: EpdError) -> bool:
    """Whether a failure says something about the worker (feeds its circuit breaker).

    Retryable worker errors do (lost connection, a worker-side error the worker
    marked retryable), and so does a worker that did not answer an attempt
    within the stage's deadline; client errors, router-side conditions and a
    worker's refusals for load (``overloaded``, ``draining``) do not.
    """
    return _worker_failed(error) and not is_backpressure(error)


def _worker_failed(error: EpdError) -> bool:
    """A failure of the worker itself, which another worker may not repeat."""
    return isinstance(error, AttemptTimeout) or (isinstance(error, WorkerError) and error.retryable)
