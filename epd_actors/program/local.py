"""The default command: a complete local deployment on simulated workers.

``python -m epd_actors`` starts simulated E, P and D workers as child
processes (each an ordinary ``python -m epd_actors worker``, restarted if it
dies), a router over them with the native backend, and the HTTP and WebSocket
front ends on localhost; it prints where everything is and an example request.
Ctrl-C (or SIGTERM) stops accepting, lets in-flight requests finish, then stops
the workers.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import trio

from .._groups import first_leaf
from ..core.config import PoolConfig, RouterConfig, WorkerEndpoint
from ..errors import WorkerError
from ..frontends.http_app import HttpSettings
from .collector import DEFAULT_YOUNG_THRESHOLD, tune_collector
from .config_file import FileConfig, ServerConfig
from .deployment import LocalWorkers, WorkerSpec, open_local_workers
from .serve import ServingAddresses, serve_router
from .signals import stop_on_signals
from .worker import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    import argparse

MODEL = "sim-model"


def add_local_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the default (``local``) command."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--ws-port",
        type=int,
        default=None,
        help="WebSocket port (0: any; -1: no WebSocket; default: the HTTP port + 1, "
        "or any free one with --port 0)",
    )
    parser.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, how long in-flight requests may finish (default 30)",
    )
    parser.add_argument("--encoders", type=int, default=1, help="simulated E workers (default 1)")
    parser.add_argument("--prefills", type=int, default=1, help="simulated P workers (default 1)")
    parser.add_argument("--decoders", type=int, default=1, help="simulated D workers (default 1)")
    parser.add_argument(
        "--pd",
        type=int,
        default=0,
        help="simulated merged PD workers; when > 0 the topology is E+PD (no P, no D)",
    )


def local_specs(args: argparse.Namespace, store_dir: str) -> list[WorkerSpec]:
    """One spec per simulated worker, all sharing ``store_dir``."""
    store = ("--sim-store-dir", store_dir)
    counts = {"encode": args.encoders}
    if args.pd > 0:
        counts["pd"] = args.pd
    else:
        counts.update(prefill=args.prefills, decode=args.decoders)
    return [
        WorkerSpec(role, f"{role}-{index}", store)
        for role, count in counts.items()
        for index in range(count)
    ]


def local_config(args: argparse.Namespace, workers: LocalWorkers, token: str) -> FileConfig:
    """The router configuration over the started workers."""
    pools: dict[str, list[WorkerEndpoint]] = {}
    for worker in workers.workers:
        assert worker.address is not None
        endpoint = WorkerEndpoint(worker.spec.worker_id, str(worker.address))
        pools.setdefault(worker.spec.role, []).append(endpoint)
    router = RouterConfig(
        tuple(PoolConfig(stage, tuple(endpoints)) for stage, endpoints in pools.items()),
        auth_token=token,
        model=MODEL,
    )
    ws_port = local_ws_port(args.port, args.ws_port)
    ws_listen = None if ws_port < 0 else f"{args.host}:{ws_port}"
    server = ServerConfig(
        f"{args.host}:{args.port}",
        ws_listen,
        drain_timeout_s=args.drain_timeout,
        http=HttpSettings(access_log=args.access_log),
    )
    return FileConfig(router, server)


def local_ws_port(http_port: int, ws_port: int | None) -> int:
    """The WebSocket port: as given, else the HTTP port + 1, else (``--port 0``) any free one."""
    if ws_port is not None:
        return ws_port
    return 0 if http_port == 0 else http_port + 1


def banner(addresses: ServingAddresses, workers: LocalWorkers) -> str:
    """What the user sees once everything is up."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    )
    lines = [
        f"epd_actors: router listening on {addresses.http_url}",
    ]
    if addresses.ws_url:
        lines.append(f"epd_actors: WebSocket streaming on {addresses.ws_url}")
    lines.append("epd_actors: the workers are SIMULATED (no GPU, no vLLM):")
    lines += [f"    {w.spec.worker_id:<10} {w.spec.role:<8} {w.address}" for w in workers.workers]
    lines += [
        "try it:",
        f"    curl -s {addresses.http_url}/v1/chat/completions \\",
        "      -H 'content-type: application/json' \\",
        f"      -d '{body}'",
        "to route to real vLLM instead: write a config (see examples/epd.toml and",
        "docs/deployment.md) and run:  python -m epd_actors serve --config epd.toml",
        "Ctrl-C stops everything.",
        "(It drains in-flight requests first; a second Ctrl-C stops at once.)",
    ]
    return "\n".join(lines)


async def serve_local(args: argparse.Namespace) -> None:
    """Start workers and router; serve until SIGINT/SIGTERM; stop in order."""
    token = secrets.token_urlsafe(24)
    stop = trio.Event()
    with (
        tempfile.TemporaryDirectory(prefix="epd-sim-") as store_dir,
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        specs = local_specs(args, store_dir)
        async with open_local_workers(specs, env={AUTH_TOKEN_ENV: token}) as workers:
            config = local_config(args, workers, token)
            async with trio.open_nursery() as nursery:

                async def serve(task_status: trio.TaskStatus[object]) -> None:
                    await serve_router(config, stop=stop, task_status=task_status)
                    nursery.cancel_scope.cancel(reason="router stopped")  # stop watching signals

                def force() -> None:
                    workers.kill()
                    nursery.cancel_scope.cancel(reason="stopped at once")

                addresses, _router = await nursery.start(serve)
                print(banner(addresses, workers), flush=True)
                await stop_on_signals(signals, stop, force)
    print("epd_actors: stopped.", file=sys.stderr)


def run_local(args: argparse.Namespace) -> int:
    """Entry point of the default command; returns the exit status."""
    if not args.drain_timeout > 0:
        print(
            f"epd_actors: --drain-timeout must be positive, got {args.drain_timeout}",
            file=sys.stderr,
        )
        return 2
    status = 0
    tune_collector(DEFAULT_YOUNG_THRESHOLD)
    try:
        trio.run(serve_local, args)
    except* OSError as group:
        print(f"epd_actors: cannot serve: {first_leaf(group)}", file=sys.stderr)
        print("epd_actors: is the port taken? try --port 0", file=sys.stderr)
        status = 2
    except* WorkerError as group:
        print(f"epd_actors: {first_leaf(group)}", file=sys.stderr)
        status = 2
    except* KeyboardInterrupt:
        print("epd_actors: interrupted again; stopped at once.", file=sys.stderr)
        status = 130
    return status
