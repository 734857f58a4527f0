"""``python -m epd_actors worker``: run one native worker process.

The process binds its listen address, prints one line
``epd_actors worker <id> (<role>) listening on <address>`` on stdout (the bound
port when port 0 was asked for), and serves until SIGTERM or SIGINT, which start
a drain: stop accepting, say goodbye, finish in-flight work up to
``--drain-timeout``, exit 0.  An engine crash exits with status 3.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import trio

from .._groups import first_leaf
from ..addresses import bound_address, open_listeners, parse_address
from ..errors import ConfigError, EngineCrashed
from ..protocol import Role
from ..simulator.cli import add_sim_arguments, sim_config_from_args, sim_stores_from_args
from ..simulator.engine import SimEngine
from ..simulator.kv_events import sim_worker_kv_events
from ..simulator.openai_server import SimOpenAIServer, serve_openai_process
from ..worker.engines.vllm_args import add_vllm_arguments
from ..worker.metrics_http import serve_metrics
from ..worker.runtime import WorkerConfig, WorkerServer
from .worker_registration import (
    Registrar,
    RegistrationSettings,
    add_registration_arguments,
    registration_from_args,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import AsyncIterator, Callable

    from ..worker.engine import Engine
    from ..worker.engines.vllm_args import VllmOptions

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "EPD_AUTH_TOKEN"
EXIT_ENGINE_CRASHED = 3


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``worker`` subcommand."""
    parser.add_argument(
        "--role",
        required=True,
        choices=[r.value for r in Role],
        help="the stage this worker serves (required)",
    )
    parser.add_argument(
        "--engine", default="sim", choices=list(ENGINE_RUNNERS), help="engine (default sim)"
    )
    parser.add_argument(
        "--listen",
        default="tcp://127.0.0.1:0",
        help="tcp://HOST:PORT or unix:PATH (default tcp://127.0.0.1:0: a free port)",
    )
    parser.add_argument("--worker-id", default=None, help="default: <role>-<pid>")
    parser.add_argument("--model", default="sim-model", help="model name announced to routers")
    parser.add_argument(
        "--lora-adapter",
        dest="lora_adapters",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter of --model the worker serves (repeatable; --engine sim): "
        "announced to routers, and a request naming another adapter is refused",
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--auth-token-file", default=None, help=f"file holding the token (else ${AUTH_TOKEN_ENV})"
    )
    auth.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="accept any client token (development only)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=64, help="requests the engine runs at once"
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests waiting for a slot before new ones are refused (overloaded)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may finish",
    )
    parser.add_argument(
        "--heartbeat-delay", type=float, default=0.0, metavar="SECONDS", help="fault injection"
    )
    parser.add_argument("--heartbeat-drop", action="store_true", help="fault injection")
    parser.add_argument(
        "--serve-openai",
        action="store_true",
        help="serve vLLM's OpenAI HTTP API (the disaggregated contract) instead of the "
        "native protocol, for the openai_http backend; sim engine only, no auth (testing)",
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="drain and exit when stdin reaches its end: started by a parent that holds the "
        "pipe's other end (python -m epd_actors local does), it never outlives that parent",
    )
    parser.add_argument(
        "--metrics-listen",
        default=None,
        metavar="tcp://HOST:PORT",
        help="also serve the process's Prometheus metrics (with --engine vllm: vLLM's own "
        "vllm:* metrics) on GET /metrics at this address (default: none)",
    )
    add_registration_arguments(parser)
    add_sim_arguments(parser)
    add_vllm_arguments(parser)


def _auth_token(args: argparse.Namespace) -> str | None:
    if args.insecure_no_auth:
        return None
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ConfigError(f"--auth-token-file: {exc}") from None
    else:
        token = os.environ.get(AUTH_TOKEN_ENV, "")
    if not token:
        raise ConfigError(
            f"no auth token: set ${AUTH_TOKEN_ENV}, pass --auth-token-file, "
            "or --insecure-no-auth for development"
        )
    return token


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Validate the runtime's options (any engine) and build its configuration."""
    role = Role(args.role)
    worker_id = args.worker_id or f"{role.value}-{os.getpid()}"
    _positive("--max-concurrency", args.max_concurrency)
    _positive("--drain-timeout", args.drain_timeout)
    if args.max_queued < 0:
        raise ConfigError(f"--max-queued must be >= 0, got {args.max_queued}")
    return WorkerConfig(
        worker_id=worker_id,
        auth_token=_auth_token(args),
        max_concurrency=args.max_concurrency,
        max_queued=args.max_queued,
        drain_timeout_s=args.drain_timeout,
        heartbeat_delay_s=args.heartbeat_delay,
        heartbeat_drop=args.heartbeat_drop,
    )


