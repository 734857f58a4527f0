"""Soak test: the router under steady load while its workers are killed, paused and drained.

    python benchmarks/soak.py --duration-s 600 --json-out soak.json

Set-up: ``python -m epd_actors serve --config soak.toml`` (a router process)
in front of six simulated native workers, two per pool (E+P+D), each its own
``python -m epd_actors worker`` process on a Unix socket, all sharing one
``--sim-store-dir``.  This script is the client, the chaos monkey and the
judge:

- load: ``--concurrency`` clients, each sending one streamed chat request after
  another (text, or text with one of a few images), ``temperature: 0``;
- chaos: every ``--chaos-interval-s`` (jittered, seeded) one of ``kill -9`` of a
  worker, ``SIGSTOP`` for a while then ``SIGCONT``, a restart of a killed
  worker, or a drain through ``POST /admin/workers/{id}/drain`` followed, a
  few seconds later, by ``DELETE`` and a fresh ``POST /admin/workers``; at most
  one worker per pool is disturbed at a time, so every pool keeps a survivor;
- every request is checked by :class:`soak_checks.StreamCheck` against the
  simulator's output for the same body, computed in this process by an
  in-process router over one simulated PD worker (the same parser, the same
  token function); a client that waits past ``CLIENT_TIMEOUT_S`` is a hang;
- at the end every fault is healed and the run checks that nothing is left:
  no request or pool slot in flight at the router (``/health``), no request
  running or queued on any worker (a ``Pong``'s load report, over a fresh
  native connection), no KV handle in the shared store except those a killed
  process took with it; then a few requests must all succeed.

It prints a JSON summary: requests, successes, failures by error code, faults
by kind, invariant violations (the run fails unless 0), and the router's RSS
and open descriptors (first, last and largest sample).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import trio

from epd_actors.addresses import parse_address
from epd_actors.backends.native.backend import NativeBackend, NativeSettings
from epd_actors.core.router import open_router
from epd_actors.frontends.media_fetch import resolve_media
from epd_actors.openai.media import MediaLimits
from epd_actors.openai.schema import parse_chat_completion
from epd_actors.program.deployment import WorkerSpec, worker_command
from epd_actors.program.worker import AUTH_TOKEN_ENV
from epd_actors.request import DeltaEvent
from epd_actors.testing import build_sim_fleet, sim_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_checks import OK, Outcome, ProcessSample, Tally, judge_stream, refused_outcome

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from epd_actors.core.router import Router

MODEL = "sim-model"
LAYOUT = {"encode": ("e0", "e1"), "prefill": ("p0", "p1"), "decode": ("d0", "d1")}
# The router's deadlines: short, so a paused worker is noticed within a request's life.
REQUEST_TIMEOUT_S = 30.0
STAGE_TIMEOUT_S = 4.0
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0
RECONNECT_BACKOFF_MAX_S = 1.0
# A client waiting this long for its terminal event has found a hang.
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 10.0
STARTUP_TIMEOUT_S = 30.0
# Idle pooled connections are dropped by the client before the router's
# keep-alive timeout (5 s) closes them: with httpx's default, 5 s as well, a
# request sent on a connection the router closes at that moment is lost.
CLIENT_KEEPALIVE_S = 2.0
# Bounds of the end-of-run checks: the fleet comes back, goes idle, is probed.
HEAL_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 10.0
POLL_S = 0.2
ADMIN_DRAIN_WAIT_S = 10.0
AFTER_REQUESTS = 8
TEXT_PROMPTS = 64
IMAGES = 16
WORDS = ("router", "prefill", "decode", "encoder", "cache", "stream", "token", "worker")


@dataclass(frozen=True)
class SoakSettings:
    """One run's knobs (see ``--help``)."""

    duration_s: float = 600.0
    concurrency: int = 24
    seed: int = 1
    chaos_interval_s: float = 3.0
    pause_s: tuple[float, float] = (1.0, 6.0)
    drained_s: tuple[float, float] = (1.0, 5.0)
    image_share: float = 0.4
    max_tokens: tuple[int, int] = (8, 48)
    output_token_s: float = 0.01
    sample_interval_s: float = 1.0


