"""A short soak: benchmarks/soak.py's run, in the suite, with every kind of fault.

A router process in front of six worker processes (E+P+D, two per pool),
under steady streamed load for about 25 seconds while workers are killed,
paused, restarted, drained and added again.  It asserts invariants only --
no request breaks one (one terminal event, never ``[DONE]`` after an error,
the simulator's text and nothing else, no hang), nothing is left at the
router, on the workers or in the KV store, and the fleet serves again once
healed -- never rates, which depend on the machine.  The figures of a
ten-minute run are in docs/reliability.md ("Soak").
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

if TYPE_CHECKING:
    from types import ModuleType

pytestmark = pytest.mark.processes

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GUARD_S = 150.0


def soak_module() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("soak")


async def test_a_short_soak_under_chaos_breaks_no_invariant(tmp_path: Path) -> None:
    soak = soak_module()
    settings = soak.SoakSettings(duration_s=25.0, concurrency=8, seed=7, chaos_interval_s=1.5)
    with trio.fail_after(GUARD_S):
        summary = await soak.run_soak(settings, tmp_path)

    assert summary["violations"] == 0, summary["violation_examples"]
    # Every kind of fault happened (the chaos picks the kind injected least so far).
    assert set(summary["faults"]) == set(soak.Chaos.KINDS), summary["faults"]
    assert all(count >= 1 for count in summary["faults"].values())
    # Failures are typed answers: status and code, or an SSE error event's code.
    assert all(kind.startswith(("stream:", "4", "5")) for kind in summary["failures"])
    assert summary["successes"] + sum(summary["failures"].values()) == summary["requests"]
    assert summary["successes"] > 0
    # Nothing left behind, and the healed fleet serves every request.
    assert set(summary["worker_loads"].values()) == {0}
    assert summary["kv_handles"]["leaked"] == 0
    assert summary["after_healing_ok"] == soak.AFTER_REQUESTS
