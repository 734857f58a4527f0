"""``serve --processes N``: requests/s and router CPU per request for N = 1, 2, 4.

Starts simulated PD workers (0 s per token, 16 tokens per delta: the router's
cost dominates) and one router per process count over them, all on loopback,
then measures in interleaved rounds (round 1: every count, then round 2, ...)
so slow drifts of a shared machine hit every count alike.  The report takes
medians over rounds and gives each count's ratios against 1 process of the
same run.  Router CPU is the user + system CPU of the parent and every router
process (``/proc``), per completed request.  Writes
``benchmarks/results/processes.json``.

    python benchmarks/run_processes.py                      # defaults: ~2 minutes
    python benchmarks/run_processes.py --processes 1,2,4,8 --concurrency 64 --rounds 5

With fewer cores than router processes + workers + load generator, the
processes share cores and the ratios say more about the machine than about
the router: say how many cores the run had next to its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    ANNOUNCE,
    FAST_SIM,
    ROUTER_ANNOUNCE,
    Process,
    _env,
    cpu_seconds,
    median,
    router_argv,
    router_toml,
    run_bench,
    worker_argv,
)

RESULTS = Path(__file__).resolve().parent / "results"
PROCESS_LINE = re.compile(r"router process (\d+): pid (\d+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2,4", help="router process counts")
    parser.add_argument("--workers", type=int, default=2, help="simulated PD workers")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=600, help="per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="processes", help="results file stem")
    return parser.parse_args(argv)


def start_router(config: Path, count: int, env: dict[str, str], stack: ExitStack) -> tuple:
    """The router with ``count`` processes; returns (url, pids of parent and children)."""
    argv = [*router_argv(config, cores=None), "--processes", str(count)]
    router = Process(argv, env=env, pattern=ROUTER_ANNOUNCE)
    stack.callback(router.stop)
    pids = [router.pid]
    if count > 1:
        assert router.popen.stdout is not None
        while len(pids) < count + 1:
            match = PROCESS_LINE.search(router.popen.stdout.readline())
            if match:
                pids.append(int(match.group(2)))
    return router.announced, pids


def measure(url: str, pids: list[int], args: argparse.Namespace, out: Path) -> dict:
    cpu0 = sum(cpu_seconds(pid) for pid in pids)
    document = run_bench(
        url,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        cores=None,
        out=out,
    )
    cpu = sum(cpu_seconds(pid) for pid in pids) - cpu0
    summary = document["summary"]
    completed = summary["completed"]
    return {
        "completed": completed,
        "errors": summary["errors"],
        "req_per_s": summary["request_rate"],
        "tokens_per_s": summary["output_token_rate"],
        "router_cpu_s": cpu,
        "router_cpu_ms_per_req": cpu / completed * 1000 if completed else None,
        "router_cpu_util": cpu / summary["duration_s"],
        "bench_cpu_util": summary["client_cpu_util"],
    }


def table(rows: dict[int, list[dict]]) -> list[dict]:
    base_rate = median([r["req_per_s"] for r in rows[min(rows)]])
    base_cpu = median([r["router_cpu_ms_per_req"] for r in rows[min(rows)]])
    result = []
    for count, measured in sorted(rows.items()):
        rate = median([r["req_per_s"] for r in measured])
        cpu = median([r["router_cpu_ms_per_req"] for r in measured])
        result.append(
            {
                "processes": count,
                "req_per_s": rate,
                "req_per_s_ratio": rate / base_rate,
                "router_cpu_ms_per_req": cpu,
                "router_cpu_ratio": cpu / base_cpu,
                "router_cpu_util": median([r["router_cpu_util"] for r in measured]),
                "bench_cpu_util": median([r["bench_cpu_util"] for r in measured]),
                "errors": sum(sum(r["errors"].values()) for r in measured),
            }
        )
    return result


def markdown(result: list[dict]) -> str:
    lines = [
        "| processes | req/s | ratio to 1 | router CPU ms/req | ratio to 1 "
        "| router CPU util | bench CPU util | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result:
        lines.append(
            f"| {row['processes']} | {row['req_per_s']:.0f} | {row['req_per_s_ratio']:.2f} "
            f"| {row['router_cpu_ms_per_req']:.3f} | {row['router_cpu_ratio']:.2f} "
            f"| {row['router_cpu_util']:.2f} | {row['bench_cpu_util']:.2f} | {row['errors']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(c) for c in args.processes.split(",")]
    env = _env("processes-bench-token")
    rows: dict[int, list[dict]] = {count: [] for count in counts}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="procs-bench-") as work:
        workdir = Path(work)
        endpoints = []
        for index in range(args.workers):
            argv = worker_argv("pd", f"pd-{index}", work, cores=None, openai=False, extra=FAST_SIM)
            worker = Process(argv, env=env, pattern=ANNOUNCE)
            stack.callback(worker.stop)
            endpoints.append(("pd", f"pd-{index}", worker.announced))
        config = workdir / "router.toml"
        config.write_text(router_toml(endpoints, backend="native"), encoding="utf-8")
        routers = {count: start_router(config, count, env, stack) for count in counts}
        for url, pids in routers.values():  # warm-up: connections, caches
            measure(url, pids, argparse.Namespace(**{**vars(args), "requests": 100}), workdir / "w")
        for round_index in range(args.rounds):
            for count in counts:
                url, pids = routers[count]
                row = measure(url, pids, args, workdir / f"{count}-{round_index}.json")
                rows[count].append(row)
                print(f"round {round_index + 1} processes {count}: {row}", flush=True)
    result = table(rows)
    document = {
        "cores": os.cpu_count(),
        "args": vars(args),
        "table": result,
        "rows": {str(k): v for k, v in rows.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(document, indent=2), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