# ---------------------------------------------------------------- processes


@dataclass
class Worker:
    """One worker process of the fleet and what the chaos did to it.

    ``state`` is ``up``, ``killed``, ``paused`` or ``drained``; ``lost`` holds
    the KV handles a killed incarnation left in the store (its memory went
    with it, as a dead GPU process's does).
    """

    stage: str
    worker_id: str
    address: str
    args: tuple[str, ...]
    state: str = "up"
    process: trio.Process | None = None
    lost: set[str] = field(default_factory=set)

    @property
    def spec(self) -> WorkerSpec:
        return WorkerSpec(self.stage, self.worker_id, self.args, self.address)


async def read_until(stream: trio.abc.ReceiveStream, marker: str) -> str:
    """Read a child's stdout until a line containing ``marker``; return that line.

    Raises:
        RuntimeError: the child closed its stdout first.
    """
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            text = line.decode(errors="replace")
            if marker in text:
                return text
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise RuntimeError(f"the process ended before printing {marker!r}")
        buffer += chunk


async def drain_output(stream: trio.abc.ReceiveStream) -> None:
    """Read a child's stdout to its end, so it never blocks on a full pipe."""
    while await stream.receive_some(4096):
        pass


class Fleet:
    """The worker processes: start, kill, pause, resume, restart.

    Each process runs in ``nursery``; its stdout is read to the end there.
    """

    def __init__(
        self, root: Path, token: str, settings: SoakSettings, nursery: trio.Nursery
    ) -> None:
        self.root = root
        self.env = {**os.environ, AUTH_TOKEN_ENV: token}
        self.nursery = nursery
        store = ("--sim-store-dir", str(root / "store"))
        pacing = ("--sim-output-token-s", str(settings.output_token_s))
        self.workers = {
            worker_id: Worker(stage, worker_id, f"unix:{root / worker_id}.sock", (*store, *pacing))
            for stage, ids in LAYOUT.items()
            for worker_id in ids
        }
        self.log = (root / "workers.log").open("ab")

    @property
    def kv_dir(self) -> Path:
        return self.root / "store" / "kv"

    async def start(self, worker: Worker) -> None:
        """Start ``worker`` and wait until it listens."""
        argv = worker_command(worker.spec, worker.address)
        process = await trio.lowlevel.open_process(
            argv,
            stdout=subprocess.PIPE,
            # Never written: the worker drains once this end closes (--exit-with-parent).
            stdin=subprocess.PIPE,
            stderr=self.log,
            env=self.env,
            start_new_session=True,
        )
        assert process.stdout is not None
        with trio.fail_after(STARTUP_TIMEOUT_S):
            await read_until(process.stdout, " listening on ")
        self.nursery.start_soon(drain_output, process.stdout)
        worker.process = process
        worker.state = "up"

    async def kill(self, worker: Worker) -> None:
        """``kill -9``; the handles it left in the store are counted as lost with it."""
        process = self._process(worker)
        process.send_signal(signal.SIGKILL)
        await process.wait()
        worker.state = "killed"
        worker.lost |= await kv_handles_of(self.kv_dir, worker.worker_id)

    def pause(self, worker: Worker) -> None:
        self._process(worker).send_signal(signal.SIGSTOP)
        worker.state = "paused"

    def resume(self, worker: Worker) -> None:
        self._process(worker).send_signal(signal.SIGCONT)
        worker.state = "up"

    async def stop_all(self) -> None:
        """SIGCONT and SIGTERM to every live worker; wait for them (killed if slow)."""
        live = [w.process for w in self.workers.values() if w.process is not None]
        for process in live:
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        with trio.move_on_after(10.0, shield=True):
            for process in live:
                await process.wait()
        for process in live:
            if process.returncode is None:
                process.kill()
        self.log.close()

    def _process(self, worker: Worker) -> trio.Process:
        assert worker.process is not None, worker
        return worker.process