def build_worker(args: argparse.Namespace) -> WorkerServer:
    """Validate the options and build the (simulator) engine and server (no I/O yet)."""
    config = worker_config_from_args(args)
    if getattr(args, "engine_args", None):
        raise ConfigError("arguments after -- are vLLM engine arguments: they need --engine vllm")
    stores = sim_stores_from_args(args)
    engine: Engine = SimEngine(
        Role(args.role),
        worker_id=config.worker_id,
        config=sim_config_from_args(args),
        ec_store=stores.ec,
        kv_store=stores.kv,
        model=args.model,
        lora_adapters=args.lora_adapters,
    )
    return WorkerServer(engine, config)


def build_openai_server(args: argparse.Namespace) -> SimOpenAIServer:
    """The simulator behind vLLM's OpenAI HTTP API (``--serve-openai``; no I/O yet)."""
    if args.engine != "sim":
        raise ConfigError("--serve-openai serves the simulator; for vLLM run `vllm serve` itself")
    role = Role(args.role)
    worker_id = args.worker_id or f"{role.value}-{os.getpid()}"
    stores = sim_stores_from_args(args)
    engine = SimEngine(
        role,
        worker_id=worker_id,
        config=sim_config_from_args(args),
        ec_store=stores.ec,
        kv_store=stores.kv,
        model=args.model,
        lora_adapters=args.lora_adapters,
    )
    return SimOpenAIServer(engine, worker_id=worker_id)


def _run_vllm_worker(args: argparse.Namespace) -> None:
    """Check every option, then start vLLM and serve (``--engine vllm``)."""
    from ..worker.engines.vllm_args import (
        check_vllm_installed,
        engine_cli_args,
        vllm_options_from_args,
    )

    config = worker_config_from_args(args)
    if args.lora_adapters:
        raise ConfigError("--lora-adapter is for --engine sim; vLLM takes --lora-modules after --")
    if args.model == "sim-model":
        raise ConfigError("--engine vllm needs --model (a model directory or Hugging Face id)")
    options = vllm_options_from_args(args)
    engine_cli_args(Role(args.role), args.model, options)  # checks the role's connectors
    registration = registration_from_args(args, role=args.role, model=args.model)
    check_vllm_installed()
    trio.run(_serve_vllm_worker, args, config, options, registration)


async def _serve_vllm_worker(
    args: argparse.Namespace,
    config: WorkerConfig,
    options: VllmOptions,
    registration: RegistrationSettings | None,
) -> None:
    """Start the engine (minutes, for a big model), then bind and serve."""
    from ..worker.engines.vllm import open_vllm_engine

    async with open_vllm_engine(Role(args.role), args.model, options) as engine:
        await serve_worker_process(
            WorkerServer(engine, config),
            args.listen,
            metrics_listen=args.metrics_listen,
            registration=registration,
            exit_with_parent=args.exit_with_parent,
        )


async def serve_worker_process(
    server: WorkerServer,
    listen: str,
    *,
    metrics_listen: str | None = None,
    registration: RegistrationSettings | None = None,
    exit_with_parent: bool = False,
) -> None:
    """Bind, announce the address, serve; SIGTERM/SIGINT start a drain.

    With ``metrics_listen``, the process's Prometheus registry is served there
    too (announced on a second line, ``... metrics on http://HOST:PORT/metrics``).
    With ``registration``, the worker keeps its registration in Redis from the
    moment it accepts until it stops (draining while it drains;
    :mod:`.worker_registration`).

    With ``exit_with_parent``, the end of stdin starts a drain too: the parent
    that started this process holds the pipe's write end, and the kernel
    closes it when that parent dies, even of ``kill -9`` (``PR_SET_PDEATHSIG``
    would follow the thread that started the child, which Trio does not fix).

    Returns once the drain finished (the metrics endpoint stops with it).
    Cancellation: cancelling this coroutine stops the worker at once (jobs are
    aborted in the engine).
    """
    address = parse_address(listen, key="--listen")
    metrics_address = None
    if metrics_listen is not None:
        metrics_address = parse_address(metrics_listen, key="--metrics-listen")
        if metrics_address.scheme != "tcp":
            raise ConfigError(f"--metrics-listen: {metrics_listen!r} is not tcp://HOST:PORT")
    if registration is not None:
        registration.advertised(address)  # a wildcard without --advertise-address: refused now
    listeners = await open_listeners(address)
    registrar: Registrar | None = None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            if metrics_address is not None:
                metrics_listeners = await open_listeners(metrics_address)
                await nursery.start(functools.partial(serve_metrics, metrics_listeners))
                bound = bound_address(metrics_address, metrics_listeners)
                print(
                    f"epd_actors worker {server.config.worker_id} metrics on "
                    f"http://{bound.host}:{bound.port}/metrics",
                    flush=True,
                )
            await nursery.start(_serve_until_drained, server, listeners, nursery.cancel_scope)
            print(
                f"epd_actors worker {server.config.worker_id} ({server.engine.role.value}) "
                f"listening on {bound_address(address, listeners)}",
                flush=True,
            )
            if registration is not None:
                bound = bound_address(address, listeners)
                registrar = Registrar(
                    registration,
                    server.config.worker_id,
                    registration.advertised(bound),
                    draining=lambda: server.draining,
                )
                await nursery.start(registrar.run)
            nursery.start_soon(_drain_on_signal, server, signals, registrar)
            if exit_with_parent:
                nursery.start_soon(
                    _drain_when_stdin_ends, server, trio.lowlevel.FdStream(os.dup(0)), registrar
                )


