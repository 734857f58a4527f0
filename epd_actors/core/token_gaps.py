"""One request's gaps between output tokens, kept as histogram bucket counts.

``epd_inter_token_latency_seconds`` has vLLM's shape
(``vllm:inter_token_latency_seconds``): one observation per gap between two
output tokens, not one per request.  Observing a Prometheus histogram per token
would put a lock, a bucket search and two increments per token on the streaming
hot path; instead the output relay tells a request's :class:`TokenGaps` about
each delta it passes (:meth:`TokenGaps.add`: a subtraction, one bucket search
over a short tuple and two additions), and the metrics fold the request's
counts into the histogram once, when it finishes.

The router sees deltas, not engine steps: a delta of ``k`` tokens that arrived
``g`` seconds after the one before it counts as ``k`` gaps of ``g / k`` each,
so the histogram's count is the number of tokens after the first delta and its
sum is the time from the first delta to the last.  Tokens that came with the
first delta have no gap before them the router could see, and none is counted.

Cancellation and backpressure: none; everything here is synchronous and
bounded (``len(TOKEN_GAP_BUCKETS) + 1`` counts per request).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

TOKEN_GAP_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
"""Upper bounds (``le``) in seconds; a last, unbounded bucket (``+Inf``) follows.
vLLM's buckets from 10 ms to 5 s, and finer ones below for a router that
relays a fast engine's tokens."""


class TokenGaps:
    """The gaps between one request's output tokens (see the module doc).

    Attributes:
        counts: gaps per bucket, ``counts[i]`` for ``TOKEN_GAP_BUCKETS[i]``
            and the last one for ``+Inf`` (not cumulative).
        total_s: the sum of the gaps, in seconds.
        last_at: when the latest delta with tokens arrived (None: none yet).
    """

    __slots__ = ("counts", "last_at", "total_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(TOKEN_GAP_BUCKETS) + 1)
        self.total_s = 0.0
        self.last_at: float | None = None

    def __repr__(self) -> str:
        return f"<TokenGaps gaps={sum(self.counts)} total_s={self.total_s:.6f}>"

    def add(self, now: float, tokens: int) -> None:
        """A delta of ``tokens`` (> 0) output tokens arrived at ``now``."""
        last = self.last_at
        self.last_at = now
        if last is not None:
            elapsed = now - last
            self.counts[bisect_left(TOKEN_GAP_BUCKETS, elapsed / tokens)] += tokens
            self.total_s += elapsed

    @property
    def observed(self) -> int:
        """How many gaps were recorded."""
        return sum(self.counts)
