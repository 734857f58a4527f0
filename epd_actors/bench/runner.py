"""Drive a run: closed loop (fixed concurrency) or open loop (Poisson arrivals).

Theory of operation: :func:`run_load` runs an optional warm-up (closed loop,
not recorded), then the measured phase.  Closed loop: ``concurrency`` tasks
each send a request, wait for its end, and send the next, until the request
budget or the duration is spent.  Open loop: one task draws exponential gaps
of mean ``1 / rate`` and starts each request in its own task, whatever is in
flight (beyond ``max_in_flight`` a request is recorded as dropped rather than
sent, so an overloaded server cannot make the generator grow without bound).
The generator's own CPU time (``os.times``) is taken around the measured
phase.  A progress line (:mod:`.progress`) is redrawn when asked for.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

import trio

from .client import LoadClient, Target, open_client, send_request
from .payload import BodyMaker, Workload
from .progress import ProgressLine
from .stats import RequestRecord, Summary, summarize

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How much load, and how it arrives.

    Attributes:
        concurrency: closed loop: requests in flight (ignored when ``rate``).
        rate: open loop: mean arrivals per second (Poisson); None = closed loop.
        requests: measured requests to send (None: until ``duration_s``).
        duration_s: stop sending after this long (None: until ``requests``).
        warmup: requests sent first and not recorded.
        timeout_s: per-request limit (a request past it fails).
        max_in_flight: open loop: beyond this, arrivals are dropped (errors).
        seed: of the arrival process and of the multimodal mix.
    """

    concurrency: int = 32
    rate: float | None = None
    requests: int | None = 1000
    duration_s: float | None = None
    warmup: int = 0
    timeout_s: float = 600.0
    max_in_flight: int = 4096
    seed: int = 0


@dataclass
class RunResult:
    """A finished run: its records (measured phase only) and summary."""

    records: list[RequestRecord]
    summary: Summary
    connections_opened: int
    extra: dict[str, object] = field(default_factory=dict)


class _Budget:
    """Hands out request slots until the count or the deadline is reached."""

    def __init__(self, requests: int | None, deadline: float | None) -> None:
        self.left = requests
        self.deadline = deadline

    def take(self) -> bool:
        if self.deadline is not None and trio.current_time() >= self.deadline:
            return False
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def cpu_seconds() -> float:
    """User + system CPU seconds this process has used so far."""
    times = os.times()
    return times.user + times.system


async def run_load(
    target: Target,
    workload: Workload,
    load: LoadSpec,
    *,
    progress: TextIO | None = None,
    progress_label: str = "",
    cpu_clock: Callable[[], float] = cpu_seconds,
) -> RunResult:
    """Run the warm-up and the measured phase; returns the measured records and summary.

    ``progress`` gets the progress line (None: no line), ``progress_label``
    prefixes it.
    """
    if load.requests is None and load.duration_s is None:
        raise ValueError("give a request count or a duration")
    bodies = BodyMaker(workload, seed=load.seed)
    pool = open_client(target, timeout_s=load.timeout_s)
    try:
        if load.warmup > 0:
            warm = LoadSpec(concurrency=max(1, load.concurrency), requests=load.warmup)
            await _closed_loop(pool, bodies, workload, warm, [], ProgressLine(None, None))
        records: list[RequestRecord] = []
        meter = ProgressLine(progress, load.requests, progress_label)
        cpu0 = cpu_clock()
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(meter.run, started)
            if load.rate is None:
                await _closed_loop(pool, bodies, workload, load, records, meter, started)
            else:
                await _open_loop(pool, bodies, workload, load, records, meter, started)
            nursery.cancel_scope.cancel(reason="run finished")
        meter.clear()
        cpu = cpu_clock() - cpu0
        ends = [r.start + r.e2e for r in records]
        duration = (max(ends) - min(r.start for r in records)) if records else 0.0
        summary = summarize(records, duration_s=duration, client_cpu_s=cpu)
        return RunResult(records, summary, pool.connections_opened)
    finally:
        await pool.aclose()


async def _one(
    pool: LoadClient,
    body: bytes,
    workload: Workload,
    load: LoadSpec,
    started: float,
    meter: ProgressLine,
) -> RequestRecord:
    record = RequestRecord(start=trio.current_time() - started)
    meter.in_flight += 1
    try:
        with trio.move_on_after(load.timeout_s) as scope:
            await send_request(pool, body, record, stream=workload.stream)
        if scope.cancelled_caught:
            record.error = f"timed out after {load.timeout_s:g} s"
            record.e2e = trio.current_time() - started - record.start
        return record
    finally:
        meter.in_flight -= 1
        meter.done += 1
        if record.error is not None:
            meter.failed += 1


async def _closed_loop(
    pool: LoadClient,
    bodies: BodyMaker,
    workload: Workload,
    load: LoadSpec,
    records: list[RequestRecord],
    meter: ProgressLine,
    started: float | None = None,
) -> None:
    begin = trio.current_time() if started is None else started
    deadline = None if load.duration_s is None else begin + load.duration_s
    budget = _Budget(load.requests, deadline)

    async def client() -> None:
        while budget.take():
            records.append(await _one(pool, bodies.next_body(), workload, load, begin, meter))

    async with trio.open_nursery() as nursery:
        for _ in range(max(1, load.concurrency)):
            nursery.start_soon(client)


async def _open_loop(
    pool: LoadClient,
    bodies: BodyMaker,
    workload: Workload,
    load: LoadSpec,
    records: list[RequestRecord],
    meter: ProgressLine,
    started: float,
) -> None:
    assert load.rate is not None
    assert load.rate > 0
    rng = random.Random(load.seed)
    deadline = None if load.duration_s is None else started + load.duration_s
    budget = _Budget(load.requests, deadline)
    next_at = started

    async def request(body: bytes) -> None:
        records.append(await _one(pool, body, workload, load, started, meter))

    async with trio.open_nursery() as nursery:
        while True:
            next_at += rng.expovariate(load.rate)
            await trio.sleep_until(next_at)
            if not budget.take():
                break
            if meter.in_flight >= load.max_in_flight:
                dropped = RequestRecord(start=trio.current_time() - started)
                dropped.error = f"dropped: {load.max_in_flight} requests already in flight"
                records.append(dropped)
                meter.done += 1
                meter.failed += 1
                continue
            nursery.start_soon(request, bodies.next_body())


def is_finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0
