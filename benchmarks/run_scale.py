"""Scale: router cost from concurrency 1 to 1,000, and 10,000 streams open on one router.

Two parts, each optional:

* **sweep**: the simulated workers and routers of every scenario start at
  once (as in ``run_router_overhead.py``), then every concurrency is measured
  on every scenario in interleaved rounds, for two simulator speeds: the
  standard case (0 s per token, 16 tokens per delta: the router's own cost
  dominates) and a paced one (``--sim-output-token-s 0.01``: one token per
  delta every 10 ms, like a real decoder).  Reported per point: router CPU
  ms/request, TTFT p50 and its excess over ``direct`` (load straight at a
  simulated PD worker's own HTTP API), req/s.
* **streams**: one router (native backend) over simulated workers paced so
  slowly (``--stream-token-s``, default 2 s per token) that ``--streams``
  (default 10,000) streamed requests are open at once.  Several ``bench``
  processes share the load.  The router's own ``epd_requests_in_flight`` on
  ``/metrics`` and its ``VmRSS`` (``/proc/<pid>/status``) are sampled every
  second: the test passes when the gauge reached ``--streams`` and every
  request completed without an error.  Memory per in-flight request is
  (RSS at the peak - RSS idle after warm-up) / in-flight at that sample.

The limits that stop 10,000 streams by default are raised in the generated
router configuration and worker flags (see :func:`scale_limits` and
docs/benchmarks.md, "Scale").  Writes ``benchmarks/results/<name>.json`` and,
with matplotlib, ``<name>-router-cpu.png``, ``<name>-ttft.png`` and
``<name>-streams.png``.  Stops everything it started on exit.

    python benchmarks/run_scale.py                         # sweep + 10k streams
    python benchmarks/run_scale.py --parts streams --streams 10000
    python benchmarks/run_scale.py --parts sweep --rounds 2 --sims paced
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    ANNOUNCE,
    FAST_SIM,
    ROUTER_ANNOUNCE,
    Process,
    _env,
    _python,
    cpu_seconds,
    median,
    router_argv,
    run_bench,
    taskset_prefix,
    worker_argv,
)
from run_router_overhead import machine, simulator_args

RESULTS = Path(__file__).resolve().parent / "results"
PACED_SIM = simulator_args(0.01)
SIMS = {"standard": FAST_SIM, "paced": PACED_SIM}
TOPOLOGIES = {
    "pd": ("pd",),
    "epd": ("encode", "prefill", "decode"),
    "e-pd": ("encode", "pd"),
}
IN_FLIGHT = re.compile(r"^epd_requests_in_flight (\S+)$", re.MULTILINE)
TOKEN = "scale-benchmark-token"


# -- the limits a large number of open streams needs


@dataclass(frozen=True)
class ScaleLimits:
    """Every limit that caps how many requests one router and its workers hold at once.

    Attributes:
        in_flight: the number of requests that must fit (streams, or the
            largest concurrency); every limit below is derived from it.
    """

    in_flight: int
    headroom: float = 1.1

    @property
    def room(self) -> int:
        return max(64, math.ceil(self.in_flight * self.headroom))

    heartbeat_timeout_s: float = 30.0

    def router_toml_sections(self) -> dict[str, dict[str, float]]:
        """Router configuration keys (table -> key -> value) raised for ``in_flight``.

        ``native.heartbeat_timeout_s``: while thousands of requests arrive, the
        router's event loop (and the worker's) can fall seconds behind, and the
        default 3 s without a ``Pong`` would declare a busy but healthy worker dead.
        """
        return {
            "server.http": {"max_connections": self.room},
            "admission": {"max_requests_in_flight": self.room},
            "actors": {"max_jobs": self.room},
            "native": {"heartbeat_timeout_s": self.heartbeat_timeout_s},
        }

    @property
    def per_worker(self) -> int:
        """``pools.<stage>.max_in_flight_per_worker`` (one worker per pool here)."""
        return self.room

    def worker_args(self) -> tuple[str, ...]:
        """``worker`` flags: engine slots for every request, a small queue behind them."""
        return ("--max-concurrency", str(self.room), "--max-queued", "256")


def scale_toml(
    endpoints: list[tuple[str, str, str]], limits: ScaleLimits, *, drain_timeout_s: float = 5.0
) -> str:
    """A router configuration over ``endpoints`` ((role, id, address)) with ``limits`` raised."""
    lines = [
        'model = "sim-model"',
        'auth_token_env = "EPD_AUTH_TOKEN"',
        "",
        "[server]",
        'http_listen = "127.0.0.1:0"',
        f"drain_timeout_s = {drain_timeout_s}",
        "",
    ]
    for table, values in limits.router_toml_sections().items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {value}" for key, value in values.items()]
        lines.append("")
    pools: dict[str, list[str]] = {}
    for role, worker_id, address in endpoints:
        pools.setdefault(role, []).append(f'{{ id = "{worker_id}", address = "{address}" }}')
    for role, entries in pools.items():
        lines += [
            f"[pools.{role}]",
            f"max_in_flight_per_worker = {limits.per_worker}",
            f"workers = [{', '.join(entries)}]",
            "",
        ]
    return "\n".join(lines)


# -- processes


class LoggedProcess(Process):
    """:class:`harness.Process` whose stderr goes to a file (kept when a run fails)."""

    def __init__(
        self, argv: list[str], *, env: dict[str, str], pattern: re.Pattern[str], log: Path
    ) -> None:
        self.argv = argv
        self.log = log
        self._log_handle: IO[str] = log.open("w", encoding="utf-8")
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log_handle,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.announced = self._wait_for(pattern)

    def stop(self) -> None:
        super().stop()
        self._log_handle.close()


@dataclass
class System:
    """A running scenario: workers (+ router), the URL to load, and where logs go."""

    name: str
    url: str = ""
    router: LoggedProcess | None = None
    workers: list[LoggedProcess] = field(default_factory=list)


def start_system(
    name: str,
    roles: tuple[str, ...],
    sim: tuple[str, ...],
    limits: ScaleLimits,
    stack: ExitStack,
    workdir: Path,
    *,
    direct: bool = False,
    router_cores: str | None = None,
    worker_cores: str | None = None,
) -> System:
    """Start the workers of ``roles`` (and a router unless ``direct``); stopped with ``stack``."""
    env = _env(TOKEN)
    stem = name.replace("/", "-")
    store = tempfile.mkdtemp(prefix=f"{stem}-", dir=workdir)
    system = System(name)
    endpoints: list[tuple[str, str, str]] = []
    for index, role in enumerate(roles):
        worker_id = f"{role}-{index}"
        extra = (*limits.worker_args(), *sim)
        argv = worker_argv(role, worker_id, store, cores=worker_cores, openai=direct, extra=extra)
        worker = LoggedProcess(
            argv, env=env, pattern=ANNOUNCE, log=workdir / f"{stem}-{worker_id}.log"
        )
        stack.callback(worker.stop)
        system.workers.append(worker)
        endpoints.append((role, worker_id, worker.announced))
    if direct:
        system.url = endpoints[0][2]
        return system
    config = workdir / f"{stem}.toml"
    config.write_text(scale_toml(endpoints, limits), encoding="utf-8")
    argv = router_argv(config, cores=router_cores)
    router = LoggedProcess(
        argv, env=env, pattern=ROUTER_ANNOUNCE, log=workdir / f"{stem}-router.log"
    )
    stack.callback(router.stop)
    system.router = router
    system.url = router.announced
    return system


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` of ``/proc/<pid>/status``), in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def scrape_in_flight(url: str) -> int | None:
    """The router's ``epd_requests_in_flight`` gauge, or None when ``/metrics`` did not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = IN_FLIGHT.search(text)
    return None if match is None else int(float(match.group(1)))


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, hard
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# -- part 1: the concurrency sweep


