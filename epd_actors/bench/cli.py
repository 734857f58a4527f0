"""``python -m epd_actors bench``: load any OpenAI-compatible endpoint and summarise.

Examples::

    python -m epd_actors bench --url http://127.0.0.1:8000 --concurrency 32 --requests 2000
    python -m epd_actors bench --url http://127.0.0.1:8000 --rate 200 --duration 30 \\
        --images 1 --image-bytes 200000 --mm-fraction 0.5 --json out.json
    python -m epd_actors bench --url http://127.0.0.1:8000 --sweep concurrency=1,4,16 \\
        --requests 500 --plot sweep.png

Run it on its own core (``taskset -c 1 python -m epd_actors bench ...``) so it
does not compete with the server; it prints its own CPU use (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import TYPE_CHECKING

import trio

from .client import Target
from .payload import Workload
from .plot import PlotUnavailable, plot_sweep, require_pyplot
from .progress import progress_stream
from .runner import LoadSpec, RunResult, is_finite_positive, run_load
from .stats import format_summary, parse_percentiles, parse_slos, summarize
from .sweep import SWEEPABLE, SweepPoint, format_sweep_table, single_point, sweep_points

if TYPE_CHECKING:
    from .stats import RequestRecord, Summary


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``bench`` subcommand."""
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="sim-model", help="the model field (default sim-model)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="bearer token sent with every request (default: $OPENAI_API_KEY, else none)",
    )
    parser.add_argument(
        "--endpoint", choices=["chat", "completions"], default="chat", help="default chat"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop (default 32)")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson req/s")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int, default=None, help="default 1000")
    amount.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="send for this long instead of a number of requests",
    )
    parser.add_argument("--warmup", type=int, default=0, help="unrecorded requests first")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument(
        "--prompt-words", type=int, default=32, help="words in each generated prompt"
    )
    parser.add_argument("--images", type=int, default=0, help="images per multimodal request")
    parser.add_argument("--image-bytes", type=int, default=64 * 1024, help="size of each PNG")
    parser.add_argument(
        "--mm-fraction", type=float, default=1.0, help="share of requests with images"
    )
    parser.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="default: stream"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS", help="per-request timeout"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=4096, help="open loop: drop arrivals above this"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument("--json", default=None, metavar="PATH", help="write results here")
    parser.add_argument(
        "--records", action="store_true", help="include every request's record in the JSON"
    )
    parser.add_argument(
        "--max-failure-ratio",
        type=float,
        default=None,
        metavar="RATIO",
        help="exit 1 when more than this share of the requests failed (0 to 1; default: "
        "exit 1 only when none succeeded)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="service-level objectives for goodput, e.g. ttft:200 tpot:50 (metrics: ttft, "
        "tpot, e2e; milliseconds)",
    )
    parser.add_argument(
        "--percentiles",
        default="50,90,99",
        help="comma-separated percentiles of every latency (default 50,90,99)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress line (default: when stdout is a terminal)",
    )
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="NAME=V1,V2,...",
        help=f"one run per value, then a table with a row per run (NAME: {', '.join(SWEEPABLE)}; "
        "e.g. concurrency=1,4,16 or rate=5,10,20); replaces --concurrency and --rate",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw TTFT and ITL percentiles and throughput per run (sweep point) to this PNG "
        "(needs the bench extra: matplotlib)",
    )


def _check(args: argparse.Namespace) -> str | None:
    if args.concurrency is not None and args.concurrency < 1:
        return "--concurrency must be >= 1"
    if args.rate is not None and not is_finite_positive(args.rate):
        return "--rate must be > 0"
    if args.requests is not None and args.requests < 1:
        return "--requests must be >= 1"
    if args.duration is not None and not is_finite_positive(args.duration):
        return "--duration must be > 0"
    if args.max_tokens < 1 or args.prompt_words < 1:
        return "--max-tokens and --prompt-words must be >= 1"
    if args.images < 0 or args.image_bytes < 1:
        return "--images must be >= 0 and --image-bytes >= 1"
    if not 0.0 <= args.mm_fraction <= 1.0:
        return "--mm-fraction must be in [0, 1]"
    if args.images and args.endpoint != "chat":
        return "--images needs --endpoint chat"
    if args.max_failure_ratio is not None and not 0.0 <= args.max_failure_ratio <= 1.0:
        return "--max-failure-ratio must be in [0, 1]"
    if args.sweep is not None and (args.concurrency is not None or args.rate is not None):
        return "--sweep sets the load of each run: drop --concurrency and --rate"
    try:
        parse_slos(args.goodput or ())
        parse_percentiles(args.percentiles)
        if args.sweep is not None:
            sweep_points(LoadSpec(), args.sweep)
    except ValueError as exc:
        return str(exc)
    return None


def exit_status(summary: Summary, max_failure_ratio: float | None) -> int:
    """1 when the run failed by the chosen measure (see ``--max-failure-ratio``), else 0."""
    if summary.completed == 0:
        return 1
    if max_failure_ratio is not None and summary.failure_ratio > max_failure_ratio:
        return 1
    return 0


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(
        model=args.model,
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        images=args.images,
        image_bytes=args.image_bytes,
        mm_fraction=args.mm_fraction,
        stream=args.stream,
    )


