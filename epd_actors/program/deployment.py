"""Local worker processes: start ``python -m epd_actors worker`` children and keep them up.

Theory of operation: :func:`open_local_workers` starts one child process per
:class:`WorkerSpec`, reads each child's stdout until it announces its bound
address, and yields a :class:`LocalWorkers` whose ``addresses`` are ready to be
dialled.  A supervising task per child restarts it (on the same address, after
a backoff that doubles up to ``RESTART_BACKOFF_MAX_S``) when it exits while the
deployment is up.  Leaving the context sends SIGTERM to every child (they drain
and exit 0), waits up to ``stop_timeout_s``, then kills what is left.

The children never outlive this process: each is started with
``--exit-with-parent`` and a pipe as its stdin whose write end only this
process holds.  When it dies, of anything (``kill -9`` included), the kernel
closes that end, the child reads the end of its stdin, drains and exits.

The children are ordinary worker processes, visible in ``ps`` and manageable
like any other worker; their stderr is inherited so their logs reach the user.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..addresses import Address, parse_address
from ..errors import WorkerError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

logger = logging.getLogger(__name__)

RESTART_BACKOFF_START_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
STARTUP_TIMEOUT_S = 60.0
ANNOUNCEMENT = " listening on "
# Longest stdout line we wait for before giving up on an announcement (bytes).
MAX_ANNOUNCEMENT_BYTES = 4096


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker process to run.

    Attributes:
        role: encode, prefill, decode or pd.
        worker_id: unique id, also used in logs.
        args: extra command-line options (``--sim-*`` knobs, limits).
        listen: the address to bind; port 0 picks a free port once, and
            restarts reuse the port first bound.
    """

    role: str
    worker_id: str
    args: tuple[str, ...] = ()
    listen: str = "tcp://127.0.0.1:0"


