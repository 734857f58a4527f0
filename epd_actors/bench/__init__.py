"""A load generator for OpenAI-compatible endpoints: ``python -m epd_actors bench``.

:mod:`.client` (a lean h11 client that scans SSE cheaply), :mod:`.payload`
(request bodies, synthetic images), :mod:`.runner` (closed and open loop),
:mod:`.stats` (records and summaries, pure), :mod:`.progress` (the
terminal's progress line), :mod:`.sweep` (``--sweep`` points and their
table, pure), :mod:`.plot` (``--plot``, matplotlib from the optional
``bench`` extra), :mod:`.cli` (the command).
docs/benchmarks.md has the method and the numbers.
"""

from __future__ import annotations

from .client import Target
from .payload import Workload, synthetic_png
from .runner import LoadSpec, RunResult, run_load
from .stats import Distribution, RequestRecord, Summary, format_summary, percentile, summarize

__all__ = [
    "Distribution",
    "LoadSpec",
    "RequestRecord",
    "RunResult",
    "Summary",
    "Target",
    "Workload",
    "format_summary",
    "percentile",
    "run_load",
    "summarize",
    "synthetic_png",
]
