"""Real vLLM instances and routers for the lane: start, wait, inspect, stop.

Every process is started in its own session (``start_new_session``), so
stopping it -- or killing it with SIGKILL -- reaches the whole instance: vLLM's
API server, its engine-core process and their children.  Ports are free
loopback ports picked at start, outside the kernel's ephemeral range (see
:func:`free_port`).  Logs go to the lane's log directory and their
tail is quoted in every failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STOP_TIMEOUT_S = 30.0
POLL_S = 0.5


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _fixed_port_range() -> range:
    """Ports the kernel never picks by itself: below (or above) its ephemeral range."""
    try:
        low, high = (int(n) for n in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(10000, low) if low - 10000 >= 5000 else range(high + 1, 65536)


def free_port() -> int:
    """A loopback port that is free now and stays free until its process binds it.

    An engine binds its ports tens of seconds after start, while the other engines bind
    ports of their own (ZMQ, gloo, UCX) and open connections; a port the kernel picked
    (bind to port 0) could be handed to one of those in between.  So ports come from
    outside the kernel's ephemeral range, at random, never twice in one lane.
    """
    candidates = _fixed_port_range()
    rng = random.Random()
    for _ in range(1000):
        port = rng.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {candidates}")


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Process:
    """One started command (a whole process group) and its log."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            assert self.popen is not None
            raise RuntimeError(
                f"{self.name} exited with {self.popen.returncode}:\n{log_tail(self.log)}"
            )

    def mark_ready(self) -> None:
        if self.ready_after_s is None:
            self.ready_after_s = time.monotonic() - self.started_at

    def kill_group(self) -> None:
        """SIGKILL the whole instance (kill -9 of every process it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM the group, wait, then SIGKILL what is left."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"real-vllm: {self.name} ignored SIGTERM for {STOP_TIMEOUT_S} s; killing it")
        self.kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=STOP_TIMEOUT_S)


def wait_until_ready(processes: list[tuple[Process, str]], timeout_s: float) -> None:
    """Wait for each ``(process, probe)``; a probe is an ``http://`` URL answering 200 or
    ``log:TEXT`` appearing in the log.  Fails fast when one of them exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(processes)
    while pending:
        for process, probe in list(pending):
            process.check_alive()
            if _probe(process, probe):
                process.mark_ready()
                pending.remove((process, probe))
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(process.name for process, _ in pending)
            tails = "\n\n".join(f"== {p.name}\n{log_tail(p.log)}" for p, _ in pending)
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {names}\n{tails}")
        time.sleep(POLL_S)


def _probe(process: Process, probe: str) -> bool:
    if probe.startswith("log:"):
        return probe[4:] in process.log.read_text(encoding="utf-8", errors="replace")
    try:
        return httpx.get(probe, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------- metrics


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str) -> list[tuple[str, str, float]]:
    """``(name, labels, value)`` of every sample on a Prometheus text endpoint."""
    response = httpx.get(url, timeout=10.0)
    response.raise_for_status()
    samples = []
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples.append((match[1], match[2] or "", float(match[3])))
    return samples


