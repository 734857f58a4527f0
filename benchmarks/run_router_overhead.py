"""Router overhead: throughput, latency and router CPU per request, against a direct baseline.

Starts every scenario's simulated workers (and router) on loopback, warms
each up, then measures in interleaved rounds (round 1: every scenario at
every concurrency, then round 2, ...), so slow drifts of a shared machine
hit every scenario alike; the report takes medians over rounds.  Each round
runs the scenarios in its own shuffled order (``--seed``, printed), so no
scenario always follows the same one (one measured right after ``direct``
read 10-30 % high when the order was fixed).  Besides the medians it reports,
per round, router CPU per request of each scenario over its ``@base``, of each
``@Nproc`` variant over its scenario and of each router over vllm-router, and
the median and range of those paired ratios (``paired`` in the results).
``--stream-coalescing off`` writes ``[server] stream_coalescing = "off"`` into
every router's configuration.  Writes
``benchmarks/results/<name>.json`` and, when matplotlib is importable, PNG
plots next to it.  Stops everything on exit.

    python benchmarks/run_router_overhead.py                       # defaults: ~3 minutes
    python benchmarks/run_router_overhead.py --concurrency 1,8,32,128 --rounds 3 \\
        --router-cores 0 --bench-cores 1                           # pinned (taskset)
    python benchmarks/run_router_overhead.py --scenarios direct,native-epd \\
        --vllm-router /path/to/vllm-router                         # add the peer router
    python benchmarks/run_router_overhead.py --scenarios http-pd,epd-proxy-pd \\
        --epd-proxy VLLM/examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py \\
        --epd-proxy-python /path/to/venv/bin/python                # vLLM's example EPD proxy

Scenarios (simulator: 0 s per output token, 16 tokens per delta; ``--token-s S``
paces every worker at one token per delta every S seconds instead):

* ``direct``: load straight at one simulated PD worker serving vLLM's OpenAI
  HTTP API (``worker --serve-openai``): no router at all.
* ``native-pd``: the router (native backend) over that same one PD worker.
* ``native-epd``: the router over E, P and D workers (native backend).
* ``native-e-pd``: the router over E and PD workers (native backend).
* ``http-epd``: the router's ``openai_http`` backend over E, P and D workers
  that serve vLLM's HTTP API.
* ``http-pd``: the router's ``openai_http`` backend over P and D workers
  that serve vLLM's HTTP API.
* ``vllm-router``: vLLM's router (``pip install vllm-router``), round robin
  over one PD worker serving the HTTP API (needs ``--vllm-router``).
* ``vllm-router-pd``: vLLM's router in its P/D mode
  (``--vllm-pd-disaggregation``) over P and D workers serving the HTTP API
  (needs ``--vllm-router``).
* ``epd-proxy-pd``: vLLM's example EPD proxy (``disagg_epd_proxy.py``,
  FastAPI + uvicorn + aiohttp; needs ``--epd-proxy``) over P and D workers
  serving the HTTP API, with an empty encode list (text prompts never reach E).
* ``epd-proxy-epd``: that proxy over E, P and D workers serving the HTTP API.

``--baseline DIR --baseline-scenarios http-pd`` also runs each named
scenario from another checkout (``git worktree add DIR COMMIT``) as
``http-pd@base``, in the same interleaved rounds: an A/B of two versions.

In the HTTP scenarios with a decode worker, every measurement also reads the
decoders' request logs (``GET /debug/requests``) and records how many decode
requests carried a prefill's KV handle (``handoffs``): the simulated decoder
refuses one without a live handle, so the comparison is of routers that
really hand P's ``kv_transfer_params`` to D.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    FAST_SIM,
    ROUTER_KINDS,
    Scenario,
    check_handoffs,
    median,
    run_bench,
    scrape_stage_metrics,
    stage_means,
    start_scenario,
    tree_cpu_times,
)

RESULTS = Path(__file__).resolve().parent / "results"


def simulator_args(token_s: float | None, *, step_clock: bool = False) -> tuple[str, ...]:
    """The simulated workers' pacing: the standard case (unpaced, 16 tokens per delta), or
    one token per delta every ``token_s`` seconds -- on each stream's own timer, or with
    ``step_clock`` on one clock shared by every stream of a worker (its decode steps)."""
    if token_s is None:
        return FAST_SIM
    paced = ("--sim-output-token-s", str(token_s), "--sim-tokens-per-delta", "1")
    return (*paced, "--sim-step-clock") if step_clock else paced


def add_pacing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--token-s`` and ``--step-clock``, the arguments of :func:`simulator_args`."""
    parser.add_argument(
        "--token-s",
        type=float,
        default=None,
        help="pace every simulated worker: one token per delta every this many seconds "
        "(default: the standard case, unpaced, 16 tokens per delta)",
    )
    parser.add_argument(
        "--step-clock",
        action="store_true",
        help="with --token-s: every stream of a worker gets its token on the same tick, "
        "as in an engine's decode step (default: each stream on its own timer)",
    )