async def kv_handles_of(kv_dir: Path, producer: str | None = None) -> set[str]:
    """The KV handles in the shared store (of one producer, if given)."""

    def scan() -> set[str]:
        found: set[str] = set()
        if not kv_dir.exists():
            return found
        for path in kv_dir.iterdir():
            if path.name.startswith("."):
                continue
            try:
                entry = json.loads(path.read_bytes())
            except (FileNotFoundError, ValueError):
                continue  # consumed or released while we looked
            if producer is None or entry.get("producer") == producer:
                found.add(path.name)
        return found

    return await trio.to_thread.run_sync(scan)


def router_toml(fleet: Fleet, admin_key: str) -> str:
    """The router's configuration over the fleet."""
    lines = [
        f'model = "{MODEL}"',
        f'auth_token_env = "{AUTH_TOKEN_ENV}"',
        "[server]",
        'http_listen = "127.0.0.1:0"',
        f'admin_key = "{admin_key}"',
        "drain_timeout_s = 5",
        "[deadlines]",
        f"request_timeout_s = {REQUEST_TIMEOUT_S}",
        f"encode_timeout_s = {STAGE_TIMEOUT_S}",
        f"prefill_timeout_s = {STAGE_TIMEOUT_S}",
        f"first_token_timeout_s = {STAGE_TIMEOUT_S}",
        f"inter_token_timeout_s = {STAGE_TIMEOUT_S}",
        "[native]",
        f"heartbeat_interval_s = {HEARTBEAT_INTERVAL_S}",
        f"heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}",
        f"reconnect_backoff_max_s = {RECONNECT_BACKOFF_MAX_S}",
    ]
    for stage, ids in LAYOUT.items():
        lines.append(f"[pools.{stage}]")
        entries = ", ".join(
            f'{{ id = "{w}", address = "{fleet.workers[w].address}" }}' for w in ids
        )
        lines.append(f"workers = [{entries}]")
    return "\n".join(lines) + "\n"


@dataclass
class RouterProcess:
    """The ``serve`` process and its URL."""

    process: trio.Process
    url: str


@asynccontextmanager
async def open_router_process(
    config: Path, env: dict[str, str], log: Path, nursery: trio.Nursery
) -> AsyncIterator[RouterProcess]:
    """Run ``python -m epd_actors serve --config``; SIGTERM (drain) on exit."""
    argv = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
    with log.open("ab") as stderr:
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=True
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(STARTUP_TIMEOUT_S):
            line = await read_until(process.stdout, "router listening on ")
        nursery.start_soon(drain_output, process.stdout)
        yield RouterProcess(process, line.rsplit(" ", 1)[1].strip())
    finally:
        with trio.move_on_after(15.0, shield=True):
            process.send_signal(signal.SIGTERM)
            await process.wait()
        if process.returncode is None:
            process.kill()


# ---------------------------------------------------------------- requests


def image_url(index: int) -> str:
    data = f"soak picture {index} ".encode() * 8
    return "data:image/png;base64," + base64.b64encode(data).decode()


def request_body(rng: random.Random, settings: SoakSettings) -> dict[str, object]:
    """One streamed chat request, text or text with an image (seeded)."""
    max_tokens = rng.randint(*settings.max_tokens)
    if rng.random() < settings.image_share:
        picture = rng.randrange(IMAGES)
        content: object = [
            {"type": "text", "text": f"describe picture {picture}"},
            {"type": "image_url", "image_url": {"url": image_url(picture)}},
        ]
    else:
        topic = rng.randrange(TEXT_PROMPTS)
        content = f"soak prompt {topic}: tell me about the {WORDS[topic % len(WORDS)]}"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def has_image(body: dict[str, object]) -> bool:
    messages = body["messages"]
    assert isinstance(messages, list)
    return not isinstance(messages[0]["content"], str)