def metric_sum(url: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples whose labels contain ``label``."""
    return sum(value for n, labels, value in scrape(url) if n == name and label in labels)


def ran_stages(timings_header: str) -> set[str]:
    """The stages a router's ``x-epd-timings`` header says ran (``encode``, ``prefill``, ...).

    The header is ``;``-separated ``name=value`` pairs: each stage's milliseconds, then
    ``queue``, ``ttft``, ``total`` and ``worker.STAGE=ID`` entries, which are not stages.
    """
    names = {pair.partition("=")[0].strip() for pair in timings_header.split(";") if "=" in pair}
    return {name for name in names if name and "." not in name} - {"queue", "ttft", "total"}


# ------------------------------------------------------------------ roles


@dataclass(frozen=True)
class Lane:
    """Where the lane's virtualenv, models and logs are."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def model(self, kind: str) -> Path:
        return self.root / "models" / kind

    @property
    def logs(self) -> Path:
        return self.root / "logs"


ENGINE_ARGS = ["--enforce-eager", "--dtype", "float32"]
ENGINE_ARGS += ["--kv-cache-memory-bytes", str(256 * 1024 * 1024)]
# The model runs inside the engine-core process instead of a third process per engine: one
# import of torch and vLLM fewer (about 7 s of start-up and 650 MiB each).  vLLM's CPU
# platform keeps this only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (see VLLM_ENV); the API
# server and the engine core are still two processes.
ENGINE_ARGS += ["--distributed-executor-backend", "uni"]
# vLLM 0.32 reads disable_any_whitespace only from the engine's configuration (a request's
# structured_outputs field is ignored): without it the tiny random model fills a JSON object
# with whitespace until max_tokens, and the matrix's structured_json case never finishes.
# xgrammar (named: the option needs it or guidance) also takes the matrix's regex and
# grammar cases.
ENGINE_ARGS += [
    "--structured-outputs-config",
    '{"backend":"xgrammar","disable_any_whitespace":true}',
]
# Each tiny model's full context, so a long generation keeps D busy for seconds.
# Qwen2-Audio's profile run takes a 30 s clip: 750 audio tokens.
MAX_MODEL_LEN = {"llama": 2048, "qwen2vl": 4096, "qwen2audio": 2048}


def engine_args(model: str) -> list[str]:
    return [*ENGINE_ARGS, "--max-model-len", str(MAX_MODEL_LEN[model])]


# What only ``vllm serve`` takes (its OpenAI server, not the engine), per model.  vLLM 0.32
# refuses a named or ``required`` tool_choice without a tool-call parser, although such a
# call is decoded by its JSON schema, and makes the parser only with auto tool choice on;
# ``pythonic`` needs no special tokens in the tokenizer.  The native worker refuses tool
# fields by name, so its engines take none.
SERVER_ARGS = {"llama": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]}


def serve_args(model: str) -> list[str]:
    """``vllm serve``'s arguments for ``model``: the engine's and the server's own."""
    return [*engine_args(model), *SERVER_ARGS.get(model, [])]


VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Six engines share two cores: one OpenMP thread each, so none spin-waits for a sibling
    # thread that is off the CPU.  The tiny models gain nothing from more.
    "OMP_NUM_THREADS": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@dataclass(frozen=True)
class Role:
    """One engine of a topology: its stage and its connectors."""

    name: str
    stage: str  # encode, prefill, decode, pd
    model: str  # llama, qwen2vl or qwen2audio
    ec: str | None = None  # ec_producer, ec_consumer
    kv: bool = False


def ec_config(role: str, store: Path) -> str:
    return json.dumps(
        {
            "ec_connector": "ECExampleConnector",
            "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(store)},
        }
    )


