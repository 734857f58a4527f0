"""``--plot FILE.png``: TTFT and ITL percentiles and throughput per sweep point.

matplotlib is the optional ``bench`` extra (``pip install 'epd_actors[bench]'``),
imported only when a plot is asked for (:func:`require_pyplot`, which the
command calls before any load is sent, so a missing extra fails at once).
Three panels side by side, x = the swept value (log scale when the values
span ten times or more): TTFT percentiles, ITL percentiles (milliseconds,
one line per ``--percentiles`` value), and request and output-token throughput.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any

from .stats import percentile_name
from .sweep import SWEEPABLE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .stats import Distribution, Summary
    from .sweep import SweepPoint

EXTRA_HINT = "pip install 'epd_actors[bench]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed: the message names the extra to install."""


def require_pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        PlotUnavailable: matplotlib cannot be imported.
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        raise PlotUnavailable(
            f"--plot needs matplotlib, the optional 'bench' extra: {EXTRA_HINT} ({exc})"
        ) from None


def _series(dists: Sequence[Distribution], name: str) -> list[float]:
    return [d.quantiles.get(name, math.nan) * 1000 for d in dists]


def plot_sweep(path: str, points: Sequence[tuple[SweepPoint, Summary]], *, title: str) -> None:
    """Write the three-panel PNG of ``points`` to ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        ValueError: no points.
    """
    if not points:
        raise ValueError("nothing to plot")
    plt = require_pyplot()
    points = sorted(points, key=lambda item: item[0].value)  # lines left to right
    xs = [point.value for point, _ in points]
    summaries = [summary for _, summary in points]
    names = [percentile_name(q) for q in summaries[0].percentiles]
    axis_label = SWEEPABLE[points[0][0].name].axis
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        (axes[0], "TTFT (ms)", [s.ttft for s in summaries]),
        (axes[1], "ITL (ms)", [s.itl for s in summaries]),
    )
    for axis, label, dists in panels:
        for name in names:
            axis.plot(xs, _series(dists, name), marker="o", label=name)
        axis.set_title(label)
        axis.legend(fontsize=8)
    throughput = axes[2]
    throughput.plot(xs, [s.request_rate for s in summaries], marker="o", label="req/s")
    throughput.set_title("throughput (req/s)")
    tokens = throughput.twinx()
    tokens.plot(xs, [s.output_token_rate for s in summaries], "s--", color="tab:orange")
    tokens.set_ylabel("output tokens/s", color="tab:orange")
    spread = max(xs) / min(xs)
    for axis in axes:
        if spread >= 10:
            axis.set_xscale("log")
        axis.set_xlabel(axis_label)
        axis.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