def sweep_points(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(sim, concurrency) pairs to measure."""
    points = []
    for sim in args.sims.split(","):
        spec = args.concurrency if sim == "standard" else args.paced_concurrency
        points += [(sim, int(c)) for c in spec.split(",") if c]
    return points


def requests_for(sim: str, concurrency: int, args: argparse.Namespace) -> int:
    base = args.requests if sim == "standard" else args.paced_requests
    return max(base, concurrency * args.requests_per_client)


def measure(
    system: System,
    sim: str,
    concurrency: int,
    args: argparse.Namespace,
    out: Path,
) -> dict[str, object]:
    router_pid = None if system.router is None else system.router.pid
    cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    document = run_bench(
        system.url,
        concurrency=concurrency,
        requests=requests_for(sim, concurrency, args),
        max_tokens=args.max_tokens,
        cores=args.bench_cores,
        out=out,
    )
    cpu1 = cpu_seconds(router_pid) if router_pid else 0.0
    summary = document["summary"]
    assert isinstance(summary, dict)
    completed = summary["completed"]
    router_cpu = cpu1 - cpu0
    return {
        "scenario": system.name.split("/", 1)[1],
        "sim": sim,
        "concurrency": concurrency,
        "requests": summary["requests"],
        "completed": completed,
        "errors": summary["requests"] - completed,
        "duration_s": summary["duration_s"],
        "req_per_s": summary["request_rate"],
        "ttft_p50_ms": _ms(summary["ttft"]["p50"]),
        "ttft_p99_ms": _ms(summary["ttft"]["p99"]),
        "e2e_p50_ms": _ms(summary["e2e"]["p50"]),
        "router_cpu_ms_per_req": (
            router_cpu / completed * 1000 if router_pid and completed else None
        ),
        "router_cpu_util": router_cpu / summary["duration_s"] if router_pid else None,
        "bench_cpu_util": summary["client_cpu_util"],
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


SWEEP_KEYS = (
    "req_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "router_cpu_ms_per_req",
    "router_cpu_util",
    "bench_cpu_util",
)


def run_sweep(args: argparse.Namespace, stack: ExitStack, workdir: Path) -> list[dict[str, object]]:
    points = sweep_points(args)
    sims = sorted({sim for sim, _ in points})
    limits = ScaleLimits(max(c for _, c in points))
    systems: dict[str, list[System]] = {}
    for sim in sims:
        for scenario in args.scenarios.split(","):
            direct = scenario == "direct"
            roles = ("pd",) if direct else TOPOLOGIES[scenario.removeprefix("native-")]
            system = start_system(
                f"{sim}/{scenario}",
                roles,
                SIMS[sim],
                limits,
                stack,
                workdir,
                direct=direct,
                router_cores=args.router_cores,
                worker_cores=args.worker_cores,
            )
            run_bench(
                system.url,
                concurrency=32,
                requests=args.warmup,
                max_tokens=args.max_tokens,
                cores=args.bench_cores,
                out=workdir / "warmup.json",
            )
            print(f"{system.name}: up at {system.url}", flush=True)
            systems.setdefault(sim, []).append(system)
    rows: list[dict[str, object]] = []
    for round_index in range(args.rounds):
        for sim, concurrency in points:
            for system in systems[sim]:
                row = measure(system, sim, concurrency, args, workdir / "run.json")
                row["round"] = round_index
                rows.append(row)
                print(
                    f"round {round_index + 1} {system.name:<18} c={concurrency:<5} "
                    f"{_f(row['req_per_s'], 1):>7} req/s  TTFT p50 {_f(row['ttft_p50_ms'], 1)} ms"
                    f"  router {_f(row['router_cpu_ms_per_req'], 2)} ms/req"
                    f"  errors {row['errors']}",
                    flush=True,
                )
    return rows


def aggregate(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Medians over rounds per (sim, scenario, concurrency), with TTFT added over direct."""
    groups: dict[tuple[str, str, int], list[dict[str, object]]] = {}
    for row in rows:
        key = (str(row["sim"]), str(row["scenario"]), int(row["concurrency"]))  # type: ignore[call-overload]
        groups.setdefault(key, []).append(row)
    table: list[dict[str, object]] = []
    for (sim, scenario, concurrency), group in sorted(groups.items()):
        entry: dict[str, object] = {"sim": sim, "scenario": scenario, "concurrency": concurrency}
        for key in SWEEP_KEYS:
            values = [float(r[key]) for r in group if r[key] is not None]  # type: ignore[arg-type]
            entry[key] = median(values) if values else None
        entry["errors"] = sum(int(r["errors"]) for r in group)  # type: ignore[call-overload]
        entry["rounds"] = len(group)
        table.append(entry)
    direct = {
        (e["sim"], e["concurrency"]): e["ttft_p50_ms"] for e in table if e["scenario"] == "direct"
    }
    for entry in table:
        base = direct.get((entry["sim"], entry["concurrency"]))
        mine = entry["ttft_p50_ms"]
        entry["ttft_added_ms"] = (
            None
            if base is None or mine is None or entry["scenario"] == "direct"
            else float(mine) - float(base)  # type: ignore[arg-type]
        )
    return table


def cost_growth(table: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per sim and scenario: router CPU/request at each concurrency relative to concurrency 1."""
    growth: dict[str, dict[str, float]] = {}
    for entry in table:
        if entry["router_cpu_ms_per_req"] is None:
            continue
        base = next(
            (
                e["router_cpu_ms_per_req"]
                for e in table
                if e["sim"] == entry["sim"]
                and e["scenario"] == entry["scenario"]
                and e["concurrency"] == 1
            ),
            None,
        )
        if base:
            key = f"{entry['sim']}/{entry['scenario']}"
            ratio = float(entry["router_cpu_ms_per_req"]) / float(base)  # type: ignore[arg-type]
            growth.setdefault(key, {})[str(entry["concurrency"])] = ratio
    return growth


def sweep_markdown(table: list[dict[str, object]]) -> str:
    lines = [
        "| sim | scenario | conc | req/s | TTFT p50 ms | TTFT added ms | TTFT p99 ms "
        "| e2e p50 ms | router CPU ms/req | router CPU util | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in table:
        lines.append(
            f"| {e['sim']} | {e['scenario']} | {e['concurrency']} | {_f(e['req_per_s'], 0)} "
            f"| {_f(e['ttft_p50_ms'], 1)} | {_f(e['ttft_added_ms'], 1)} "
            f"| {_f(e['ttft_p99_ms'], 1)} | {_f(e['e2e_p50_ms'], 1)} "
            f"| {_f(e['router_cpu_ms_per_req'], 2)} | {_f(e['router_cpu_util'], 2)} "
            f"| {e['errors']} |"
        )
    return "\n".join(lines)


def _f(value: object, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    assert isinstance(value, (int, float))
    return f"{value:.{digits}f}"


# -- part 2: N open streams


def run_streams(args: argparse.Namespace, stack: ExitStack, workdir: Path) -> dict[str, object]:
    """Open ``args.streams`` slow streams through one router; see the module docstring."""
    import time  # a plain script: wall-clock sampling, no event loop

    streams = args.streams
    limits = ScaleLimits(streams)
    sim = (
        "--sim-output-token-s",
        str(args.stream_token_s),
        "--sim-first-token-s",
        "0.002",
    )
    system = start_system(
        f"streams/{args.stream_topology}",
        TOPOLOGIES[args.stream_topology],
        sim,
        limits,
        stack,
        workdir,
        router_cores=args.router_cores,
        worker_cores=args.worker_cores,
    )
    assert system.router is not None
    router_pid = system.router.pid
    run_bench(
        system.url,
        concurrency=32,
        requests=args.warmup,
        max_tokens=1,
        cores=args.bench_cores,
        out=workdir / "warmup.json",
    )
    time.sleep(1.0)  # noqa: TID251 (a plain script)
    idle_rss = rss_bytes(router_pid)
    idle_workers = {
        w.argv[w.argv.index("--worker-id") + 1]: rss_bytes(w.pid) for w in system.workers
    }
    print(
        f"streams: router up at {system.url}, idle RSS {idle_rss / 2**20:.1f} MiB; "
        f"opening {streams} streams from {args.stream_clients} bench processes",
        flush=True,
    )
    shares = [streams // args.stream_clients] * args.stream_clients
    shares[0] += streams - sum(shares)
    benches: list[tuple[subprocess.Popen[bytes], Path]] = []
    cpu0 = cpu_seconds(router_pid)
    started = time.perf_counter()
    for index, share in enumerate(shares):
        out = workdir / f"streams-{index}.json"
        argv = [
            *taskset_prefix(args.bench_cores),
            *_python(),
            "bench",
            "--url",
            system.url,
            *(
                ("--rate", f"{args.stream_rate / args.stream_clients:g}", "--max-in-flight")
                if args.stream_rate > 0
                else ("--concurrency",)
            ),
            str(share),
            "--requests",
            str(share),
            "--max-tokens",
            str(args.stream_max_tokens),
            "--timeout",
            str(args.stream_timeout_s),
            "--no-progress",
            "--json",
            str(out),
        ]
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=(workdir / f"streams-{index}.log").open("w"),
            start_new_session=True,
        )
        stack.callback(_kill_group, popen)
        benches.append((popen, out))
    samples: list[dict[str, float]] = []
    peak: dict[str, float] = {"in_flight": -1.0}
    while any(p.poll() is None for p, _ in benches):
        time.sleep(args.sample_s)  # noqa: TID251
        in_flight = scrape_in_flight(system.url)
        sample = {
            "t_s": time.perf_counter() - started,
            "in_flight": float(in_flight) if in_flight is not None else math.nan,
            "router_rss_bytes": float(rss_bytes(router_pid)),
            "router_cpu_s": cpu_seconds(router_pid) - cpu0,
        }
        samples.append(sample)
        if in_flight is not None and (
            in_flight > peak["in_flight"]
            or (
                in_flight == peak["in_flight"]
                and sample["router_rss_bytes"] > peak["router_rss_bytes"]
            )
        ):
            peak = dict(sample)
        if len(samples) % 5 == 1:
            print(
                f"  t={sample['t_s']:6.1f} s  in flight {in_flight}  "
                f"router RSS {sample['router_rss_bytes'] / 2**20:7.1f} MiB",
                flush=True,
            )
        if time.perf_counter() - started > args.stream_timeout_s + 60:
            print("streams: the bench processes did not finish; stopping them", flush=True)
            break
    for popen, _ in benches:
        _kill_group(popen)
    elapsed = time.perf_counter() - started
    router_cpu = cpu_seconds(router_pid) - cpu0
    time.sleep(1.0)  # noqa: TID251
    after_rss = rss_bytes(router_pid)
    requests = completed = 0
    errors: dict[str, int] = {}
    ttft_p50s: list[float] = []
    for _, out in benches:
        if not out.exists():
            errors["a bench process wrote no results"] = (
                errors.get("a bench process wrote no results", 0) + 1
            )
            continue
        summary = json.loads(out.read_text(encoding="utf-8"))["summary"]
        requests += summary["requests"]
        completed += summary["completed"]
        for message, count in summary["errors"].items():
            errors[message] = errors.get(message, 0) + count
        if summary["ttft"]["p50"] is not None:
            ttft_p50s.append(summary["ttft"]["p50"] * 1000)
    peak_in_flight = int(peak["in_flight"])
    grown = peak.get("router_rss_bytes", math.nan) - idle_rss
    passed = peak_in_flight >= streams and completed == streams and not errors
    result: dict[str, object] = {
        "streams": streams,
        "topology": args.stream_topology,
        "bench_processes": args.stream_clients,
        "stream_token_s": args.stream_token_s,
        "stream_max_tokens": args.stream_max_tokens,
        "stream_rate": args.stream_rate,
        "limits": {
            "router": limits.router_toml_sections(),
            "pools.<stage>.max_in_flight_per_worker": limits.per_worker,
            "worker": " ".join(limits.worker_args()),
            "rlimit_nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        },
        "passed": passed,
        "peak_in_flight": peak_in_flight,
        "requests": requests,
        "completed": completed,
        "errors": errors,
        "elapsed_s": elapsed,
        "ttft_p50_ms_per_bench": ttft_p50s,
        "router_cpu_s": router_cpu,
        "router_cpu_ms_per_req": router_cpu / completed * 1000 if completed else None,
        "router_rss_idle_bytes": idle_rss,
        "router_rss_peak_bytes": peak.get("router_rss_bytes"),
        "router_rss_after_bytes": after_rss,
        "peak_at_s": peak.get("t_s"),
        "bytes_per_in_flight": grown / peak_in_flight if peak_in_flight > 0 else None,
        "worker_rss_idle_bytes": idle_workers,
        "samples": samples,
        "logs": str(workdir) if not passed else None,
    }
    per = result["bytes_per_in_flight"]
    print(
        f"streams: {'PASSED' if passed else 'FAILED'}: peak in flight {peak_in_flight}/{streams}, "
        f"{completed}/{requests} completed, errors {errors or 0}; router RSS idle "
        f"{idle_rss / 2**20:.1f} MiB, at peak {peak.get('router_rss_bytes', math.nan) / 2**20:.1f}"
        f" MiB ({_f(None if per is None else float(per) / 1024, 1)} KiB per in-flight request); "
        f"router CPU {router_cpu:.1f} s",
        flush=True,
    )
    return result


def _kill_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGTERM a bench process's group, then SIGKILL it if it lingers."""
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


# -- plots, arguments, main


def plot(
    table: list[dict[str, object]], streams: dict[str, object] | None, stem: Path
) -> list[str]:
    """PNG plots next to the JSON; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", file=sys.stderr)
        return []
    written = []
    series = sorted({(str(e["sim"]), str(e["scenario"])) for e in table})
    for key, file, title, target in (
        ("router_cpu_ms_per_req", "router-cpu", "router CPU per request (ms)", 1.5),
        ("ttft_p50_ms", "ttft", "TTFT p50 (ms)", None),
    ):
        if not table:
            break
        fig, axis = plt.subplots(figsize=(7, 4.4))
        for sim, scenario in series:
            points = sorted(
                (int(e["concurrency"]), float(e[key]))  # type: ignore[call-overload, arg-type]
                for e in table
                if e["sim"] == sim and e["scenario"] == scenario and e[key] is not None
            )
            if points:
                style = "-" if sim == "paced" else "--"
                axis.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    style,
                    marker="o",
                    label=f"{scenario} ({sim})",
                )
        if target is not None:
            axis.axhline(target, color="grey", linestyle=":", linewidth=1, label="target 1.5 ms")
        axis.set_xscale("log")
        if key == "ttft_p50_ms":
            axis.set_yscale("log")
        axis.set_xlabel("concurrency")
        axis.set_title(title + "; paced = 10 ms/token, standard = unpaced")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{stem}-{file}.png", dpi=110)
        plt.close(fig)
        written.append(f"{stem.name}-{file}.png")
    if streams is not None and streams["samples"]:
        samples = streams["samples"]
        assert isinstance(samples, list)
        fig, left = plt.subplots(figsize=(7, 4.4))
        ts = [s["t_s"] for s in samples]
        left.plot(ts, [s["in_flight"] for s in samples], color="tab:blue", label="in flight")
        left.set_xlabel("seconds since the load started")
        left.set_ylabel("router in-flight requests (/metrics)", color="tab:blue")
        right = left.twinx()
        right.plot(
            ts, [s["router_rss_bytes"] / 2**20 for s in samples], color="tab:red", label="RSS"
        )
        right.set_ylabel("router RSS (MiB)", color="tab:red")
        left.set_title(f"{streams['streams']} open streams on one router")
        left.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{stem}-streams.png", dpi=110)
        plt.close(fig)
        written.append(f"{stem.name}-streams.png")
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="scale", help="results file stem")
    parser.add_argument("--parts", default="sweep,streams", help="sweep and/or streams")
    parser.add_argument(
        "--scenarios", default="direct,native-pd,native-epd", help="sweep: comma-separated"
    )
    parser.add_argument("--sims", default="standard,paced", help="sweep: standard and/or paced")
    parser.add_argument("--concurrency", default="1,10,100,1000", help="sweep, standard sim")
    parser.add_argument("--paced-concurrency", default="1,10,100,256,1000", help="sweep, paced sim")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200, help="standard sim, at least")
    parser.add_argument("--paced-requests", type=int, default=40, help="paced sim, at least")
    parser.add_argument(
        "--requests-per-client", type=int, default=2, help="raise the count to conc x this"
    )
    parser.add_argument("--warmup", type=int, default=100, help="requests per system first")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--stream-topology", choices=sorted(TOPOLOGIES), default="pd")
    parser.add_argument("--stream-clients", type=int, default=2, help="bench processes")
    parser.add_argument(
        "--stream-rate",
        type=float,
        default=250.0,
        help="arrivals per second over all bench processes (0: all at once, closed loop)",
    )
    parser.add_argument("--stream-token-s", type=float, default=4.0, help="simulator pacing")
    parser.add_argument("--stream-max-tokens", type=int, default=40)
    parser.add_argument("--stream-timeout-s", type=float, default=400.0)
    parser.add_argument("--sample-s", type=float, default=1.0, help="/metrics + RSS sampling")
    parser.add_argument("--router-cores", default=None, help="taskset -c list for the router")
    parser.add_argument("--bench-cores", default=None, help="taskset -c list for the bench")
    parser.add_argument("--worker-cores", default=None, help="taskset -c list for the workers")
    parser.add_argument("--out-dir", default=str(RESULTS), help="default benchmarks/results")
    parser.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    nofile = raise_nofile_limit()
    parts = set(args.parts.split(","))
    results = Path(args.out_dir)
    results.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    streams: dict[str, object] | None = None
    workdir = Path(tempfile.mkdtemp(prefix="epd-scale-"))
    with ExitStack() as stack:
        if "sweep" in parts:
            with ExitStack() as sweep_stack:
                rows = run_sweep(args, sweep_stack, workdir)
        if "streams" in parts:
            streams = run_streams(args, stack, workdir)
    table = aggregate(rows)
    stem = results / args.name
    document: dict[str, object] = {
        "name": args.name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
        "simulators": {k: " ".join(v) for k, v in SIMS.items()},
        "rlimit_nofile": list(nofile),
        "machine": machine(),
        "sweep": table,
        "cost_growth": cost_growth(table),
        "sweep_rows": rows,
        "streams": streams,
    }
    if not args.no_plots:
        document["plots"] = plot(table, streams, stem)
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    if table:
        print(sweep_markdown(table))
    failed = streams is not None and not streams["passed"]
    if failed:
        print(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {stem.with_suffix('.json').name} in {results.name}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
