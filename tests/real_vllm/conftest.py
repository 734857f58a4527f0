"""Fixtures of the real-vLLM lane: one fleet of real engines and routers per backend.

The lane runs only when selected (``-m real_vllm``) on a prepared lane directory
(``EPD_REAL_VLLM_LANE``, made by ``setup_lane.sh``); ``run_lane.sh`` does both.
The ``fleet`` fixture is session-scoped and parametrized by backend, so pytest
runs every test against the stock-``vllm serve`` fleet first, stops it, then
starts the native-worker fleet: only one fleet is in memory at a time.

Each fleet has, on the tiny Qwen2-VL: an encoder-only E (encoder-cache
producer), a P (encoder-cache consumer and KV producer over NIXL) and a D (KV
consumer); on the tiny Qwen2-Audio an encoder-only E and a PD (encoder-cache
consumer); and on the tiny Llama a text P and D.  For E+PD on Qwen2-VL the
stock fleet reuses its P (a request without ``kv_transfer_params`` is served
whole); the native fleet starts a ``pd`` worker.  Five routers run over them:
``epd`` (E+P+D), ``e_pd`` (E+PD), ``epd_reuse`` (E+P+D over the same engines,
its encode pool remembering encoder outputs), ``audio`` (E+PD on Qwen2-Audio)
and ``text`` (P+D on the Llama).

The ``plain`` fixture starts plain instances (no connectors, no router) of
the Llama, for the parameter matrix, and of Qwen2-VL and Qwen2-Audio, for the
cases that are not in ``golden.json``; each answer is asked once and kept for
the second backend.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from .cases import PLAIN_KINDS, Answer, Case, answer_of
from .fleet import (
    ENCODER_REUSE,
    Lane,
    Role,
    start_engine,
    start_plain,
    start_router,
    wait_until_ready,
)
from .matrix import CHAT, Model, PlainAnswers

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .fleet import Engine, Process, Router

LANE_ENV = "EPD_REAL_VLLM_LANE"
# A fleet's engines are ready after about 65 s on two cores.
START_TIMEOUT_S = 300.0
BACKENDS = ("openai_http", "native")

QWEN_ROLES = (
    Role("e", "encode", "qwen2vl", ec="ec_producer"),
    Role("p", "prefill", "qwen2vl", ec="ec_consumer", kv=True),
    Role("d", "decode", "qwen2vl", kv=True),
)
NATIVE_PD = Role("pd", "pd", "qwen2vl", ec="ec_consumer")
AUDIO_ROLES = (
    Role("ae", "encode", "qwen2audio", ec="ec_producer"),
    Role("apd", "pd", "qwen2audio", ec="ec_consumer"),
)
TEXT_ROLES = (
    Role("tp", "prefill", "llama", kv=True),
    Role("td", "decode", "llama", kv=True),
)


@dataclass
class Fleet:
    """The started engines and routers of one backend, and what was measured."""

    backend: str
    lane: Lane
    ec_store: Path
    engines: dict[str, Engine] = field(default_factory=dict)
    routers: dict[str, Router] = field(default_factory=dict)
    report: dict[str, object] = field(default_factory=dict)

    def model(self, kind: str) -> str:
        return str(self.lane.model(kind))

    def ec_entries(self) -> set[str]:
        return {path.name for path in self.ec_store.iterdir() if path.is_dir()}

    def processes(self) -> list[Process]:
        return [e.process for e in self.engines.values()] + [
            r.process for r in self.routers.values()
        ]


@pytest.fixture(scope="session")
def lane() -> Lane:
    root = os.environ.get(LANE_ENV)
    if not root or not (Path(root) / "venv" / "bin" / "vllm").exists():
        pytest.fail(f"{LANE_ENV} must name a lane prepared by tests/real_vllm/setup_lane.sh")
    return Lane(Path(root).resolve())


@dataclass
class Plain:
    """The plain ``vllm serve`` instances: the tiny Llama, which the parameter matrix
    compares with, and one per kind of :data:`PLAIN_KINDS`, for the non-golden cases."""

    lane: Lane
    process: Process
    url: str
    model: Model
    answers: PlainAnswers
    media: dict[str, tuple[Process, PlainAnswers]] = field(default_factory=dict)

    def wait_ready(self) -> None:
        wait_until_ready([(self.process, f"{self.url}/health")], START_TIMEOUT_S)

    def answer(self, case: Case) -> Answer:
        """The plain instance's answer to ``case`` (asked once per session)."""
        process, answers = self.media[case.model_kind]
        wait_until_ready([(process, f"{answers.url}/health")], START_TIMEOUT_S)
        reply = answers.get(CHAT, case.body(str(self.lane.model(case.model_kind))))
        assert reply.status == 200, f"the plain {case.model_kind} refused {case.name}: {reply.body}"
        return answer_of(reply.body)