@dataclass
class WorkerProcess:
    """A running (or restarting) child."""

    spec: WorkerSpec
    address: Address | None = None
    process: trio.Process | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)
    announcements: int = 0
    _announced: trio.Event = field(default_factory=trio.Event, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def wait_announced(self, count: int) -> None:
        """Wait until this worker has announced its address ``count`` times in all."""
        while self.announcements < count:
            await self._announced.wait()

    def _mark_announced(self) -> None:
        self.announcements += 1
        self._announced.set()
        self._announced = trio.Event()


class LocalWorkers:
    """The children of one :func:`open_local_workers` block."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.stopping = False

    def kill(self) -> None:
        """SIGKILL every running child at once (a forced stop; the supervisors reap them)."""
        self.stopping = True
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.kill()

    def __getitem__(self, worker_id: str) -> WorkerProcess:
        for worker in self.workers:
            if worker.spec.worker_id == worker_id:
                return worker
        raise KeyError(worker_id)

    @property
    def addresses(self) -> dict[str, Address]:
        """worker id -> bound address, for every worker that has started."""
        return {w.spec.worker_id: w.address for w in self.workers if w.address is not None}


def worker_command(spec: WorkerSpec, listen: str) -> list[str]:
    """The argv that starts ``spec`` listening on ``listen``."""
    return [
        sys.executable,
        "-m",
        "epd_actors",
        "worker",
        "--role",
        spec.role,
        "--worker-id",
        spec.worker_id,
        "--listen",
        listen,
        "--exit-with-parent",
        *spec.args,
    ]


@asynccontextmanager
async def open_local_workers(
    specs: list[WorkerSpec],
    *,
    env: Mapping[str, str] | None = None,
    restart: bool = True,
    stop_timeout_s: float = 10.0,
) -> AsyncIterator[LocalWorkers]:
    """Start the workers, wait until each announced its address, supervise them.

    Args:
        specs: the workers to run.
        env: extra environment for the children (e.g. ``EPD_AUTH_TOKEN``).
        restart: restart a child that exits while the block is running.
        stop_timeout_s: how long children may drain after SIGTERM on exit.

    Raises:
        WorkerError: a child exited or stayed silent before announcing itself.

    Cancellation: cancelling the block kills the children (SIGTERM, then SIGKILL
    after ``stop_timeout_s``, inside a shielded, bounded scope).
    """
    child_env = {**os.environ, **(env or {})}
    deployment = LocalWorkers([WorkerProcess(spec) for spec in specs])
    async with trio.open_nursery() as nursery:
        try:
            for worker in deployment.workers:
                await nursery.start(_supervise, worker, deployment, child_env, restart)
            yield deployment
        finally:
            deployment.stopping = True
            with trio.move_on_after(stop_timeout_s + 5.0, shield=True):
                await _stop_all(deployment.workers, stop_timeout_s)
            nursery.cancel_scope.cancel(reason="local workers stopped")


async def _supervise(
    worker: WorkerProcess,
    deployment: LocalWorkers,
    env: Mapping[str, str],
    restart: bool,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    backoff = RESTART_BACKOFF_START_S
    spec = worker.spec
    while True:
        listen = spec.listen if worker.address is None else str(worker.address)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            process = await trio.lowlevel.open_process(
                worker_command(spec, listen),
                stdout=subprocess.PIPE,
                # Never written: its end tells the child that this process is gone.
                stdin=subprocess.PIPE,
                env=dict(env),
                # Their own session: a terminal's Ctrl-C reaches the parent only,
                # which then stops the children in order (SIGTERM, drain).
                start_new_session=True,
            )
            worker.process = process
            worker.starts += 1
            assert process.stdout is not None
            reader = _LineReader(process.stdout)
            try:
                with trio.fail_after(STARTUP_TIMEOUT_S):
                    worker.address = await _read_announcement(reader, spec)
            except (trio.TooSlowError, WorkerError):
                process.kill()
                await process.wait()
                if worker.starts == 1:
                    raise WorkerError(
                        f"worker {spec.worker_id} did not start (exit {process.returncode})"
                    ) from None
                logger.error("worker %s failed to restart", spec.worker_id)
            else:
                worker._mark_announced()
                if worker.starts == 1:
                    task_status.started()
                else:
                    logger.warning("worker %s restarted (pid %d)", spec.worker_id, process.pid)
                nursery.start_soon(_forward_output, reader, spec.worker_id)
            status = await process.wait()
            assert process.stdin is not None
            with trio.CancelScope(shield=True):  # instant; the exit must still be recorded
                await process.stdin.aclose()
        worker.exits.append(status)
        if deployment.stopping or not restart:
            return
        if trio.current_time() - started >= RESTART_BACKOFF_MAX_S:
            backoff = RESTART_BACKOFF_START_S  # it had been up a while: not a crash loop
        logger.error(
            "worker %s exited with status %d; restarting in %.1fs", spec.worker_id, status, backoff
        )
        await trio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)


async def _read_announcement(reader: _LineReader, spec: WorkerSpec) -> Address:
    while True:
        line = await reader.readline()
        if line is None:
            raise WorkerError(f"worker {spec.worker_id} exited before announcing its address")
        if ANNOUNCEMENT in line:
            return parse_address(line.rsplit(ANNOUNCEMENT, 1)[1].strip(), key="announcement")
        logger.info("[%s] %s", spec.worker_id, line)


async def _forward_output(reader: _LineReader, worker_id: str) -> None:
    while (line := await reader.readline()) is not None:
        logger.info("[%s] %s", worker_id, line)


async def _stop_all(workers: list[WorkerProcess], timeout_s: float) -> None:
    running = [w.process for w in workers if w.process is not None and w.process.returncode is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(timeout_s):
        for process in running:
            await process.wait()
    for process in running:
        if process.returncode is None:
            logger.warning("worker pid %d did not drain in time; killing it", process.pid)
            process.kill()
            await process.wait()


class _LineReader:
    """Splits a child's stdout into text lines (bounded line length)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def readline(self) -> str | None:
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_ANNOUNCEMENT_BYTES:
                line = bytes(self._buffer)
                self._buffer.clear()
                return line.decode(errors="replace")
            chunk = await self._stream.receive_some(4096)
            if not chunk:
                if self._buffer:
                    rest = bytes(self._buffer)
                    self._buffer.clear()
                    return rest.decode(errors="replace")
                return None
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer[:] = rest
        return line.decode(errors="replace").rstrip("\r")