class References:
    """The simulator's text for a request body, from an in-process PD router (cached)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.limits = MediaLimits()
        self._texts: dict[str, str] = {}
        self._serial = 0

    async def text(self, body: dict[str, object]) -> str:
        key = json.dumps(body, sort_keys=True)
        if key not in self._texts:
            self._texts[key] = await self._generate(body)
        return self._texts[key]

    async def _generate(self, body: dict[str, object]) -> str:
        self._serial += 1
        parsed = parse_chat_completion(body, request_id=f"ref-{self._serial}", limits=self.limits)
        parsed = await resolve_media(parsed, limits=self.limits, fetcher=None)
        pieces: list[str] = []
        async with self.router.generate(parsed.request) as events:
            async for event in events:
                if isinstance(event, DeltaEvent):
                    pieces.append(event.text)
        return "".join(pieces)


@asynccontextmanager
async def open_references() -> AsyncIterator[References]:
    """An in-process router over one unpaced simulated PD worker (encodes itself)."""
    fleet = build_sim_fleet({"pd": 1}, config=sim_config(ec_mode="recompute", output_token_s=0.0))
    async with open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router:
        yield References(router)


async def exchange(client: httpx.AsyncClient, body: dict[str, object], reference: str) -> Outcome:
    """Send one request and check its answer (see :func:`soak_checks.judge_stream`)."""
    image = has_image(body)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200 or "text/event-stream" not in response.headers.get(
            "content-type", ""
        ):
            raw = await response.aread()
            try:
                answer: object = json.loads(raw)
            except ValueError:
                answer = None
            kind, problems = refused_outcome(response.status_code, answer)
            return Outcome(kind, tuple(problems), image)
        lines = [line async for line in response.aiter_lines()]
        check = judge_stream(lines, reference)
        return Outcome(check.outcome, tuple(check.violations), image)


async def one_request(
    client: httpx.AsyncClient, body: dict[str, object], references: References
) -> Outcome:
    """One request under the client's own timeout; a transport failure is a cut stream."""
    reference = await references.text(body)
    with trio.move_on_after(CLIENT_TIMEOUT_S):
        try:
            return await exchange(client, body, reference)
        except httpx.TransportError as exc:
            problem = f"the connection to the router failed: {type(exc).__name__}: {exc}"
            return Outcome(f"transport:{type(exc).__name__}", (problem,), has_image(body))
    problem = f"no terminal event within the client timeout of {CLIENT_TIMEOUT_S:g}s (a hang)"
    return Outcome("client_timeout", (problem,), has_image(body))


async def client_loop(
    index: int,
    client: httpx.AsyncClient,
    references: References,
    settings: SoakSettings,
    tally: Tally,
    end: float,
) -> None:
    """Send requests one after another until ``end`` (the last one finishes)."""
    rng = random.Random(f"{settings.seed}:client:{index}")
    sent = 0
    previous = "none"
    while trio.current_time() < end:
        body = request_body(rng, settings)
        outcome = await one_request(client, body, references)
        sent += 1
        tally.record(outcome, f"client {index} request {sent} (after {previous})")
        previous = outcome.kind


# ---------------------------------------------------------------- chaos


class Admin:
    """The router's admin API (``/admin/workers``)."""

    def __init__(self, client: httpx.AsyncClient, key: str, tally: Tally) -> None:
        self.client = client
        self.headers = {"authorization": f"Bearer {key}"}
        self.tally = tally

    async def call(self, method: str, path: str, body: object = None) -> object:
        response = await self.client.request(
            method, "/admin/workers" + path, json=body, headers=self.headers
        )
        if response.status_code >= 300:
            self.tally.violation(f"admin {method} {path}: {response.status_code} {response.text}")
        return response.json()

    async def members(self) -> list[dict[str, object]]:
        """Every pool member as ``GET /admin/workers`` lists it."""
        listing = await self.call("GET", "")
        assert isinstance(listing, dict)
        return [member for members in listing["pools"].values() for member in members]

    async def in_flight(self, worker_id: str) -> int:
        members = await self.members()
        return sum(int(str(m["in_flight"])) for m in members if m["worker_id"] == worker_id)

    async def usable(self) -> set[str]:
        """The workers the router would route to now."""
        return {str(m["worker_id"]) for m in await self.members() if m["usable"]}


