"""Sweeps of the load generator: ``--sweep concurrency=1,4,16`` or ``--sweep rate=5,10,20``.

A sweep is one knob of :class:`~.runner.LoadSpec` and a list of values; each
value is one run (a *point*) with everything else as given.  The knobs are a
registry (:data:`SWEEPABLE`): ``concurrency`` (closed loop, requests in
flight) and ``rate`` (open loop, Poisson arrivals per second).  Pure: parsing,
the points and the table; :mod:`.cli` runs them one after another.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .stats import percentile_name

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .runner import LoadSpec
    from .stats import Summary


@dataclass(frozen=True, slots=True)
class Knob:
    """One sweepable setting: how a value is read and put into a :class:`LoadSpec`.

    Attributes:
        parse: text to value; raises ValueError naming what is wrong.
        apply: the load with this value.
        axis: the plot's x-axis label.
    """

    parse: Callable[[str], float]
    apply: Callable[[LoadSpec, float], LoadSpec]
    axis: str


def _concurrency(text: str) -> float:
    value = int(text)
    if value < 1:
        raise ValueError(f"{text!r}: a concurrency must be >= 1")
    return float(value)


def _rate(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r}: a rate must be > 0")
    return value


SWEEPABLE: dict[str, Knob] = {
    "concurrency": Knob(
        _concurrency,
        lambda load, v: dataclasses.replace(load, concurrency=int(v), rate=None),
        "concurrency (requests in flight)",
    ),
    "rate": Knob(_rate, lambda load, v: dataclasses.replace(load, rate=v), "request rate (req/s)"),
}


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One run of a sweep: the knob's name and value, and the load it makes."""

    name: str
    value: float
    load: LoadSpec

    @property
    def label(self) -> str:
        return f"{self.name}={self.value:g}"


def parse_sweep(text: str) -> tuple[str, tuple[float, ...]]:
    """``"concurrency=1,4,16"`` -> ``("concurrency", (1.0, 4.0, 16.0))``.

    Raises:
        ValueError: no ``=``, an unknown knob, an empty list, a bad or repeated value.
    """
    name, equals, values = text.partition("=")
    name = name.strip()
    if not equals or name not in SWEEPABLE:
        raise ValueError(
            f"--sweep: {text!r}: give NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}"
        )
    knob = SWEEPABLE[name]
    items = [item.strip() for item in values.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--sweep: {text!r}: no values")
    try:
        parsed = tuple(knob.parse(item) for item in items)
    except ValueError as exc:
        raise ValueError(f"--sweep: {exc}") from None
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"--sweep: {text!r}: a value is repeated")
    return name, parsed


def sweep_points(base: LoadSpec, text: str) -> list[SweepPoint]:
    """The points of ``text`` (see :func:`parse_sweep`), each ``base`` with one value."""
    name, values = parse_sweep(text)
    knob = SWEEPABLE[name]
    return [SweepPoint(name, value, knob.apply(base, value)) for value in values]


def single_point(load: LoadSpec) -> SweepPoint:
    """A run without a sweep, as the one point of its own mode (for the plot)."""
    if load.rate is None:
        return SweepPoint("concurrency", float(load.concurrency), load)
    return SweepPoint("rate", load.rate, load)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.2f}"


def format_sweep_table(points: Sequence[tuple[SweepPoint, Summary]]) -> str:
    """One row per point: requests, throughput, goodput and the TTFT/ITL percentiles (ms)."""
    if not points:
        return ""
    first = points[0][1]
    names = [percentile_name(q) for q in first.percentiles]
    with_goodput = any(summary.slos for _, summary in points)
    width = max(len("point"), *(len(point.label) for point, _ in points)) + 2
    header = f"{'point':<{width}}{'ok':>11}{'req/s':>10}{'tok/s':>10}"
    if with_goodput:
        header += f"{'goodput':>10}"
    header += "".join(f"{'TTFT ' + n:>11}" for n in names)
    header += "".join(f"{'ITL ' + n:>11}" for n in names)
    lines = [f"sweep (latencies in ms)\n{header}"]
    for point, summary in points:
        row = f"{point.label:<{width}}{f'{summary.completed}/{summary.requests}':>11}"
        row += f"{summary.request_rate:>10.1f}{summary.output_token_rate:>10.0f}"
        if with_goodput:
            row += f"{summary.goodput:>10.1f}"
        row += "".join(f"{_ms(summary.ttft.quantiles.get(n, math.nan)):>11}" for n in names)
        row += "".join(f"{_ms(summary.itl.quantiles.get(n, math.nan)):>11}" for n in names)
        lines.append(row)
    return "\n".join(lines)
