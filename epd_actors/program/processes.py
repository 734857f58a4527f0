"""``serve --processes N``: N router processes on the same listeners, and their parent.

A Trio router is one thread; one core relays some tens of thousands of tokens
per second.  To use more cores on one host, the parent started by
``serve --processes N`` (or ``[server] processes = N``) runs N full router
replicas, each an ordinary ``python -m epd_actors serve`` child (see
:mod:`epd_actors.program.process_child`), on the same HTTP and WebSocket addresses.

Theory of operation:

* **Listeners.** The parent binds one socket per listen address with
  ``SO_REUSEPORT`` and never listens on it: it resolves port 0 once, reserves
  the port for the whole run, and makes a taken port fail here, before any
  child starts.  Each child binds its own ``SO_REUSEPORT`` listening socket on
  the resolved address once its router is up, so the kernel spreads new
  connections over the children that are serving, each with its own accept
  queue (docs/deployment.md says why this and not one shared socket).
* **Start.** Every child is started at once; the parent waits until each has
  written its ready line (:data:`~epd_actors.program.process_child.READY_MARKER`).  A
  child that exits first (a configuration its router refuses, an import
  error), or stays silent for ``STARTUP_TIMEOUT_S``, makes the parent stop the
  others and raise :class:`ProcessStartError`, which names the child's last
  line on stderr; the command exits 2.
* **Restarts.** A child that exits while the parent is up is started again
  after a backoff that doubles from ``RESTART_BACKOFF_START_S`` up to
  ``RESTART_BACKOFF_MAX_S`` (reset once a child stayed up that long); the
  others keep serving meanwhile.  Connections still queued on the dead child's
  socket are reset by the kernel.
* **Stop.** On SIGTERM or SIGINT the parent sends SIGTERM to every child,
  which drains exactly as a single router does (docs/reliability.md), and
  waits; a second signal, or ``drain_notice_s + drain_timeout_s +
  cleanup_timeout_s + STOP_MARGIN_S`` without an exit, kills what is left.
  The parent exits 0 when every child exited 0.
* **No orphans.** Children are in their own session (a terminal's Ctrl-C
  reaches the parent only, which stops them in order); each watches a pipe
  only the parent holds and drains and exits when it ends.
* **Metrics.** With ``metrics_listen`` the parent serves ``GET /metrics``:
  every child's series with a ``process`` label, scraped from each child's
  private listener at scrape time (:mod:`epd_actors.program.process_metrics`).

Children's stdout and stderr pass through the parent line by line, unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import trio

from .._groups import first_leaf
from ..errors import ConfigError
from .config_file import parse_host_port
from .process_child import CHILD_ENV, READY_MARKER, ChildSpec, reuse_port_socket
from .process_metrics import merge, scrape, serve_metrics

if TYPE_CHECKING:
    import argparse
    import socket
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence

    from .config_file import FileConfig, ServerConfig

logger = logging.getLogger(__name__)

RESTART_BACKOFF_START_S = 0.25
RESTART_BACKOFF_MAX_S = 10.0
STARTUP_TIMEOUT_S = 60.0
STOP_MARGIN_S = 5.0
# Longest line of a child's output passed on as one line (bytes).
MAX_LINE_BYTES = 65536


class ProcessStartError(Exception):
    """A router process exited, or stayed silent, before it was ready."""


@dataclass
class RouterProcess:
    """One child slot: the process now in it and its history."""

    index: int
    process: trio.Process | None = None
    private_http: tuple[str, int] | None = None
    ready: bool = False
    starts: int = 0
    exits: list[int] = field(default_factory=list)
    last_error_line: str = ""

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)


@dataclass(frozen=True, slots=True)
class Listen:
    """One address every child binds, and the parent's reserving socket on it."""

    host: str
    port: int
    holder: socket.socket

    @classmethod
    def reserve(cls, listen: str, *, key: str) -> Listen:
        """Bind (without listening) ``listen``'s address, resolving port 0.

        Raises:
            OSError: the address is taken or cannot be bound.
        """
        host, port = parse_host_port(listen, key=key)
        holder = reuse_port_socket(host, port, listen=False)
        return cls(host, holder.getsockname()[1], holder)

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


