"""How many Python function calls the router makes per request: a count, not a timing.

On a shared machine CPU time per request moves by 20-30 % from run to run;
the number of calls per request does not move with the machine's load, so
it shows a change of a few per cent that timings cannot.  (It moves a little
with how replies happen to be split across reads.)

Starts the simulated workers of one of ``run_router_overhead.py``'s router
scenarios and the router under ``python -m cProfile``, loads it with the bench
(concurrency 32, 64 output tokens, or ``--max-tokens``) for ``--requests``
requests, stops it, and does the same with ``--requests`` plus ``--extra``
requests.  The difference
between the two profiles, divided by ``--extra``, is the cost per request
without start-up and shut-down.  Prints the calls per request and, with
``--top``, the functions with the most calls per request.  ``--baseline``
counts another checkout the same way, for a before and after::

    python benchmarks/count_calls.py --scenario native-pd
    python benchmarks/count_calls.py --scenario http-pd --token-s 0 --baseline <checkout>
    python benchmarks/count_calls.py --scenario native-pd --token-s 0 --max-tokens 1
"""

from __future__ import annotations

import argparse
import os
import pstats
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import run_bench, start_scenario
from run_router_overhead import add_pacing_arguments, scenarios

ROUTER_SCENARIOS = ("native-pd", "native-epd", "native-e-pd", "http-pd", "http-epd")
MAX_TOKENS = 64

# pstats' raw table: (file, line, function) -> (primitive calls, calls, self s, cum. s, callers)
Table = dict[tuple[str, int, str], tuple[int, int, float, float, object]]


def run_load(
    args: argparse.Namespace, source: str | None, requests: int, workdir: Path, **start: Any
) -> int:
    """Start ``args.scenario`` from ``source`` (``start`` goes to ``start_scenario``),
    load it with ``requests`` requests of ``args.max_tokens`` tokens, stop it; the requests
    completed."""
    scenario = scenarios(args.token_s, step_clock=args.step_clock)[args.scenario]
    scenario.source = source
    with ExitStack() as stack:
        start_scenario(scenario, stack, workdir, **start)
        document = run_bench(
            scenario.url,
            concurrency=args.concurrency,
            requests=requests,
            max_tokens=args.max_tokens,
            cores=None,
            out=workdir / "bench.json",
        )
    summary = document["summary"]
    assert isinstance(summary, dict)
    return int(summary["completed"])


def add_count_arguments(
    parser: argparse.ArgumentParser,
    *,
    requests: int,
    extra: int,
    scenarios: tuple[str, ...] = ROUTER_SCENARIOS,
) -> None:
    """The arguments both counting scripts take (scenario, load sizes, ``--baseline``)."""
    parser.add_argument("--scenario", choices=scenarios, default="native-pd")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=requests, help="the first load")
    parser.add_argument("--extra", type=int, default=extra, help="the second load's extra")
    parser.add_argument("--top", type=int, default=0, help="list the most-called functions")
    parser.add_argument("--baseline", default=None, help="another checkout, counted too")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help="output tokens per request (1: what a request costs without its tokens)",
    )
    add_pacing_arguments(parser)


def checkouts(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(label, source) of this checkout and ``--baseline``'s."""
    found: list[tuple[str, str | None]] = [("this checkout", None)]
    if args.baseline:
        found.append((f"baseline {args.baseline}", args.baseline))
    return found


def profile_load(args: argparse.Namespace, source: str | None, requests: int) -> tuple[int, Table]:
    """Completed requests and the router's profile for one load of ``requests``."""
    with tempfile.TemporaryDirectory(prefix="epd-calls-") as tmp:
        workdir = Path(tmp)
        out = workdir / "router.prof"
        python = (sys.executable, "-m", "cProfile", "-o", str(out), "-m", "epd_actors")
        completed = run_load(args, source, requests, workdir, router_python=python)
        # The router wrote its profile on its way out (the load's end stopped it).
        table: Table = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
        return completed, table


def per_request(args: argparse.Namespace, source: str | None) -> tuple[float, dict[str, float]]:
    """Calls per request in all, and per function, from two loads' difference."""
    done_small, small = profile_load(args, source, args.requests)
    done_large, large = profile_load(args, source, args.requests + args.extra)
    requests = done_large - done_small
    functions: dict[str, float] = {}
    for key, row in large.items():
        calls = row[1] - small.get(key, (0, 0))[1]
        if calls > 0:
            path, line, name = key
            where = path.split("site-packages/")[-1].split(os.sep + "epd_actors" + os.sep)[-1]
            functions[f"{name} ({where}:{line})"] = calls / requests
    return sum(functions.values()), functions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_count_arguments(parser, requests=300, extra=1000)
    args = parser.parse_args()
    for label, source in checkouts(args):
        total, functions = per_request(args, source)
        print(f"{args.scenario}, {label}: {total:,.0f} Python calls per request")
        ranked = sorted(functions.items(), key=lambda item: -item[1])
        for name, calls in ranked[: args.top]:
            print(f"  {calls:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
