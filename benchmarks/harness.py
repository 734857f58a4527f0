"""Shared helpers of the benchmark scripts: start processes on loopback, measure, stop.

Everything here is synchronous and plain ``subprocess``: a scenario is a set
of ``python -m epd_actors worker`` processes, optionally a router (``python -m
epd_actors serve --config``) or a peer router in front of them, and a URL to
load.  The load itself is one ``python -m epd_actors bench`` process per
measurement, so its CPU never mixes with the router's.

CPU time of a process comes from ``/proc/<pid>/stat`` (user + system clock
ticks), read before and after a measurement.  The per-stage breakdown comes
from the router's Prometheus ``/metrics`` (the ``_sum`` and ``_count`` of
``epd_stage_duration_seconds`` and ``epd_queue_wait_seconds``), also read
before and after.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from contextlib import ExitStack

STARTUP_TIMEOUT_S = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ANNOUNCE = re.compile(r"(?:listening on|serving the OpenAI HTTP API on) (\S+)")
ROUTER_ANNOUNCE = re.compile(r"router listening on (\S+)")
# Fast, unpaced simulator: the router's cost dominates (the standard case).
FAST_SIM = ("--sim-output-token-s", "0", "--sim-tokens-per-delta", "16")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of stat(5)); utime and stime are fields 14 and 15.
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def tree_cpu_times(pid: int) -> tuple[float, float]:
    """:func:`cpu_times` of ``pid`` and of every live descendant of it, summed (``serve
    --processes N``: the parent and its router processes)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                    parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue  # exited meanwhile
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    user = system = 0.0
    for member in tree:
        with contextlib.suppress(OSError):
            member_user, member_system = cpu_times(member)
            user += member_user
            system += member_system
    return user, system


def taskset_prefix(cores: str | None) -> list[str]:
    return [] if not cores else ["taskset", "-c", cores]


class Process:
    """A child process whose stdout we read until it announces a URL or address."""

    def __init__(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        pattern: re.Pattern[str],
        cwd: str | None = None,
    ) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            text=True,
            start_new_session=True,
        )
        self.announced = self._wait_for(pattern)

    def _wait_for(self, pattern: re.Pattern[str]) -> str:
        stdout: IO[str] | None = self.popen.stdout
        assert stdout is not None
        for line in stdout:
            match = pattern.search(line)
            if match:
                return match.group(1)
        self.popen.wait(timeout=5)
        raise RuntimeError(f"{' '.join(self.argv[2:5])} exited ({self.popen.returncode})")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        """SIGTERM the process's whole group (a wrapper's children too), then SIGKILL."""
        self._signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def _signal_group(self, signum: int) -> None:
        # Started with start_new_session: the group outlives a leader that
        # exited (py-spy's --duration ends py-spy, not the router it started).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signum)


@dataclass
class Scenario:
    """One system under test: how to start it, and where to send load once it is up."""

    name: str
    description: str
    # (role, extra worker args) for each worker process.
    workers: list[tuple[str, tuple[str, ...]]]
    # "native", "openai_http", "direct" (load the first worker), "vllm-router"
    # (round robin over the workers), "vllm-router-pd" (its P/D mode over P and D)
    # or "epd-proxy" (vLLM's example EPD proxy over the E, P and D workers).
    kind: str = "native"
    url: str = ""
    router: Process | None = None
    processes: list[Process] = field(default_factory=list)
    # (role, worker id, URL or address) of each started worker.
    endpoints: list[tuple[str, str, str]] = field(default_factory=list)
    # Another checkout of the project to run the workers and router from (an
    # A/B baseline): put first on PYTHONPATH and used as the working directory.
    source: str | None = None
    # More lines of our router's ``[server]`` table for this scenario (e.g. ``processes = 2``).
    server_lines: tuple[str, ...] = ()

    @property
    def router_pid(self) -> int | None:
        return None if self.router is None else self.router.pid

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes if p is not self.router]


def _python() -> list[str]:
    return [sys.executable, "-m", "epd_actors"]