class RouterProcesses:
    """The parent of N router processes (see the module docstring).

    Args:
        config: the configuration (the parent reads ``[server]`` only).
        count: how many router processes.
        command: the argv of one child; the child learns its part from the
            :data:`~epd_actors.program.process_child.CHILD_ENV` variable.
        env: the children's environment (default: the parent's).
        announce: called with each line the parent has to say (default: print).
    """

    def __init__(
        self,
        config: FileConfig,
        count: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.config = config
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.children = [RouterProcess(index) for index in range(count)]
        self.stopping_event = trio.Event()
        self.http: Listen | None = None
        self.ws: Listen | None = None
        self.announce = announce or partial(print, flush=True)
        self._changed = trio.Event()
        self._started_while_stopping: list[trio.Process] = []

    @property
    def stop_timeout_s(self) -> float:
        """How long children may take to drain after SIGTERM before they are killed."""
        server, deadlines = self.config.server, self.config.router.deadlines
        return (
            server.drain_notice_s
            + server.drain_timeout_s
            + deadlines.cleanup_timeout_s
            + STOP_MARGIN_S
        )

    def reserve(self) -> None:
        """Bind the parent's reserving sockets (before anything starts).

        Raises:
            OSError: an address is taken or cannot be bound.
        """
        server = self.config.server
        self.http = Listen.reserve(server.http_listen, key="server.http_listen")
        if server.ws_listen is not None:
            self.ws = Listen.reserve(server.ws_listen, key="server.ws_listen")

    def close(self) -> None:
        """Release the reserved ports."""
        for listen in (self.http, self.ws):
            if listen is not None:
                listen.holder.close()

    def spec(self, index: int) -> ChildSpec:
        assert self.http is not None, "reserve() first"
        ws = () if self.ws is None else (self.ws.address,)
        return ChildSpec(index, (self.http.address,), ws)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every child, report once all are ready, then keep them up until cancelled.

        Raises:
            ProcessStartError: a child could not start the first time.

        Cancellation: cancelling stops every child at once (SIGKILL); use
        :meth:`stop` first for a graceful drain.
        """
        try:
            async with trio.open_nursery() as nursery:
                for child in self.children:
                    nursery.start_soon(self._keep_running, child)
                await self._wait_all_ready()
                task_status.started()
        finally:
            with trio.move_on_after(STOP_MARGIN_S, shield=True):
                for child in self.children:
                    if child.process is not None and child.process.returncode is None:
                        child.process.kill()
                        await child.process.wait()

    async def stop(self, *, escalate: trio.Event | None = None) -> bool:
        """SIGTERM every child, wait for them to drain; True when every one exited 0.

        Kills what is left after :attr:`stop_timeout_s`, or as soon as
        ``escalate`` is set (a second signal).  Cancellation: the children
        are killed by :meth:`run`'s cleanup.
        """
        self.stopping_event.set()
        running = [c.process for c in self.children if c.process and c.process.returncode is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        async with trio.open_nursery() as nursery:
            if escalate is not None:
                nursery.start_soon(_kill_when_set, escalate, running)
            with trio.move_on_after(self.stop_timeout_s):
                for process in running:
                    await process.wait()
            # A child started while stopping began is stopped in _run_once.
            running += self._started_while_stopping
            for process in running:
                if process.returncode is None:
                    logger.warning("router process pid %d did not drain in time", process.pid)
                    process.kill()
                    await process.wait()
            nursery.cancel_scope.cancel(reason="router processes stopped")
        return all(process.returncode == 0 for process in running)

    async def _wait_all_ready(self) -> None:
        with trio.fail_after(STARTUP_TIMEOUT_S):
            while True:
                for child in self.children:
                    if child.exits and not child.ready:
                        detail = f": {child.last_error_line}" if child.last_error_line else ""
                        raise ProcessStartError(
                            f"router process {child.index} exited with status "
                            f"{child.exits[-1]} before it was ready{detail}"
                        )
                if all(child.ready for child in self.children):
                    return
                await self._changed_wait()

    async def _changed_wait(self) -> None:
        await self._changed.wait()

    def _mark_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _keep_running(self, child: RouterProcess) -> None:
        backoff = RESTART_BACKOFF_START_S
        while True:
            started = trio.current_time()
            status = await self._run_once(child)
            child.exits.append(status)
            self._mark_changed()
            if self.stopping_event.is_set():
                return
            if child.starts == 1 and child.private_http is None:
                return  # never ready on its first start: the whole start fails
            if trio.current_time() - started >= RESTART_BACKOFF_MAX_S:
                backoff = RESTART_BACKOFF_START_S
            logger.error(
                "router process %d exited with status %d; restarting in %.2fs",
                child.index,
                status,
                backoff,
            )
            await trio.sleep(backoff)
            if self.stopping_event.is_set():
                return
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    async def _run_once(self, child: RouterProcess) -> int:
        env = {**self.env, CHILD_ENV: self.spec(child.index).to_env()}
        process = await trio.lowlevel.open_process(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        child.process = process
        child.ready = False
        child.starts += 1
        if self.stopping_event.is_set():
            self._started_while_stopping.append(process)
            process.send_signal(signal.SIGTERM)
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_stdout, child, process.stdout)
                nursery.start_soon(self._read_stderr, child, process.stderr)
                await process.wait()
        finally:
            # Only the parent holds the pipe's write end: closing it tells the
            # child, were it still running, that the parent is gone.
            assert process.stdin is not None
            with trio.CancelScope(shield=True):
                await process.stdin.aclose()
        child.ready = False
        if child.private_http is not None and not self.stopping_event.is_set():
            logger.warning("router process %d (pid %d) exited", child.index, process.pid)
        return process.returncode if process.returncode is not None else -1

    async def _read_stdout(self, child: RouterProcess, stream: trio.abc.ReceiveStream) -> None:
        async for line in _lines(stream):
            if line.startswith(READY_MARKER):
                self._child_ready(child, line[len(READY_MARKER) :])
            else:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

    async def _read_stderr(self, child: RouterProcess, stream: trio.abc.ReceiveStream) -> None:
        async for line in _lines(stream):
            if line.strip():
                child.last_error_line = line.strip()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def _child_ready(self, child: RouterProcess, text: str) -> None:
        try:
            ready = json.loads(text)
            host, _, port = str(ready["private_http"]).rpartition(":")
            child.private_http = (host, int(port))
        except (ValueError, KeyError, TypeError):
            logger.error("router process %d: unreadable ready line %r", child.index, text)
            return
        if child.starts > 1:
            logger.warning(
                "router process %d restarted (pid %s, restart %d)",
                child.index,
                child.pid,
                child.restarts,
            )
        child.ready = True
        self._mark_changed()


async def _kill_when_set(event: trio.Event, processes: list[trio.Process]) -> None:
    await event.wait()
    for process in processes:
        if process.returncode is None:
            logger.warning("killing router process pid %d", process.pid)
            process.kill()


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    buffer = bytearray()
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            chunk = b""
        if not chunk:
            if buffer:
                yield bytes(buffer).decode(errors="replace")
            return
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0 or len(buffer) > MAX_LINE_BYTES:
            cut = end if end >= 0 else MAX_LINE_BYTES
            line = bytes(buffer[:cut])
            del buffer[: cut + (1 if end >= 0 else 0)]
            yield line.decode(errors="replace").rstrip("\r")


async def render_metrics(group: RouterProcesses) -> bytes:
    """Every ready child's metrics, scraped now, merged with a ``process`` label."""
    scrapes: dict[str, bytes | None] = {str(child.index): None for child in group.children}

    async def one(label: str, address: tuple[str, int]) -> None:
        scrapes[label] = await scrape(address)

    async with trio.open_nursery() as nursery:
        for child in group.children:
            if child.ready and child.private_http is not None:
                nursery.start_soon(one, str(child.index), child.private_http)
    return merge(scrapes, {str(child.index): child.restarts for child in group.children})


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve_processes(group: RouterProcesses) -> bool:
    """Run ``group`` until SIGTERM/SIGINT, then stop it; True when every child exited 0.

    Expects :meth:`RouterProcesses.reserve` done.  A second signal while
    stopping kills the children.

    Raises:
        ProcessStartError: a child could not start.
        OSError: ``metrics_listen`` cannot be bound.
    """
    assert group.http is not None, "reserve() first"
    escalate = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(group.run)
            lines = [
                f"epd_actors: router listening on {_url(*group.http.address)} "
                f"({len(group.children)} processes)"
            ]
            if group.ws is not None:
                lines.append(
                    f"epd_actors: WebSocket streaming on {_url(*group.ws.address, 'ws')}/v1/ws"
                )
            metrics_listen = group.config.server.metrics_listen
            if metrics_listen is not None:
                host, port = parse_host_port(metrics_listen, key="server.metrics_listen")
                listeners = await trio.open_tcp_listeners(port, host=host)
                await nursery.start(serve_metrics, listeners, partial(render_metrics, group))
                bound = listeners[0].socket.getsockname()[1]
                lines.append(f"epd_actors: metrics of every process on {_url(host, bound)}/metrics")
            for child in group.children:
                assert child.private_http is not None
                lines.append(
                    f"epd_actors: router process {child.index}: pid {child.pid}, "
                    f"this process alone on {_url(*child.private_http)}"
                )
            for line in lines:
                group.announce(line)
            async for _ in signals:
                break
            nursery.start_soon(_second_signal, signals, escalate)
            clean = await group.stop(escalate=escalate)
            nursery.cancel_scope.cancel(reason="router processes stopped")
    return clean


async def _second_signal(signals: AsyncIterator[int], escalate: trio.Event) -> None:
    async for _ in signals:
        escalate.set()
        return


def run_processes(config: FileConfig, count: int, command: Sequence[str]) -> int:
    """``serve --processes N``: the parent's whole life; returns the exit status.

    0 after a clean stop, 1 when a child did not exit 0 when stopped, 2 when
    a listener cannot be bound or a child cannot start.
    """
    group = RouterProcesses(config, count, command)
    try:
        group.reserve()
    except OSError as exc:
        print(f"epd_actors serve: cannot listen: {exc}", file=sys.stderr)
        return 2
    status = 2
    try:
        status = 0 if trio.run(serve_processes, group) else 1
    except* ProcessStartError as failed:
        print(f"epd_actors serve: {first_leaf(failed)}", file=sys.stderr)
    except* OSError as failed:
        print(f"epd_actors serve: cannot listen: {first_leaf(failed)}", file=sys.stderr)
    finally:
        group.close()
    return status


def serve_processes_overrides(server: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    """``server`` with ``serve``'s ``--processes`` and ``--metrics-listen`` applied.

    Raises:
        ConfigError: a count below 1 or a malformed address, naming the option.
    """
    if args.processes is not None:
        if args.processes < 1:
            raise ConfigError(f"--processes: must be >= 1, got {args.processes}")
        server = replace(server, processes=args.processes)
    if args.metrics_listen is not None:
        parse_host_port(args.metrics_listen, key="--metrics-listen")
        server = replace(server, metrics_listen=args.metrics_listen)
    return server


def child_command(args: argparse.Namespace) -> list[str]:
    """The argv of one router process: ``serve`` with the parent's file and overrides."""
    command = [sys.executable, "-m", "epd_actors"]
    command += ["--log-level", args.log_level, "--log-format", args.log_format]
    command += ["serve", "--config", os.path.abspath(args.config)]
    if args.http_listen:
        command += ["--http-listen", args.http_listen]
    if args.ws_listen:
        command += ["--ws-listen", args.ws_listen]
    if args.access_log:
        command.append("--access-log")
    if getattr(args, "allowed_origins", None) is not None:
        command += ["--allowed-origins", args.allowed_origins]
    for option, value in (
        ("--ssl-certfile", getattr(args, "ssl_certfile", None)),
        ("--ssl-keyfile", getattr(args, "ssl_keyfile", None)),
    ):
        if value:
            command += [option, os.path.abspath(value)]
    return command