class Chaos:
    """Injects one fault every few seconds (seeded); heals paused and drained workers.

    The kind is one of the kinds injected least so far among those possible
    now (so a run covers them all), the worker and the timings come from the
    seeded generator.  A pool with a disturbed worker gets no second fault.
    """

    KINDS = ("kill_9", "sigstop", "drain_readd", "restart")

    def __init__(self, fleet: Fleet, admin: Admin, tally: Tally, settings: SoakSettings) -> None:
        self.fleet = fleet
        self.admin = admin
        self.tally = tally
        self.settings = settings
        self.rng = random.Random(f"{settings.seed}:chaos")

    async def run(self, end: float) -> None:
        """Inject faults until ``end``, then wait for the pauses and drains to end."""
        async with trio.open_nursery() as healing:
            while True:
                await trio.sleep(self.settings.chaos_interval_s * self.rng.uniform(0.5, 1.5))
                if trio.current_time() >= end:
                    break
                await self.inject(healing)

    async def choices(self) -> dict[str, list[Worker]]:
        """Worker candidates of each fault kind possible now.

        A pool is calm when each of its workers is up here and usable at the
        router (connected, ready, breaker closed): a worker resumed or
        restarted a moment ago may not be yet, and faulting its partner then
        would leave the pool empty, which is not what this run measures.
        """
        workers = self.fleet.workers.values()
        usable = await self.admin.usable()
        troubled = {w.stage for w in workers if w.state != "up" or w.worker_id not in usable}
        undisturbed = [w for w in workers if w.stage not in troubled]
        options = {
            "kill_9": undisturbed,
            "sigstop": undisturbed,
            "drain_readd": undisturbed,
            "restart": [w for w in workers if w.state == "killed"],
        }
        return {kind: targets for kind, targets in options.items() if targets}

    async def inject(self, healing: trio.Nursery) -> None:
        options = await self.choices()
        if not options:
            return
        fewest = min(self.tally.faults[kind] for kind in options)
        kinds = [
            kind for kind in self.KINDS if kind in options and self.tally.faults[kind] == fewest
        ]
        kind = self.rng.choice(kinds)
        worker = self.rng.choice(options[kind])
        self.tally.fault(kind)
        if kind == "kill_9":
            await self.fleet.kill(worker)
        elif kind == "restart":
            await self.fleet.start(worker)
        elif kind == "sigstop":
            self.fleet.pause(worker)
            healing.start_soon(self.resume_later, worker, self.rng.uniform(*self.settings.pause_s))
        else:
            await self.admin.call("POST", f"/{worker.worker_id}/drain")
            worker.state = "drained"
            healing.start_soon(self.readd_later, worker, self.rng.uniform(*self.settings.drained_s))

    async def resume_later(self, worker: Worker, after_s: float) -> None:
        await trio.sleep(after_s)
        self.fleet.resume(worker)

    async def readd_later(self, worker: Worker, after_s: float) -> None:
        """After ``after_s``, let the drained worker's jobs finish (bounded), then remove and
        add it again (a fresh connection, a fresh breaker)."""
        await trio.sleep(after_s)
        with trio.move_on_after(ADMIN_DRAIN_WAIT_S):
            while await self.admin.in_flight(worker.worker_id):  # noqa: ASYNC110
                await trio.sleep(POLL_S)
        await self.admin.call("DELETE", f"/{worker.worker_id}")
        body = {"stage": worker.stage, "id": worker.worker_id, "address": worker.address}
        await self.admin.call("POST", "", body)
        worker.state = "up"


# ---------------------------------------------------------------- measuring