KV_CONFIG = json.dumps(
    {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
)


@dataclass
class Engine:
    """A started engine: a ``vllm serve`` instance or a native worker."""

    role: Role
    process: Process
    address: str  # what the router's config names
    metrics_url: str


def serve_command(lane: Lane, role: Role, port: int, store: Path) -> list[str]:
    argv = [str(lane.venv / "bin" / "vllm"), "serve", str(lane.model(role.model))]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += [*serve_args(role.model), "--enable-request-id-headers"]
    if role.stage == "encode":
        argv += ["--mm-encoder-only", "--no-enable-prefix-caching"]
    if role.ec:
        argv += ["--ec-transfer-config", ec_config(role.ec, store)]
    if role.kv:
        argv += ["--kv-transfer-config", KV_CONFIG]
    return argv


def native_command(lane: Lane, role: Role, port: int, metrics_port: int, store: Path) -> list[str]:
    argv = [str(lane.python), "-m", "epd_actors", "worker", "--engine", "vllm"]
    argv += ["--role", role.stage, "--worker-id", role.name, "--model", str(lane.model(role.model))]
    argv += ["--listen", f"tcp://127.0.0.1:{port}"]
    argv += ["--metrics-listen", f"tcp://127.0.0.1:{metrics_port}"]
    if role.ec:
        argv += ["--ec-connector", "ECExampleConnector"]
        argv += ["--ec-connector-extra", json.dumps({"shared_storage_path": str(store)})]
    if role.kv:
        argv += ["--kv-connector", "NixlConnector"]
    return [*argv, "--", *engine_args(role.model)]


def start_engine(
    lane: Lane, backend: str, role: Role, store: Path, auth_token: str
) -> tuple[Engine, str]:
    """Start one engine; returns it and its readiness probe (see :func:`wait_until_ready`)."""
    port = free_port()
    env = dict(VLLM_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
    log = lane.logs / f"{backend}-{role.name}.log"
    if backend == "openai_http":
        argv = serve_command(lane, role, port, store)
        base = f"http://127.0.0.1:{port}"
        process = Process(role.name, argv, log, env)
        engine = Engine(role, process, base, f"{base}/metrics")
        probe = f"{base}/health"
    else:
        metrics_port = free_port()
        argv = native_command(lane, role, port, metrics_port, store)
        env["EPD_AUTH_TOKEN"] = auth_token
        process = Process(role.name, argv, log, env)
        engine = Engine(
            role, process, f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
        )
        probe = "log:listening on"
    process.start()
    return engine, probe


def start_plain(lane: Lane, kind: str) -> tuple[Process, str]:
    """A plain ``vllm serve`` of the ``kind`` model: no connectors, no router; its URL.

    The reference of the golden answers and of the parameter matrix.
    """
    port = free_port()
    argv = [str(lane.venv / "bin" / "vllm"), "serve", str(lane.model(kind))]
    argv += ["--host", "127.0.0.1", "--port", str(port), *serve_args(kind)]
    process = Process(f"plain-{kind}", argv, lane.logs / f"plain-{kind}.log", dict(VLLM_ENV))
    process.start()
    return process, f"http://127.0.0.1:{port}"


@dataclass
class Router:
    """``python -m epd_actors serve`` over some of the engines."""

    name: str
    process: Process
    url: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


ENCODER_REUSE = ['reuse = "ttl"', "reuse_ttl_s = 600", 'reuse_scope = "shared"']
"""The reuse router's encode pool (docs/media.md): the shared-storage connector keeps every
entry in the shared directory, which nothing cleans while the lane runs."""


def router_toml(
    model: str,
    pools: dict[str, list[Engine]],
    backend: str,
    port: int,
    pool_options: dict[str, list[str]] | None = None,
) -> str:
    """The router's configuration file; ``pool_options`` adds ``key = value`` lines to pools."""
    lines = [f'model = "{model}"']
    if backend == "native":
        lines.append('auth_token_env = "EPD_AUTH_TOKEN"')
    lines += ["", "[server]", f'http_listen = "127.0.0.1:{port}"', "drain_timeout_s = 5", ""]
    lines += ["[deadlines]", "first_token_timeout_s = 120", "inter_token_timeout_s = 60", ""]
    # Six engines share two cores here: an engine's process can be off the CPU for a while,
    # which the default probes (2 s and two misses; no pong for 3 s) could take for a death.
    if backend == "openai_http":
        lines += ["[openai_http]", "health_timeout_s = 10", "failures_to_down = 3", ""]
    else:
        lines += ["[native]", "heartbeat_timeout_s = 60", ""]
    for stage, engines in pools.items():
        lines.append(f"[pools.{stage}]")
        lines.extend((pool_options or {}).get(stage, []))
        members = []
        for engine in engines:
            member = f'{{ id = "{engine.role.name}", address = "{engine.address}"'
            if backend == "openai_http":
                member += ', backend = "openai_http"'
            members.append(member + " }")
        lines.append(f"workers = [{', '.join(members)}]")
        lines.append("")
    return "\n".join(lines)


def start_router(
    lane: Lane,
    backend: str,
    name: str,
    model: str,
    pools: dict[str, list[Engine]],
    auth_token: str,
    pool_options: dict[str, list[str]] | None = None,
) -> tuple[Router, str]:
    port = free_port()
    config = lane.logs / f"{backend}-{name}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(router_toml(model, pools, backend, port, pool_options), encoding="utf-8")
    argv = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
    env = {"EPD_AUTH_TOKEN": auth_token}
    process = Process(f"router-{name}", argv, lane.logs / f"{backend}-{name}.log", env)
    process.start()
    url = f"http://127.0.0.1:{port}"
    return Router(name, process, url), f"{url}/health"
