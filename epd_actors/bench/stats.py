"""Per-request records and the summary math of the load generator (pure functions).

A :class:`RequestRecord` is what one request measured; :func:`summarize` turns
a run's records into a :class:`Summary` (percentiles, rates, the load
generator's own CPU use) and :func:`format_summary` renders it as the table
the command prints.  Nothing here does I/O, so it is unit-tested directly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(slots=True)
class RequestRecord:
    """What one request measured (times in seconds from its start).

    Attributes:
        start: when it was sent, seconds since the run began.
        ttft: time to the first output text (None: no text arrived).
        e2e: time to the end of the response (or to the failure).
        output_tokens: from the final ``usage`` when the server sent one, else
            the number of events that carried text.
        events: SSE ``data:`` events received (streaming) or 1.
        gaps: time between consecutive text-carrying events (streaming).
        status: the HTTP status (0: no response).
        error: why it failed, or None.
    """

    start: float
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    events: int = 0
    gaps: list[float] = field(default_factory=list)
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between ranks.

    ``values`` need not be sorted.  Empty input gives NaN.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds (NaN when there were no samples)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values))


@dataclass(frozen=True, slots=True)
class Summary:
    """A run, summarised.

    Attributes:
        requests: requests recorded (warm-up excluded).
        completed: requests that succeeded.
        errors: requests that failed, by error text.
        duration_s: wall time from the first send to the last completion.
        request_rate: completed requests per second of ``duration_s``.
        output_token_rate: output tokens per second of ``duration_s``.
        ttft, itl, e2e, tpot: distributions over successful requests (ITL is
            the gap between text-carrying events; TPOT is ``(e2e - ttft) /
            (tokens - 1)`` per streamed request).
        client_cpu_s: user + system CPU seconds the load generator used.
        client_cpu_util: ``client_cpu_s / duration_s`` (1.0 = one core busy).
    """

    requests: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    request_rate: float
    output_token_rate: float
    output_tokens: int
    ttft: Distribution
    itl: Distribution
    e2e: Distribution
    tpot: Distribution
    client_cpu_s: float
    client_cpu_util: float

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        return _nan_to_none(asdict(self))  # type: ignore[return-value]


def _nan_to_none(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    return value


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float, client_cpu_s: float
) -> Summary:
    """Summarise ``records`` of a run that lasted ``duration_s`` seconds."""
    good = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            errors[record.error] = errors.get(record.error, 0) + 1
    tokens = sum(r.output_tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    gaps = [gap for r in good for gap in r.gaps]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in good
        if r.ttft is not None and r.output_tokens > 1 and r.gaps  # streamed
    ]
    rate = len(good) / duration_s if duration_s > 0 else math.nan
    token_rate = tokens / duration_s if duration_s > 0 else math.nan
    return Summary(
        requests=len(records),
        completed=len(good),
        errors=errors,
        duration_s=duration_s,
        request_rate=rate,
        output_token_rate=token_rate,
        output_tokens=tokens,
        ttft=Distribution.of(ttfts),
        itl=Distribution.of(gaps),
        e2e=Distribution.of([r.e2e for r in good]),
        tpot=Distribution.of(tpots),
        client_cpu_s=client_cpu_s,
        client_cpu_util=client_cpu_s / duration_s if duration_s > 0 else math.nan,
    )


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.2f}"


def format_summary(summary: Summary, *, title: str = "") -> str:
    """The summary as a plain-text table (latencies in milliseconds)."""
    lines = []
    if title:
        lines.append(title)
    lines.append(
        f"requests {summary.completed}/{summary.requests} ok, "
        f"{summary.requests - summary.completed} failed, in {summary.duration_s:.2f} s"
    )
    lines.append(
        f"throughput {summary.request_rate:.1f} req/s, "
        f"{summary.output_token_rate:.0f} output tokens/s ({summary.output_tokens} tokens)"
    )
    header = f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"
    lines.append(header)
    rows = (("TTFT", summary.ttft), ("ITL", summary.itl), ("TPOT", summary.tpot))
    for name, dist in (*rows, ("end-to-end", summary.e2e)):
        cells = (dist.mean, dist.p50, dist.p90, dist.p99, dist.max)
        lines.append(f"{name:<14}" + "".join(f"{_ms(c):>10}" for c in cells))
    per_request = summary.client_cpu_s / summary.requests if summary.requests else math.nan
    lines.append(
        f"load generator CPU {summary.client_cpu_s:.2f} s "
        f"({summary.client_cpu_util * 100:.0f}% of one core, {_ms(per_request)} ms/request)"
    )
    if summary.client_cpu_util > CPU_WARNING_UTIL:
        lines.append(
            "warning: the load generator kept a core busy; it may be the bottleneck "
            "(pin it to its own core with taskset, see docs/benchmarks.md)"
        )
    for error, count in sorted(summary.errors.items(), key=lambda item: -item[1]):
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


# Above this share of one core the load generator warns that it may limit the run.
CPU_WARNING_UTIL = 0.8