async def sample_process(pid: int, started: float) -> ProcessSample:
    """RSS (``VmRSS``, KiB) and open descriptors of ``pid``, from ``/proc``."""
    status = await trio.Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fds = len(await trio.to_thread.run_sync(os.listdir, f"/proc/{pid}/fd"))
    return ProcessSample(round(trio.current_time() - started, 1), rss, fds)


async def sample_loop(pid: int, tally: Tally, interval_s: float, done: trio.Event) -> None:
    started = trio.current_time()
    while not done.is_set():
        tally.samples.append(await sample_process(pid, started))
        with trio.move_on_after(interval_s):
            await done.wait()


async def worker_load(address: str, token: str) -> int:
    """Running plus queued requests on a worker, from the ``Pong`` of a fresh connection."""
    backend = NativeBackend(
        "soak-probe", parse_address(address), auth_token=token, settings=NativeSettings()
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.run)
        await backend.wait_ready()
        load = backend.status().worker_load
        nursery.cancel_scope.cancel(reason="probe done")
    return load


async def wait_healed(client: httpx.AsyncClient, tally: Tally) -> None:
    """Every worker usable and nothing in flight at the router, within ``HEAL_TIMEOUT_S``."""
    body: object = None
    with trio.move_on_after(HEAL_TIMEOUT_S):
        while True:
            body = (await client.get("/health")).json()
            if healed(body):
                return
            await trio.sleep(POLL_S)
    tally.violation(f"the router did not come back whole and idle: {json.dumps(body)}")


def healed(body: object) -> bool:
    if not isinstance(body, dict) or body.get("requests_in_flight") != 0:
        return False
    members = [m for pool in body["pools"].values() for m in pool["workers"]]
    return len(members) == sum(map(len, LAYOUT.values())) and all(
        m["usable"] and m["in_flight"] == 0 for m in members
    )


async def check_workers_idle(fleet: Fleet, token: str, tally: Tally) -> dict[str, int]:
    """No request running or queued on any worker (each given ``PROBE_TIMEOUT_S`` to go idle)."""
    loads: dict[str, int] = {}
    for worker in fleet.workers.values():
        load = -1  # not probed: no ready connection within the bound
        with trio.move_on_after(PROBE_TIMEOUT_S):
            while (load := await worker_load(worker.address, token)) > 0:  # noqa: ASYNC110
                await trio.sleep(POLL_S)
        loads[worker.worker_id] = load
        if load < 0:
            tally.violation(f"worker {worker.worker_id} answered no heartbeat at the end")
        elif load:
            tally.violation(f"worker {worker.worker_id} still runs or queues {load} requests")
    return loads


async def check_kv_store(fleet: Fleet, tally: Tally) -> dict[str, int]:
    """No KV handle left in the store but those killed processes took with them."""
    lost = set().union(*(w.lost for w in fleet.workers.values()))
    left = await kv_handles_of(fleet.kv_dir)
    leaked = sorted(left - lost)
    if leaked:
        tally.violation(f"{len(leaked)} KV handles left behind by live workers: {leaked[:5]}")
    return {"leaked": len(leaked), "lost_with_killed_workers": len(left & lost)}


async def check_served_after(
    client: httpx.AsyncClient, references: References, settings: SoakSettings, tally: Tally
) -> int:
    """A few requests once healed: every one must succeed."""
    rng = random.Random(f"{settings.seed}:after")
    succeeded = 0
    for index in range(AFTER_REQUESTS):
        outcome = await one_request(client, request_body(rng, settings), references)
        succeeded += outcome.kind == OK
        if outcome.kind != OK:
            tally.violation(f"request {index} after healing: {outcome.kind} {outcome.violations}")
    return succeeded


# ---------------------------------------------------------------- the run


async def heal(fleet: Fleet) -> None:
    """Restart every killed worker (paused and drained ones were healed by the chaos)."""
    for worker in fleet.workers.values():
        if worker.state == "killed":
            await fleet.start(worker)


