"""How a router process sets up Python's cyclic garbage collector before it serves.

Most of what the router allocates per token dies by reference counting the
moment it is written out; what the collector has to find is the few cycles
a request leaves (coroutine frames, tracebacks, cancel scopes).  Python's
defaults collect the youngest generation every 700 net container
allocations, which under a few hundred streams is several times a second,
and every survivor is traversed again in the older generations, up to a
full collection that walks every object of the process -- the modules,
classes and configuration loaded at start included.  Measured on the P+D
step-clock load at 256 streams (``benchmarks/gc_cost.py``; ``docs/benchmarks.md``,
"The garbage collector, and fewer calls per token"), that was about 1.3 ms
of collector time per request, a tenth of the router's CPU, with pauses of
up to 166 ms; with the default below, 0.06 ms and 23 ms.

:func:`tune_collector` does two things, once, just before the event loop
starts:

* ``gc.freeze()``: every object alive then (what was imported and read at
  start) moves to the permanent generation, which collections skip;
* the youngest generation's threshold becomes ``young_threshold`` (the
  older generations' stay as Python has them), so collections are rarer and
  fewer short-lived objects are promoted to be traversed again.

Only the program does this: an application embedding the router keeps its
own collector settings.  Cycles are still collected; garbage in them waits
for at most ``young_threshold`` more net allocations.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

DEFAULT_YOUNG_THRESHOLD = 20_000
"""``[server] gc_young_threshold``'s default (Python's own is 700)."""


@dataclass(frozen=True, slots=True)
class CollectorTuning:
    """What :func:`tune_collector` did, for the start-up log line."""

    frozen: int  # objects moved to the permanent generation
    thresholds: tuple[int, int, int]  # the collector's thresholds afterwards


def tune_collector(young_threshold: int) -> CollectorTuning | None:
    """Freeze what start-up allocated and raise the youngest generation's threshold.

    ``young_threshold`` 0 leaves the collector exactly as Python set it
    (and returns None).  Call it once, after the configuration is loaded and
    before the event loop runs.
    """
    if young_threshold == 0:
        return None
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
    return CollectorTuning(gc.get_freeze_count(), (young_threshold, middle, old))