async def _drain_when_stdin_ends(
    server: WorkerServer, stdin: trio.abc.ReceiveStream, registrar: Registrar | None
) -> None:
    """Begin a drain when ``stdin`` ends (whatever arrives before is ignored).

    Cancellation: returns when cancelled (the worker stopped by itself); the
    stream is closed either way.
    """
    async with stdin:
        try:
            while await stdin.receive_some(512):
                pass
        except (trio.BrokenResourceError, OSError):
            pass
    logger.warning("worker %s: the parent process is gone; draining", server.config.worker_id)
    server.begin_drain("the parent process is gone")
    if registrar is not None:
        registrar.wake()


async def _serve_until_drained(
    server: WorkerServer,
    listeners: list[trio.SocketListener],
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await server.serve(listeners, task_status=task_status)
    scope.cancel(reason="worker drained")


async def _drain_on_signal(
    server: WorkerServer, signals: AsyncIterator[int], registrar: Registrar | None
) -> None:
    async for signum in signals:
        server.begin_drain(f"received {signal.Signals(signum).name}")
        if registrar is not None:
            registrar.wake()


def _run_sim_worker(args: argparse.Namespace) -> None:
    """Build the simulated engine and serve the native protocol (``--engine sim``)."""
    server = build_worker(args)
    registration = registration_from_args(args, role=args.role, model=args.model)
    assert isinstance(server.engine, SimEngine)
    with sim_worker_kv_events(server.engine):
        trio.run(
            functools.partial(
                serve_worker_process,
                server,
                args.listen,
                metrics_listen=args.metrics_listen,
                registration=registration,
                exit_with_parent=args.exit_with_parent,
            )
        )


ENGINE_RUNNERS: dict[str, Callable[[argparse.Namespace], None]] = {
    "sim": _run_sim_worker,
    "vllm": _run_vllm_worker,
}
"""``--engine`` name -> what runs a worker of that engine until it stops.

A new engine is its ``Engine`` class plus one entry here (a runner that builds
the engine from the options, serves it with ``serve_worker_process`` and
returns); the choices of ``--engine`` follow.  A runner raises ``ConfigError``
for bad options and lets ``EngineCrashed`` propagate.
"""


def run_worker(args: argparse.Namespace) -> int:
    """Entry point of ``python -m epd_actors worker``; returns the exit status."""
    status = 0
    try:
        if getattr(args, "serve_openai", False):
            if registration_from_args(args, role=args.role, model=args.model) is not None:
                raise ConfigError("--register is for native workers, not --serve-openai")
            trio.run(serve_openai_process, build_openai_server(args), args.listen)
        else:
            ENGINE_RUNNERS[args.engine](args)
    except* ConfigError as group:
        print(f"epd_actors worker: configuration error: {first_leaf(group)}", file=sys.stderr)
        status = 2
    except* OSError as group:
        print(
            f"epd_actors worker: cannot listen on {args.listen}: {first_leaf(group)}",
            file=sys.stderr,
        )
        status = 2
    except* EngineCrashed as group:
        print(f"epd_actors worker: engine crashed: {first_leaf(group)}", file=sys.stderr)
        status = EXIT_ENGINE_CRASHED
    return status