def worker_argv(
    role: str,
    worker_id: str,
    store: str,
    *,
    cores: str | None,
    openai: bool,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of one simulated worker sharing ``store`` with its peers."""
    argv = [*taskset_prefix(cores), *_python(), "worker", "--role", role]
    argv += ["--worker-id", worker_id, "--sim-store-dir", store]
    if openai:
        argv.append("--serve-openai")
    return [*argv, *extra]


def router_argv(
    config: Path,
    *,
    cores: str | None,
    wrapper: Sequence[str] = (),
    python: Sequence[str] = (),
) -> list[str]:
    """The command line of a router serving ``config`` on a free port (announced on stdout).

    ``python`` replaces ``python -m epd_actors`` (e.g. to run it under ``-m cProfile``).
    """
    argv = [*taskset_prefix(cores), *wrapper, *(python or _python()), "serve"]
    argv += ["--config", str(config)]
    return [*argv, "--http-listen", "127.0.0.1:0"]


def _env(token: str) -> dict[str, str]:
    env = dict(os.environ)
    env["EPD_AUTH_TOKEN"] = token
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def start_scenario(
    scenario: Scenario,
    stack: ExitStack,
    workdir: Path,
    *,
    router_cores: str | None = None,
    worker_cores: str | None = None,
    vllm_router: str | None = None,
    epd_proxy: str | None = None,
    epd_proxy_python: str | None = None,
    router_wrapper: tuple[str, ...] = (),
    router_python: tuple[str, ...] = (),
    server_lines: tuple[str, ...] = (),
) -> None:
    """Start the scenario's processes (stopped when ``stack`` closes); sets ``scenario.url``.

    ``vllm_router``, ``epd_proxy`` and ``epd_proxy_python`` are the peer
    programs (see :class:`PeerPrograms`), needed only by scenarios of their kind.
    ``router_wrapper`` goes before the router's own argv, a peer's too (e.g. a
    profiler's ``record --``, or ``strace``); ``router_python`` replaces its
    ``python -m epd_actors``;
    ``server_lines`` are added to the router configuration's ``[server]`` table
    (e.g. ``stream_coalescing = "off"``).
    """
    token = secrets.token_urlsafe(16)
    env = _env(token)
    if scenario.source is not None:
        # python -m puts the working directory first on sys.path: it must be the checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (scenario.source, env.get("PYTHONPATH"))))
    store = tempfile.mkdtemp(prefix=f"{scenario.name}-", dir=workdir)
    openai = scenario.kind in HTTP_KINDS
    endpoints = scenario.endpoints
    for index, (role, extra) in enumerate(scenario.workers):
        worker_id = f"{role}-{index}"
        argv = worker_argv(role, worker_id, store, cores=worker_cores, openai=openai, extra=extra)
        process = Process(argv, env=env, pattern=ANNOUNCE, cwd=scenario.source)
        stack.callback(process.stop)
        scenario.processes.append(process)
        endpoints.append((role, worker_id, process.announced))
    if scenario.kind == "direct":
        scenario.url = endpoints[0][2]
        return
    if scenario.kind in PEER_COMMANDS:
        programs = PeerPrograms(vllm_router, epd_proxy, epd_proxy_python or sys.executable)
        port = free_port()
        argv = PEER_COMMANDS[scenario.kind](programs, port, endpoints)
        argv = [*taskset_prefix(router_cores), *router_wrapper, *argv]
        scenario.router = start_peer(stack, argv, port, env, name=scenario.name)
        scenario.url = scenario.router.announced
        return
    config = workdir / f"{scenario.name}.toml"
    config.write_text(
        router_toml(
            endpoints, backend=scenario.kind, server_lines=(*server_lines, *scenario.server_lines)
        ),
        encoding="utf-8",
    )
    argv = router_argv(config, cores=router_cores, wrapper=router_wrapper, python=router_python)
    router = Process(argv, env=env, pattern=ROUTER_ANNOUNCE, cwd=scenario.source)
    stack.callback(router.stop)
    scenario.router = router
    scenario.url = router.announced


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def vllm_router_argv(
    binary: str,
    port: int,
    metrics_port: int,
    endpoints: list[tuple[str, str, str]],
    *,
    pd: bool,
    policy: str = "round_robin",
) -> list[str]:
    """vllm-router's command line: round robin over every worker, or its P/D mode.

    In P/D mode (``--vllm-pd-disaggregation``) it sends each request to a
    prefill worker first (``stream: false``, ``max_tokens: 1``,
    ``kv_transfer_params.do_remote_decode: true``) and then the client's
    request, with the ``kv_transfer_params`` P answered, to a decode worker.
    ``--worker-startup-check-interval 1`` keeps it from waiting 30 s between
    startup probes; its Prometheus endpoint gets a free loopback port of its
    own (the default, 29000, would collide between two routers).  ``policy``
    is its ``--policy`` (in P/D mode, both pools').
    """
    argv = [binary, "--host", "127.0.0.1", "--port", str(port)]
    if pd:
        argv.append("--vllm-pd-disaggregation")
        for role, _, url in endpoints:
            argv += ["--prefill", url] if role == "prefill" else ["--decode", url]
    else:
        argv += ["--worker-urls", *(url for _, _, url in endpoints)]
    argv += ["--policy", policy, "--worker-startup-check-interval", "1"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return [*argv, "--log-level", "warning"]


def epd_proxy_argv(
    python: str, script: str, port: int, endpoints: list[tuple[str, str, str]]
) -> list[str]:
    """The command line of vLLM's example EPD proxy (``disagg_epd_proxy.py``) over ``endpoints``.

    Its three URL lists are all required on its command line.  With no
    encode worker the list is empty: the proxy only sends a request's media
    items to E (and text prompts have none), and its ``/health`` reports an
    empty cluster as ``"empty"``, not as unhealthy.  With no prefill worker it
    gets ``disable``, its own word for E -> PD.  It takes no option to quiet
    its logging (DEBUG to stderr, uvicorn's access log), so it runs as stock.
    """

    def urls(role: str) -> str:
        return ",".join(url for worker_role, _, url in endpoints if worker_role == role)

    argv = [python, script, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--encode-servers-urls", urls("encode")]
    argv += ["--prefill-servers-urls", urls("prefill") or "disable"]
    return [*argv, "--decode-servers-urls", urls("decode")]


@dataclass(frozen=True)
class PeerPrograms:
    """The peer routers' programs, as given on the benchmark's command line.

    ``vllm_router``: the ``vllm-router`` executable; ``epd_proxy``: the
    ``disagg_epd_proxy.py`` script of a vLLM checkout, run by
    ``epd_proxy_python`` (an interpreter with fastapi, uvicorn, uvloop and aiohttp).
    """

    vllm_router: str | None = None
    epd_proxy: str | None = None
    epd_proxy_python: str = sys.executable


def _vllm_router_command(
    programs: PeerPrograms, port: int, endpoints: list[tuple[str, str, str]], *, pd: bool
) -> list[str]:
    if programs.vllm_router is None:
        raise RuntimeError("the vllm-router scenarios need --vllm-router PATH")
    return vllm_router_argv(programs.vllm_router, port, free_port(), endpoints, pd=pd)


def _epd_proxy_command(
    programs: PeerPrograms, port: int, endpoints: list[tuple[str, str, str]]
) -> list[str]:
    if programs.epd_proxy is None:
        raise RuntimeError("the epd-proxy scenarios need --epd-proxy PATH")
    return epd_proxy_argv(programs.epd_proxy_python, programs.epd_proxy, port, endpoints)


def _trio_floor_command(
    programs: PeerPrograms, port: int, endpoints: list[tuple[str, str, str]], *, hub: bool
) -> list[str]:
    """``trio_floor.py`` (the I/O of a P/D relay alone, in Python on Trio) over P and D
    (``hub``: one task reads every D stream, ``--hub``)."""
    argv = [sys.executable, str(Path(__file__).with_name("trio_floor.py")), "--port", str(port)]
    for role, _, url in endpoints:
        argv += ["--prefill" if role == "prefill" else "--decode", url]
    return [*argv, "--host", "127.0.0.1", *(("--hub",) if hub else ())]


# Scenario kinds of a peer router (another project's program in front of HTTP workers):
# kind -> its command line, serving on loopback ``port`` in front of the endpoints.
PEER_COMMANDS: dict[str, Callable[[PeerPrograms, int, list[tuple[str, str, str]]], list[str]]] = {
    "vllm-router": functools.partial(_vllm_router_command, pd=False),
    "vllm-router-pd": functools.partial(_vllm_router_command, pd=True),
    "epd-proxy": _epd_proxy_command,
    "trio-floor": functools.partial(_trio_floor_command, hub=False),
    "trio-floor-hub": functools.partial(_trio_floor_command, hub=True),
}
# Scenario kinds that run this project's router (``serve --config``), over either backend.
ROUTER_KINDS = ("native", "openai_http")
# Scenario kinds whose workers serve vLLM's OpenAI HTTP API (``worker --serve-openai``).
HTTP_KINDS = ("openai_http", "direct", *PEER_COMMANDS)


def start_peer(
    stack: ExitStack, argv: list[str], port: int, env: dict[str, str], *, name: str
) -> Process:
    """Start a peer router serving on ``port``, once its ``GET /health`` answers.

    Stopped when ``stack`` closes; its URL is the returned process's ``announced``.
    """
    popen = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url + "/health", popen):
        popen.kill()
        raise RuntimeError(f"the {name} scenario's router did not become healthy")
    process = Process.__new__(Process)
    process.argv = argv
    process.popen = popen
    process.announced = url
    stack.callback(process.stop)
    return process


def wait_healthy(url: str, popen: subprocess.Popen[str], timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if popen.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)  # noqa: TID251 (a plain script, no event loop)
    return False


def router_toml(
    endpoints: list[tuple[str, str, str]], *, backend: str, server_lines: tuple[str, ...] = ()
) -> str:
    """A router configuration over ``endpoints`` ((role, id, address)), listening on loopback.

    ``server_lines``: more ``key = value`` lines of its ``[server]`` table.
    """
    lines = [
        'model = "sim-model"',
        'auth_token_env = "EPD_AUTH_TOKEN"',
        "",
        "[server]",
        'http_listen = "127.0.0.1:0"',
        *server_lines,
        "",
    ]
    pools: dict[str, list[str]] = {}
    for role, worker_id, address in endpoints:
        entry = f'{{ id = "{worker_id}", address = "{address}"'
        if backend != "native":
            entry += f', backend = "{backend}"'
        pools.setdefault(role, []).append(entry + " }")
    for role, entries in pools.items():
        lines += [f"[pools.{role}]", f"workers = [{', '.join(entries)}]", ""]
    return "\n".join(lines)


@dataclass
class HandoffCheck:
    """What the decode workers of a scenario received, from their request logs.

    ``requests``: decode requests logged; ``with_handle``: those whose
    ``kv_transfer_params`` named a prefill's KV handle (``sim_kv_handle`` and
    ``remote_engine_id``); ``ok``: those answered in full.  The simulated
    decoder refuses a request whose handle is missing or unknown, so ``ok ==
    requests == with_handle`` means every request really went through P.
    """

    requests: int = 0
    with_handle: int = 0
    ok: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "with_handle": self.with_handle, "ok": self.ok}


def check_handoffs(scenario: Scenario, *, after_seq: dict[str, int] | None = None) -> HandoffCheck:
    """Read the decode workers' ``GET /debug/requests`` (HTTP scenarios only).

    ``after_seq`` (worker id -> last sequence number seen) skips older
    entries and is updated, so a check covers one measurement.
    """
    check = HandoffCheck()
    if scenario.kind not in HTTP_KINDS:
        return check
    for role, worker_id, url in scenario.endpoints:
        if role != "decode":
            continue
        with urllib.request.urlopen(url + "/debug/requests", timeout=10) as response:
            entries = json.loads(response.read())["requests"]
        floor = after_seq.get(worker_id, 0) if after_seq is not None else 0
        for entry in entries:
            if entry["seq"] <= floor:
                continue
            kv = entry.get("kv_transfer_params") or {}
            check.requests += 1
            check.with_handle += bool(kv.get("sim_kv_handle") and kv.get("remote_engine_id"))
            check.ok += entry.get("outcome") == "ok"
        if after_seq is not None and entries:
            after_seq[worker_id] = max(floor, entries[-1]["seq"])
    return check


def scrape_stage_metrics(url: str) -> dict[str, tuple[float, float]]:
    """``{stage or "queue_wait": (sum_s, count)}`` from the router's ``/metrics``."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values: dict[str, list[float]] = {}
    pattern = re.compile(
        r'^epd_(stage_duration|queue_wait)_seconds_(sum|count)(?:\{stage="([^"]+)"\})? (\S+)$'
    )
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        family, part, stage, value = match.groups()
        key = stage if family == "stage_duration" else "queue_wait"
        slot = values.setdefault(key, [0.0, 0.0])
        slot[0 if part == "sum" else 1] = float(value)
    return {key: (pair[0], pair[1]) for key, pair in values.items()}


def stage_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean seconds per observation of each stage between two scrapes."""
    means = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count - count0 > 0:
            means[key] = (total - total0) / (count - count0)
    return means


def run_bench(
    url: str,
    *,
    concurrency: int,
    requests: int | None,
    max_tokens: int,
    cores: str | None,
    out: Path,
    warmup: int = 0,
    extra: tuple[str, ...] = (),
) -> dict[str, object]:
    """One ``python -m epd_actors bench`` run; returns its JSON document.

    ``requests`` None: pass ``--duration`` in ``extra`` instead.
    """
    argv = [
        *taskset_prefix(cores),
        *_python(),
        "bench",
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        *(("--requests", str(requests)) if requests is not None else ()),
        "--max-tokens",
        str(max_tokens),
        "--warmup",
        str(warmup),
        "--no-progress",
        "--json",
        str(out),
        *extra,
    ]
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL, timeout=900)
    document: dict[str, object] = json.loads(out.read_text(encoding="utf-8"))
    return document


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