@pytest.fixture(scope="session")
def plain(lane: Lane) -> Iterator[Plain]:
    """Started before the first fleet (which asks for it), so they get ready while the fleet
    starts; their answers are kept for the second backend."""
    process, url = start_plain(lane, "llama")
    config = json.loads((lane.model("llama") / "config.json").read_text(encoding="utf-8"))
    model = Model(str(lane.model("llama")), config["eos_token_id"], config["pad_token_id"])
    started = [process]
    try:
        with httpx.Client(timeout=120.0) as client:
            found = Plain(lane, process, url, model, PlainAnswers(client, url))
            for kind in PLAIN_KINDS:
                media_process, media_url = start_plain(lane, kind)
                started.append(media_process)
                found.media[kind] = (media_process, PlainAnswers(client, media_url))
            yield found
    finally:
        for each in started:
            each.stop()


@pytest.fixture(scope="session", params=BACKENDS)
def fleet(request: pytest.FixtureRequest, lane: Lane, plain: Plain) -> Iterator[Fleet]:
    backend: str = request.param
    store = lane.root / "ec-store" / backend
    store.mkdir(parents=True, exist_ok=True)
    for stale in store.iterdir():
        for path in sorted(stale.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        stale.rmdir()
    fleet = Fleet(backend, lane, store)
    token = secrets.token_urlsafe(16)
    roles = [*QWEN_ROLES, *AUDIO_ROLES, *TEXT_ROLES]
    if backend == "native":
        roles.append(NATIVE_PD)
    started = time.monotonic()
    try:
        probes = []
        for role in roles:
            engine, probe = start_engine(lane, backend, role, store, token)
            fleet.engines[role.name] = engine
            probes.append((engine.process, probe))
        wait_until_ready(probes, START_TIMEOUT_S)
        engines_ready_s = time.monotonic() - started
        e, p, d = (fleet.engines[name] for name in ("e", "p", "d"))
        pd = fleet.engines["pd"] if backend == "native" else p
        ae, apd = fleet.engines["ae"], fleet.engines["apd"]
        no_options: dict[str, list[str]] = {}
        layouts = {
            "epd": ("qwen2vl", {"encode": [e], "prefill": [p], "decode": [d]}, no_options),
            "e_pd": ("qwen2vl", {"encode": [e], "pd": [pd]}, no_options),
            "epd_reuse": (
                "qwen2vl",
                {"encode": [e], "prefill": [p], "decode": [d]},
                {"encode": ENCODER_REUSE},
            ),
            "audio": ("qwen2audio", {"encode": [ae], "pd": [apd]}, no_options),
            "text": (
                "llama",
                {"prefill": [fleet.engines["tp"]], "decode": [fleet.engines["td"]]},
                no_options,
            ),
        }
        probes = []
        for name, (kind, pools, options) in layouts.items():
            router, probe = start_router(
                lane, backend, name, fleet.model(kind), pools, token, options
            )
            fleet.routers[name] = router
            probes.append((router.process, probe))
        wait_until_ready(probes, 120)
        fleet.report["start_s"] = {
            "engines_all_ready": round(engines_ready_s, 1),
            **{
                name: round(engine.process.ready_after_s or 0.0, 1)
                for name, engine in fleet.engines.items()
            },
        }
        fleet.report["memory_mib"] = {
            name: round(group_rss_mib(engine.process.pid), 0)
            for name, engine in fleet.engines.items()
        }
        yield fleet
    finally:
        for process in reversed(fleet.processes()):
            process.stop()
        report = lane.logs / f"report-{backend}.json"
        report.write_text(json.dumps(fleet.report, indent=1) + "\n", encoding="utf-8")
        print(f"\nreal-vllm {backend}: {json.dumps(fleet.report)}")


def group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in the process group ``pgid``, in MiB."""
    total_kib = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kib / 1024