async def run_soak(settings: SoakSettings, root: Path) -> dict[str, object]:
    """One soak run in ``root`` (logs, store, config); returns its summary."""
    tally = Tally()
    token = secrets.token_urlsafe(16)
    admin_key = secrets.token_urlsafe(16)
    async with trio.open_nursery() as nursery:
        fleet = Fleet(root, token, settings, nursery)
        try:
            for worker in fleet.workers.values():
                await fleet.start(worker)
            config = root / "soak.toml"
            config.write_text(router_toml(fleet, admin_key))
            async with (
                open_router_process(config, fleet.env, root / "router.log", nursery) as router,
                httpx.AsyncClient(
                    base_url=router.url,
                    timeout=None,
                    limits=httpx.Limits(
                        max_connections=settings.concurrency + 8,
                        keepalive_expiry=CLIENT_KEEPALIVE_S,
                    ),
                ) as client,
                open_references() as references,
            ):
                await wait_healed(client, tally)
                end_checks = await load_and_chaos(
                    settings, fleet, router, client, references, tally, admin_key, token
                )
        finally:
            await fleet.stop_all()
        nursery.cancel_scope.cancel(reason="soak finished")
    return {"settings": settings_summary(settings), **tally.summary(), **end_checks}


async def load_and_chaos(
    settings: SoakSettings,
    fleet: Fleet,
    router: RouterProcess,
    client: httpx.AsyncClient,
    references: References,
    tally: Tally,
    admin_key: str,
    token: str,
) -> dict[str, object]:
    """The timed part, then healing and the end-of-run checks."""
    done = trio.Event()
    end = trio.current_time() + settings.duration_s
    chaos = Chaos(fleet, Admin(client, admin_key, tally), tally, settings)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_loop, router.process.pid, tally, settings.sample_interval_s, done)
        async with trio.open_nursery() as load:
            load.start_soon(chaos.run, end)
            for index in range(settings.concurrency):
                load.start_soon(client_loop, index, client, references, settings, tally, end)
        await heal(fleet)
        await wait_healed(client, tally)
        worker_loads = await check_workers_idle(fleet, token, tally)
        kv = await check_kv_store(fleet, tally)
        after = await check_served_after(client, references, settings, tally)
        done.set()
    return {"worker_loads": worker_loads, "kv_handles": kv, "after_healing_ok": after}


def settings_summary(settings: SoakSettings) -> dict[str, object]:
    return {
        "duration_s": settings.duration_s,
        "concurrency": settings.concurrency,
        "seed": settings.seed,
        "chaos_interval_s": settings.chaos_interval_s,
        "pause_s": list(settings.pause_s),
        "drained_s": list(settings.drained_s),
        "image_share": settings.image_share,
        "max_tokens": list(settings.max_tokens),
        "output_token_s": settings.output_token_s,
        "workers": {stage: list(ids) for stage, ids in LAYOUT.items()},
        "deadlines": {
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "stage_timeouts_s": STAGE_TIMEOUT_S,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "client_timeout_s": CLIENT_TIMEOUT_S,
        },
    }


def parse_args(argv: list[str] | None = None) -> tuple[SoakSettings, argparse.Namespace]:
    defaults = SoakSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--chaos-interval-s", type=float, default=defaults.chaos_interval_s)
    parser.add_argument("--output-token-s", type=float, default=defaults.output_token_s)
    parser.add_argument("--json-out", default=None, help="also write the summary here")
    parser.add_argument("--keep-dir", default=None, help="run in this directory and keep it")
    args = parser.parse_args(argv)
    settings = SoakSettings(
        duration_s=args.duration_s,
        concurrency=args.concurrency,
        seed=args.seed,
        chaos_interval_s=args.chaos_interval_s,
        output_token_s=args.output_token_s,
    )
    return settings, args


def main(argv: list[str] | None = None) -> int:
    """Run, print the summary; exit 1 when an invariant was violated."""
    settings, args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as scratch:
        root = Path(args.keep_dir or scratch)
        root.mkdir(parents=True, exist_ok=True)
        summary = trio.run(run_soak, settings, root)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