# Engine slots for every stream of the largest concurrency run here.  A native
# worker runs 64 requests at once by default and queues the rest, which would cap
# the native scenarios below the direct baseline (the worker's HTTP API has no cap).
WORKER_SLOTS = ("--max-concurrency", "1024")


def scenarios(token_s: float | None = None, *, step_clock: bool = False) -> dict[str, Scenario]:
    sim = (*simulator_args(token_s, step_clock=step_clock), *WORKER_SLOTS)
    return {
        s.name: s
        for s in (
            Scenario("direct", "one PD worker's own HTTP API, no router", [("pd", sim)], "direct"),
            Scenario("native-pd", "router (native) over one PD worker", [("pd", sim)]),
            Scenario(
                "native-epd",
                "router (native) over E+P+D",
                [("encode", sim), ("prefill", sim), ("decode", sim)],
            ),
            Scenario("native-e-pd", "router (native) over E+PD", [("encode", sim), ("pd", sim)]),
            Scenario(
                "http-epd",
                "router (openai_http backend) over E+P+D HTTP workers",
                [("encode", sim), ("prefill", sim), ("decode", sim)],
                "openai_http",
            ),
            Scenario(
                "http-pd",
                "router (openai_http backend) over P+D HTTP workers",
                [("prefill", sim), ("decode", sim)],
                "openai_http",
            ),
            Scenario(
                "vllm-router", "vllm-router over one PD HTTP worker", [("pd", sim)], "vllm-router"
            ),
            Scenario(
                "vllm-router-pd",
                "vllm-router P/D mode over P+D HTTP workers",
                [("prefill", sim), ("decode", sim)],
                "vllm-router-pd",
            ),
            Scenario(
                "epd-proxy-pd",
                "vLLM's example EPD proxy over P+D HTTP workers",
                [("prefill", sim), ("decode", sim)],
                "epd-proxy",
            ),
            Scenario(
                "trio-floor-pd",
                "the I/O of a P/D relay alone, in Python on Trio (benchmarks/trio_floor.py)",
                [("prefill", sim), ("decode", sim)],
                "trio-floor",
            ),
            Scenario(
                "trio-floor-hub-pd",
                "the same with one task reading every D stream (trio_floor.py --hub)",
                [("prefill", sim), ("decode", sim)],
                "trio-floor-hub",
            ),
            Scenario(
                "epd-proxy-epd",
                "vLLM's example EPD proxy over E+P+D HTTP workers",
                [("encode", sim), ("prefill", sim), ("decode", sim)],
                "epd-proxy",
            ),
        )
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="router_overhead", help="results file stem")
    parser.add_argument(
        "--scenarios", default="direct,native-pd,native-epd,native-e-pd", help="comma-separated"
    )
    parser.add_argument("--concurrency", default="1,8,32,128", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="per measurement (at least)")
    parser.add_argument(
        "--requests-per-client", type=int, default=4, help="raise --requests to conc x this"
    )
    parser.add_argument("--warmup", type=int, default=100, help="per scenario, before round 1")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_pacing_arguments(parser)
    parser.add_argument("--standard-concurrency", type=int, default=32)
    parser.add_argument("--router-cores", default=None, help="taskset -c list for the router")
    parser.add_argument("--bench-cores", default=None, help="taskset -c list for the bench")
    parser.add_argument("--worker-cores", default=None, help="taskset -c list for the workers")
    parser.add_argument("--vllm-router", default=None, help="path of the vllm-router program")
    parser.add_argument(
        "--epd-proxy",
        default=None,
        help="path of vLLM's examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py",
    )
    parser.add_argument(
        "--epd-proxy-python",
        default=sys.executable,
        help="the interpreter that runs --epd-proxy, with fastapi, uvicorn, uvloop and aiohttp "
        "(default: this one)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="another checkout (e.g. a git worktree of an older commit): each scenario of "
        "--baseline-scenarios also runs from it, as '<scenario>@base', interleaved",
    )
    parser.add_argument("--baseline-scenarios", default="", help="comma-separated")
    parser.add_argument(
        "--router-processes",
        type=int,
        default=2,
        help="with --processes-scenarios: how many router processes those variants run",
    )
    parser.add_argument(
        "--processes-scenarios",
        default="",
        help="comma-separated: each also runs as '<scenario>@<N>proc', our router with "
        "[server] processes = --router-processes (its CPU: the parent and every process)",
    )
    parser.add_argument("--out-dir", default=str(RESULTS), help="default benchmarks/results")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--stream-coalescing",
        choices=("ready", "off"),
        default="ready",
        help="the routers' [server] stream_coalescing",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="of the per-round scenario order (default: random)"
    )
    return parser.parse_args(argv)


