"""Per-request records and the summary math of the load generator (pure functions).

A :class:`RequestRecord` is what one request measured; :func:`summarize` turns
a run's records into a :class:`Summary` (percentiles, rates, the load
generator's own CPU use) and :func:`format_summary` renders it as the table
the command prints.  Nothing here does I/O, so it is unit-tested directly.

Goodput (as vLLM's ``benchmark_serving --goodput`` defines it): the requests
per second that succeeded *and* met every service-level objective given
(``ttft``, ``tpot``, ``e2e``: at most so many milliseconds).  The per-stage
breakdown comes from the router's ``x-epd-timings`` (a header, or the
``: timings`` comment of a stream; :func:`parse_timings`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2e")
"""What ``--goodput`` may bound (milliseconds)."""


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
        input_tokens: the final ``usage``'s ``prompt_tokens`` (0: not sent).
        stages: the router's per-stage times (``x-epd-timings``), in seconds.
    """

    start: float
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    events: int = 0
    gaps: list[float] = field(default_factory=list)
    status: int = 0
    error: str | None = None
    input_tokens: int = 0
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """``(e2e - ttft) / (tokens - 1)``; 0 for a single token; None without a TTFT."""
        if self.ttft is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_timings(text: str) -> dict[str, float]:
    """The numeric entries of an ``x-epd-timings`` value, in seconds.

    ``encode=10.2;prefill=3.1;ttft=14.2;worker.decode=d0`` ->
    ``{"encode": 0.0102, "prefill": 0.0031, "ttft": 0.0142}`` (the values are
    milliseconds; ``worker.*`` names, and anything malformed, are skipped).
    """
    stages: dict[str, float] = {}
    for item in text.split(";"):
        name, _, value = item.strip().partition("=")
        if not name or "." in name:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number):
            stages[name] = number / 1000.0
    return stages


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 0.2, "tpot": 0.05}`` (seconds).

    Raises:
        ValueError: an unknown metric, or a limit that is not a positive number.
    """
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: {item!r}: the metric must be one of {SLO_METRICS}")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if not limit > 0 or not math.isfinite(limit):
            raise ValueError(f"--goodput: {item!r}: the limit must be a positive number of ms")
        slos[name] = limit / 1000.0
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99.9"`` -> ``(50.0, 90.0, 99.9)``.

    Raises:
        ValueError: an empty list, or a value outside [0, 100].
    """
    try:
        values = tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"--percentiles: {text!r} is not a comma-separated list") from None
    if not values or not all(0.0 <= v <= 100.0 for v in values):
        raise ValueError(f"--percentiles: {text!r}: each must be in [0, 100]")
    return values


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a successful ``record`` met every objective in ``slos`` (seconds)."""
    measured = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    for name, limit in slos.items():
        value = measured[name]
        if value is None or value > limit:
            return False
    return record.ok


def percentile_name(q: float) -> str:
    """``99.9`` -> ``p99.9``, ``50.0`` -> ``p50``."""
    return f"p{q:g}"


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
    """Mean and percentiles of one latency, in seconds (NaN when there were no samples).

    ``p50``, ``p90`` and ``p99`` are always there; ``quantiles`` holds the
    percentiles asked for (``--percentiles``; by default those three), by name.
    """

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    quantiles: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls, values: Sequence[float], percentiles: Sequence[float] = PERCENTILES
    ) -> Distribution:
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, {percentile_name(q): nan for q in percentiles})
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        quantiles = {percentile_name(q): percentile(values, q) for q in percentiles}
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values), quantiles)


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
        input_tokens / input_token_rate: prompt tokens of the successful
            requests (from ``usage``), and per second.
        total_token_rate: input and output tokens per second.
        slos: the objectives of ``goodput`` (seconds; empty: none given).
        good: successful requests that met every objective.
        goodput: ``good`` per second (NaN without objectives).
        stages: per-stage distributions from ``x-epd-timings`` (``encode``,
            ``prefill``, ``decode``, ``queue``, ...), over the requests that had them.
        percentiles: the percentiles the distributions carry in ``quantiles``.
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
    input_tokens: int = 0
    input_token_rate: float = math.nan
    total_token_rate: float = math.nan
    slos: dict[str, float] = field(default_factory=dict)
    good: int = 0
    goodput: float = math.nan
    stages: dict[str, Distribution] = field(default_factory=dict)
    percentiles: tuple[float, ...] = PERCENTILES

    @property
    def failure_ratio(self) -> float:
        """Failed requests over recorded ones (0 for no request)."""
        return (self.requests - self.completed) / self.requests if self.requests else 0.0

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
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    client_cpu_s: float,
    percentiles: Sequence[float] = PERCENTILES,
    slos: dict[str, float] | None = None,
) -> Summary:
    """Summarise ``records`` of a run that lasted ``duration_s`` seconds.

    ``percentiles`` are the ones each distribution carries; ``slos`` (seconds
    per metric of :data:`SLO_METRICS`) define goodput.
    """
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
    inputs = sum(r.input_tokens for r in good)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    objectives = dict(slos or {})
    met = sum(meets(r, objectives) for r in good) if objectives else 0
    stage_values: dict[str, list[float]] = {}
    for record in good:
        for stage, seconds in record.stages.items():
            stage_values.setdefault(stage, []).append(seconds)
    qs = tuple(percentiles)
    return Summary(
        requests=len(records),
        completed=len(good),
        errors=errors,
        duration_s=duration_s,
        request_rate=rate,
        output_token_rate=token_rate,
        output_tokens=tokens,
        ttft=Distribution.of(ttfts, qs),
        itl=Distribution.of(gaps, qs),
        e2e=Distribution.of([r.e2e for r in good], qs),
        tpot=Distribution.of(tpots, qs),
        client_cpu_s=client_cpu_s,
        client_cpu_util=client_cpu_s / duration_s if duration_s > 0 else math.nan,
        input_tokens=inputs,
        input_token_rate=per_s(inputs),
        total_token_rate=per_s(inputs + tokens),
        slos=objectives,
        good=met,
        goodput=per_s(met) if objectives else math.nan,
        stages={name: Distribution.of(values, qs) for name, values in stage_values.items()},
        percentiles=qs,
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
    lines.append(
        f"input {summary.input_token_rate:.0f} tokens/s ({summary.input_tokens} tokens), "
        f"total {summary.total_token_rate:.0f} tokens/s"
    )
    if summary.slos:
        objectives = " ".join(f"{k}<={v * 1000:g}ms" for k, v in summary.slos.items())
        share = summary.good / summary.requests * 100 if summary.requests else math.nan
        lines.append(
            f"goodput {summary.goodput:.1f} req/s ({summary.good}/{summary.requests} "
            f"requests, {share:.0f}%, met {objectives})"
        )
    names = [percentile_name(q) for q in summary.percentiles]
    header = f"{'latency (ms)':<14}{'mean':>10}" + "".join(f"{n:>10}" for n in names)
    lines.append(header + f"{'max':>10}")
    rows = (("TTFT", summary.ttft), ("ITL", summary.itl), ("TPOT", summary.tpot))
    stages = tuple((f"stage {name}", dist) for name, dist in summary.stages.items())
    for name, dist in (*rows, ("end-to-end", summary.e2e), *stages):
        cells = (dist.mean, *(dist.quantiles.get(n, math.nan) for n in names), dist.max)
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