def load_from_args(args: argparse.Namespace) -> LoadSpec:
    requests = args.requests
    if requests is None and args.duration is None:
        requests = 1000
    return LoadSpec(
        concurrency=args.concurrency or 32,
        rate=args.rate,
        requests=requests,
        duration_s=args.duration,
        warmup=args.warmup,
        timeout_s=args.timeout,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
    )


def _record_json(record: RequestRecord) -> dict[str, object]:
    return {
        "start": record.start,
        "ttft": record.ttft,
        "e2e": record.e2e,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "stages": record.stages,
        "events": record.events,
        "status": record.status,
        "error": record.error,
    }


def result_json(
    args: argparse.Namespace, workload: Workload, load: LoadSpec, result: RunResult
) -> dict[str, object]:
    """What ``--json`` writes."""
    document: dict[str, object] = {
        "url": args.url,
        "mode": "closed" if load.rate is None else "open",
        "workload": {
            "model": workload.model,
            "endpoint": workload.endpoint,
            "max_tokens": workload.max_tokens,
            "prompt_words": workload.prompt_words,
            "images": workload.images,
            "image_bytes": workload.image_bytes,
            "mm_fraction": workload.mm_fraction,
            "stream": workload.stream,
        },
        "load": {
            "concurrency": None if load.rate is not None else load.concurrency,
            "rate": load.rate,
            "requests": load.requests,
            "duration_s": load.duration_s,
            "warmup": load.warmup,
        },
        "summary": result.summary.to_json(),
        "connections_opened": result.connections_opened,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }
    if args.records:
        document["records"] = [_record_json(r) for r in result.records]
    return document


def _points(args: argparse.Namespace) -> list[SweepPoint]:
    base = load_from_args(args)
    return sweep_points(base, args.sweep) if args.sweep else [single_point(base)]


def _run_point(
    args: argparse.Namespace, target: Target, workload: Workload, point: SweepPoint
) -> RunResult:
    """One run (one sweep point), summarised and printed."""
    load = point.load
    mode = f"rate {load.rate:g}/s" if load.rate is not None else f"concurrency {load.concurrency}"
    amount = f"{load.requests} requests" if load.requests else f"{load.duration_s:g} s"
    title = f"bench {target.url}: {mode}, {amount}, max_tokens {workload.max_tokens}"
    label = point.label if args.sweep else ""
    progress = progress_stream(args.progress)
    result = trio.run(
        lambda: run_load(target, workload, load, progress=progress, progress_label=label)
    )
    result.summary = summarize(
        result.records,
        duration_s=result.summary.duration_s,
        client_cpu_s=result.summary.client_cpu_s,
        percentiles=parse_percentiles(args.percentiles),
        slos=parse_slos(args.goodput or ()),
    )
    print(format_summary(result.summary, title=title), flush=True)
    return result


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``python -m epd_actors bench``; returns the exit status.

    With ``--sweep`` the points run one after another (each its own warm-up
    and connections), a table follows, ``--json`` writes a list with one
    document per point, and the status is 1 when any point failed.
    """
    problem = _check(args)
    if problem is not None:
        print(f"epd_actors bench: {problem}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            require_pyplot()
        except PlotUnavailable as exc:
            print(f"epd_actors bench: {exc}", file=sys.stderr)
            return 2
    workload = workload_from_args(args)
    points = _points(args)
    try:
        target = Target.from_url(args.url, workload.path, api_key=args.api_key)
    except ValueError as exc:
        print(f"epd_actors bench: {exc}", file=sys.stderr)
        return 2
    runs = []
    for point in points:
        if args.sweep:
            print(f"\n== {point.label}", flush=True)
        runs.append((point, _run_point(args, target, workload, point)))
    if args.sweep:
        print("\n" + format_sweep_table([(p, r.summary) for p, r in runs]), flush=True)
    if args.json:
        documents = [result_json(args, workload, p.load, r) for p, r in runs]
        for document, (point, _) in zip(documents, runs, strict=True):
            if args.sweep:
                document["point"] = {"name": point.name, "value": point.value}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(documents if args.sweep else documents[0], handle, indent=1)
            handle.write("\n")
    if args.plot:
        title = f"bench {target.url}, max_tokens {workload.max_tokens}"
        plot_sweep(args.plot, [(p, r.summary) for p, r in runs], title=title)
        print(f"plot written to {args.plot}", flush=True)
    status = 0
    for point, result in runs:
        point_status = exit_status(result.summary, args.max_failure_ratio)
        if point_status and result.summary.completed:
            where = f"{point.label}: " if args.sweep else ""
            print(
                f"epd_actors bench: {where}{result.summary.failure_ratio:.1%} of the requests "
                f"failed, more than --max-failure-ratio {args.max_failure_ratio:g}",
                file=sys.stderr,
            )
        status = max(status, point_status)
    return status
