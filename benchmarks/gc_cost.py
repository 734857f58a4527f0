"""What Python's garbage collector costs the router: its time per request and its pauses.

Runs one of ``run_router_overhead.py``'s router scenarios with the router's
``[server] gc_young_threshold`` set to each value of ``--thresholds`` (``0``:
Python's own collector, untouched; the default: start-up objects frozen and
the youngest generation's threshold raised, see
``epd_actors/program/collector.py``), rounds interleaved.  The router runs
under a small wrapper that records every collection (``gc.callbacks``: when
it started, how long it took, which generation); the collections during the
measured load, after a warm-up, are counted.  Prints, per threshold and
round, the collections of each generation, the collector's milliseconds per
request, the longest pause, and the router's CPU per request::

    python benchmarks/gc_cost.py --token-s 0.01 --step-clock
    python benchmarks/gc_cost.py --scenario native-pd --token-s 0.01 --step-clock

The collector's own time is a count of work that the machine's load moves
little; the router's CPU per request moves by 10-20 % between runs here, so
read it as the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from count_calls import MAX_TOKENS, ROUTER_SCENARIOS
from harness import cpu_seconds, run_bench, start_scenario
from run_router_overhead import add_pacing_arguments, scenarios

# Run as ``python -c WATCH OUT serve ...``: record each collection, write them to OUT at exit.
WATCH = """
import atexit, gc, json, runpy, sys, time
out = sys.argv.pop(1)
collections, started = [], [0.0]
def watch(phase, info):
    if phase == "start":
        started[0] = time.monotonic()
    else:
        collections.append((started[0], time.monotonic() - started[0], info["generation"]))
gc.callbacks.append(watch)
def write():
    with open(out, "w") as handle:
        json.dump(collections, handle)
atexit.register(write)
sys.argv[0] = "epd_actors"
runpy.run_module("epd_actors", run_name="__main__", alter_sys=True)
"""


def measure(args: argparse.Namespace, threshold: int, workdir: Path) -> dict[str, float]:
    """One round at ``threshold``: collections, collector ms per request, CPU ms per request."""
    scenario = scenarios(args.token_s, step_clock=args.step_clock)[args.scenario]
    out = workdir / f"gc-{threshold}.json"
    python = (sys.executable, "-c", WATCH, str(out))
    lines = (f"gc_young_threshold = {threshold}",)
    with ExitStack() as stack:
        start_scenario(scenario, stack, workdir, router_python=python, server_lines=lines)
        assert scenario.router is not None
        pid = scenario.router.popen.pid

        def load(requests: int, name: str) -> dict[str, object]:
            return run_bench(
                scenario.url,
                concurrency=args.concurrency,
                requests=requests,
                max_tokens=MAX_TOKENS,
                cores=None,
                out=workdir / name,
            )

        load(args.warmup, "warmup.json")
        # time.monotonic: the clock the router's watcher reads too (a plain script, no event loop).
        began, cpu = time.monotonic(), cpu_seconds(pid)  # noqa: TID251
        document = load(args.requests, "bench.json")
        cpu, ended = cpu_seconds(pid) - cpu, time.monotonic()  # noqa: TID251
    summary = document["summary"]
    assert isinstance(summary, dict)
    completed = int(summary["completed"])
    during = [(s, g) for at, s, g in json.loads(out.read_text()) if began <= at <= ended]
    row = {f"gen{g}": float(sum(1 for _, gen in during if gen == g)) for g in (0, 1, 2)}
    row["gc_ms_per_req"] = sum(s for s, _ in during) * 1000 / completed
    row["longest_ms"] = max((s for s, _ in during), default=0.0) * 1000
    row["cpu_ms_per_req"] = cpu * 1000 / completed
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=ROUTER_SCENARIOS, default="http-pd")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--thresholds", default="0,20000", help="gc_young_threshold values (0: Python's own)"
    )
    add_pacing_arguments(parser)
    args = parser.parse_args()
    thresholds = [int(t) for t in args.thresholds.split(",")]
    rows: dict[int, list[dict[str, float]]] = {t: [] for t in thresholds}
    print("| gc_young_threshold | round | gen0 | gen1 | gen2 | GC ms/req | longest | CPU ms/req |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for round_ in range(1, args.rounds + 1):
        for threshold in thresholds:
            with tempfile.TemporaryDirectory(prefix="epd-gc-") as tmp:
                row = measure(args, threshold, Path(tmp))
            rows[threshold].append(row)
            print(
                f"| {threshold} | {round_} | {row['gen0']:.0f} | {row['gen1']:.0f} "
                f"| {row['gen2']:.0f} | {row['gc_ms_per_req']:.3f} | {row['longest_ms']:.1f} ms "
                f"| {row['cpu_ms_per_req']:.2f} |",
                flush=True,
            )
    for threshold, measured in rows.items():  # medians of the rounds
        cpu = statistics.median(r["cpu_ms_per_req"] for r in measured)
        gc_ms = statistics.median(r["gc_ms_per_req"] for r in measured)
        print(f"gc_young_threshold {threshold}: GC {gc_ms:.3f} ms/req, CPU {cpu:.2f} ms/req")
    return 0


if __name__ == "__main__":
    sys.exit(main())