_HANDOFF_SEQ: dict[str, dict[str, int]] = {}
"""Per scenario: the last request-log sequence number seen on each decoder."""


def measure(scenario: Scenario, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    requests = max(args.requests, concurrency * args.requests_per_client)
    router_pid = scenario.router_pid
    # One process's /metrics is not the router's when it runs several.
    ours = scenario.kind in ROUTER_KINDS and not scenario.server_lines
    metrics_url = scenario.url if ours else None
    before = scrape_stage_metrics(metrics_url) if metrics_url else {}
    seen = _HANDOFF_SEQ.setdefault(scenario.name, {})
    check_handoffs(scenario, after_seq=seen)  # skip what came before this measurement
    times0 = tree_cpu_times(router_pid) if router_pid else (0.0, 0.0)
    document = run_bench(
        scenario.url,
        concurrency=concurrency,
        requests=requests,
        max_tokens=args.max_tokens,
        cores=args.bench_cores,
        out=out,
        extra=("--records",),
    )
    times1 = tree_cpu_times(router_pid) if router_pid else (0.0, 0.0)
    after = scrape_stage_metrics(metrics_url) if metrics_url else {}
    handoffs = check_handoffs(scenario, after_seq=seen)
    summary = document["summary"]
    completed = summary["completed"]
    router_user, router_system = times1[0] - times0[0], times1[1] - times0[1]
    router_cpu = router_user + router_system
    served = [r for r in document.get("records", []) if r.get("error") is None]
    return {
        "scenario": scenario.name,
        "concurrency": concurrency,
        "requests": summary["requests"],
        "completed": completed,
        "errors": summary["errors"],
        "duration_s": summary["duration_s"],
        "req_per_s": summary["request_rate"],
        "tokens_per_s": summary["output_token_rate"],
        "ttft_p50_ms": _ms(summary["ttft"]["p50"]),
        "ttft_p99_ms": _ms(summary["ttft"]["p99"]),
        "e2e_p50_ms": _ms(summary["e2e"]["p50"]),
        "e2e_p99_ms": _ms(summary["e2e"]["p99"]),
        "itl_p50_ms": _ms(summary["itl"]["p50"]),
        "sse_events_per_req": (sum(r["events"] for r in served) / len(served) if served else None),
        "router_cpu_s": router_cpu if router_pid else None,
        "router_cpu_ms_per_req": (
            router_cpu / completed * 1000 if router_pid and completed else None
        ),
        "router_user_ms_per_req": (
            router_user / completed * 1000 if router_pid and completed else None
        ),
        "router_system_ms_per_req": (
            router_system / completed * 1000 if router_pid and completed else None
        ),
        "router_cpu_util": router_cpu / summary["duration_s"] if router_pid else None,
        "bench_cpu_util": summary["client_cpu_util"],
        "bench_cpu_ms_per_req": summary["client_cpu_s"] / max(1, summary["requests"]) * 1000,
        "stage_mean_ms": {k: v * 1000 for k, v in stage_means(before, after).items()},
        "handoffs": handoffs.as_dict() if handoffs.requests else None,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def aggregate(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Medians over rounds, per (scenario, concurrency)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["concurrency"]), []).append(row)
    table = []
    for (name, concurrency), group in groups.items():
        entry: dict[str, object] = {"scenario": name, "concurrency": concurrency}
        for key in keys:
            values = [r[key] for r in group if r[key] is not None]
            entry[key] = median(values) if values else None
        stages: dict[str, list[float]] = {}
        for row in group:
            for stage, value in row["stage_mean_ms"].items():
                stages.setdefault(stage, []).append(value)
        entry["stage_mean_ms"] = {stage: median(v) for stage, v in stages.items()}
        entry["errors"] = sum(r["requests"] - r["completed"] for r in group)
        checked = [r["handoffs"] for r in group if r.get("handoffs")]
        if checked:
            entry["handoffs"] = {k: sum(c[k] for c in checked) for k in checked[0]}
        entry["rounds"] = len(group)
        table.append(entry)
    return table


KEYS = (
    "req_per_s",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "itl_p50_ms",
    "router_cpu_ms_per_req",
    "router_user_ms_per_req",
    "router_system_ms_per_req",
    "router_cpu_util",
    "bench_cpu_util",
    "bench_cpu_ms_per_req",
    "sse_events_per_req",
)


REFERENCE = "vllm-router-pd"
"""The peer every router scenario's CPU per request is also paired with, when it ran."""


def paired_ratios(rows: list[dict], key: str = "router_cpu_ms_per_req") -> list[dict]:
    """``key`` of one scenario over another's, taken in each round where both ran.

    The pairs: each ``<scenario>`` over its ``<scenario>@base``, each
    ``<scenario>@<N>proc`` over its ``<scenario>``, and every scenario with a
    router over vllm-router.  Two scenarios of one round ran minutes apart under
    the same load on the machine, so the ratio of a round moves less than either
    median does; the median of the rounds' ratios and their range say how sure
    a comparison is.
    """
    values = {(r["scenario"], r["concurrency"], r["round"]): r.get(key) for r in rows}
    names = sorted({r["scenario"] for r in rows})
    concurrencies = sorted({r["concurrency"] for r in rows})
    rounds = sorted({r["round"] for r in rows})
    pairs = []
    for name in names:
        # A checkout's code over the baseline's; N processes over one.
        plain, _, variant = name.partition("@")
        if variant and plain in names:
            pairs.append((plain, name) if variant == "base" else (name, plain))
    if REFERENCE in names:
        pairs += [(n, REFERENCE) for n in names if n not in (REFERENCE, "direct")]
    found = []
    for name, reference in pairs:
        for concurrency in concurrencies:
            ratios = []
            for round_index in rounds:
                value = values.get((name, concurrency, round_index))
                other = values.get((reference, concurrency, round_index))
                if value and other:
                    ratios.append(value / other)
            if ratios:
                found.append(
                    {
                        "scenario": name,
                        "reference": reference,
                        "concurrency": concurrency,
                        "key": key,
                        "median": median(ratios),
                        "low": min(ratios),
                        "high": max(ratios),
                        "rounds": len(ratios),
                    }
                )
    return found


def paired_lines(pairs: list[dict]) -> list[str]:
    """One line per pair: ``a / b  c=N  median (low-high) over R rounds``."""
    return [
        f"{p['scenario']} / {p['reference']}  c={p['concurrency']}  {p['median']:.2f} "
        f"({p['low']:.2f}-{p['high']:.2f}) over {p['rounds']} rounds"
        for p in pairs
    ]


def markdown_table(table: list[dict], standard: int) -> str:
    direct = {e["concurrency"]: e["req_per_s"] for e in table if e["scenario"] == "direct"}
    lines = [
        "| scenario | conc | req/s | vs direct | tokens/s | TTFT p50 ms | TTFT p99 ms "
        "| e2e p50 ms | router CPU ms/req (user + system) | SSE events/req | router CPU util "
        "| bench CPU util | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in sorted(table, key=lambda e: (e["scenario"], e["concurrency"])):
        base = direct.get(e["concurrency"])
        ratio = f"{e['req_per_s'] / base:.2f}" if base else "-"
        mark = " *" if e["concurrency"] == standard else ""
        split = f"{_f(e.get('router_user_ms_per_req'), 2)} + "
        split += _f(e.get("router_system_ms_per_req"), 2)
        lines.append(
            f"| {e['scenario']} | {e['concurrency']}{mark} | {_f(e['req_per_s'], 0)} | {ratio} "
            f"| {_f(e['tokens_per_s'], 0)} | {_f(e['ttft_p50_ms'], 1)} | {_f(e['ttft_p99_ms'], 1)} "
            f"| {_f(e['e2e_p50_ms'], 1)} | {_f(e['router_cpu_ms_per_req'], 2)} "
            f"({split}) "
            f"| {_f(e.get('sse_events_per_req'), 1)} | {_f(e['router_cpu_util'], 2)} "
            f"| {_f(e['bench_cpu_util'], 2)} | {e['errors']} |"
        )
    return "\n".join(lines)


def _handoff_note(handoffs: dict[str, int] | None) -> str:
    if not handoffs:
        return ""
    return (
        f"  D got P's handle {handoffs['with_handle']}/{handoffs['requests']} (ok {handoffs['ok']})"
    )


def _f(value: object, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def plot(table: list[dict], standard: int, stem: Path) -> list[str]:
    """PNG plots next to the JSON; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    names = sorted({e["scenario"] for e in table})
    written = []

    def series(name: str, key: str) -> tuple[list[int], list[float]]:
        points = sorted(
            (e["concurrency"], e[key])
            for e in table
            if e["scenario"] == name and e[key] is not None
        )
        return [p[0] for p in points], [p[1] for p in points]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in names:
        for axis, key in zip(axes, ("ttft_p50_ms", "e2e_p50_ms", "req_per_s"), strict=True):
            xs, ys = series(name, key)
            axis.plot(xs, ys, marker="o", label=name)
    for axis, title in zip(
        axes, ("TTFT p50 (ms)", "end-to-end p50 (ms)", "throughput (req/s)"), strict=True
    ):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}-latency.png", dpi=110)
    plt.close(fig)
    written.append(f"{stem.name}-latency.png")

    fig, axis = plt.subplots(figsize=(6, 4.2))
    for name in names:
        xs, ys = series(name, "router_cpu_ms_per_req")
        if xs:
            axis.plot(xs, ys, marker="o", label=name)
    axis.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="target 1.5 ms")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrency")
    axis.set_ylabel("router CPU ms / request")
    axis.set_title("router CPU per request")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}-router-cpu.png", dpi=110)
    plt.close(fig)
    written.append(f"{stem.name}-router-cpu.png")

    at_standard = [e for e in table if e["concurrency"] == standard and e["stage_mean_ms"]]
    if at_standard:
        fig, axis = plt.subplots(figsize=(7, 4.2))
        stages = sorted({s for e in at_standard for s in e["stage_mean_ms"]})
        labels = [e["scenario"] for e in at_standard]
        bottoms = [0.0] * len(at_standard)
        for stage in stages:
            heights = [e["stage_mean_ms"].get(stage, 0.0) for e in at_standard]
            axis.bar(labels, heights, bottom=bottoms, label=stage)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        e2e = [e["e2e_p50_ms"] or 0.0 for e in at_standard]
        axis.scatter(labels, e2e, color="black", marker="_", s=600, label="client e2e p50")
        axis.set_ylabel("ms (mean per request, router's view)")
        axis.set_title(f"per-stage time at concurrency {standard}")
        axis.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{stem}-stages.png", dpi=110)
        plt.close(fig)
        written.append(f"{stem.name}-stages.png")
    return written


def checkout_name(source: str) -> str:
    """How results name a baseline checkout: its commit, not where it lies on this machine."""
    try:
        done = subprocess.run(
            ["git", "-C", source, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "another checkout"
    return f"commit {done.stdout.strip()}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    known = scenarios(args.token_s, step_clock=args.step_clock)
    chosen = [known[n] for n in args.scenarios.split(",") if n]
    if args.baseline:
        source = str(Path(args.baseline).resolve())
        for name in filter(None, args.baseline_scenarios.split(",")):
            base = scenarios(args.token_s, step_clock=args.step_clock)[name]
            base.name, base.source = f"{name}@base", source
            base.description += f" (from {checkout_name(source)})"
            chosen.append(base)
    processes = args.router_processes
    for name in filter(None, args.processes_scenarios.split(",")):
        variant = scenarios(args.token_s, step_clock=args.step_clock)[name]
        if variant.kind not in ROUTER_KINDS:
            raise SystemExit(f"--processes-scenarios: {name} is not a scenario of this router")
        variant.name = f"{name}@{processes}proc"
        variant.description += f" (serve --processes {processes})"
        variant.server_lines = (f"processes = {processes}",)
        chosen.append(variant)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    results = Path(args.out_dir)
    results.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        workdir = Path(tmp)
        for scenario in chosen:
            start_scenario(
                scenario,
                stack,
                workdir,
                router_cores=args.router_cores,
                worker_cores=args.worker_cores,
                vllm_router=args.vllm_router,
                epd_proxy=args.epd_proxy,
                epd_proxy_python=args.epd_proxy_python,
                server_lines=(f'stream_coalescing = "{args.stream_coalescing}"',),
            )
            warm = run_bench(
                scenario.url,
                concurrency=min(32, max(concurrencies)),
                requests=max(1, args.warmup),
                max_tokens=args.max_tokens,
                cores=args.bench_cores,
                out=workdir / "warmup.json",
            )
            print(
                f"{scenario.name}: up at {scenario.url}, warm-up "
                f"{warm['summary']['completed']}/{warm['summary']['requests']} ok",
                flush=True,
            )
        seed = args.seed if args.seed is not None else random.randrange(2**32)
        shuffler = random.Random(seed)
        print(f"scenario order seed {seed}", flush=True)
        for round_index in range(args.rounds):
            order = shuffler.sample(chosen, len(chosen))
            print(f"round {round_index + 1} order: {', '.join(s.name for s in order)}", flush=True)
            for concurrency in concurrencies:
                for scenario in order:
                    row = measure(scenario, concurrency, args, workdir / "run.json")
                    row["round"] = round_index
                    rows.append(row)
                    print(
                        f"round {round_index + 1} {scenario.name:<12} c={concurrency:<4} "
                        f"{row['req_per_s']:8.1f} req/s  TTFT p50 {_f(row['ttft_p50_ms'], 1)} ms  "
                        f"router {_f(row['router_cpu_ms_per_req'], 2)} ms/req  "
                        f"events {_f(row['sse_events_per_req'], 1)}/req  "
                        f"errors {row['requests'] - row['completed']}"
                        + _handoff_note(row["handoffs"]),
                        flush=True,
                    )
    table = aggregate(rows, KEYS)
    stem = results / args.name
    document = {
        "name": args.name,
        "settings": {
            "scenarios": {s.name: s.description for s in chosen},
            "concurrency": concurrencies,
            "rounds": args.rounds,
            "requests": args.requests,
            "requests_per_client": args.requests_per_client,
            "max_tokens": args.max_tokens,
            "simulator": " ".join(simulator_args(args.token_s, step_clock=args.step_clock)),
            "router_cores": args.router_cores,
            "bench_cores": args.bench_cores,
            "worker_cores": args.worker_cores,
            "stream_coalescing": args.stream_coalescing,
            "seed": seed,
        },
        "machine": machine(),
        "medians": table,
        "paired": paired_ratios(rows),
        "rows": rows,
    }
    if not args.no_plots:
        document["plots"] = plot(table, args.standard_concurrency, stem)
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(markdown_table(table, args.standard_concurrency))
    if document["paired"]:
        print("router CPU per request, paired in each round (median, range):")
        for line in paired_lines(document["paired"]):
            print(f"  {line}")
    print(f"wrote {stem.with_suffix('.json').name} in {results.name}/")
    return 0


def machine() -> dict[str, object]:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


if __name__ == "__main__":
    sys.exit(main())
