"""``python -m epd_actors``: the command line.

Subcommands:
    (none)        a complete local deployment on simulated workers (``local``)
    serve         the router for real deployments: ``serve --config epd.toml``
    worker        one native worker process
    check-config  validate a configuration file and explain it
    bench         a load generator for any OpenAI-compatible endpoint
"""

from __future__ import annotations

import argparse
import logging
import resource
import signal
import sys
from dataclasses import replace
from typing import Any

import trio

from .. import __version__
from .._groups import first_leaf
from ..bench.cli import add_bench_arguments, run_bench
from ..errors import ConfigError
from ..frontends.cors import CorsPolicy, parse_origins
from ..logs import LOG_FORMATS, configure_logging
from .check_config import add_check_config_arguments, check_topology, run_check_config
from .collector import tune_collector
from .config_file import FileConfig, ServerConfig, load_config, parse_host_port
from .local import add_local_arguments, run_local
from .process_child import child_spec, serve_child
from .processes import child_command, run_processes, serve_processes_overrides
from .serve import serve_router
from .signals import stop_on_signals
from .tls import server_ssl_context, tls_overrides
from .worker import add_worker_arguments, run_worker

COMMANDS = ("local", "serve", "worker", "check-config", "bench")
# Asked for when the hard open-file limit is "unlimited" (Linux then still caps
# the soft limit at fs.nr_open, 1,048,576 by default).
UNLIMITED_NOFILE_TARGET = 1 << 20

logger = logging.getLogger(__name__)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _add_log_level(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING (default), ERROR or CRITICAL, in any case; "
        "before or after the command",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if default is not argparse.SUPPRESS else argparse.SUPPRESS,
        help="text (default) or json: one JSON object per line, for log pipelines",
    )


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with ``(default: X)`` unless the help already names its default.

    Left off for options without a default (None, False, empty), required
    ones and positionals.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or action.required
            or default in (None, False, "", argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # After the command it overrides what came before it; absent, it leaves that alone.
    _add_log_level(common, argparse.SUPPRESS)
    parser = argparse.ArgumentParser(
        prog="python -m epd_actors",
        description="A Trio-native router for Encode/Prefill/Decode disaggregated LLM serving. "
        "Without a command: a local deployment on simulated workers.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"epd_actors {__version__}")
    _add_log_level(parser, "WARNING")
    commands = parser.add_subparsers(dest="command")
    formats: dict[str, Any] = {"formatter_class": DefaultsHelpFormatter}
    local = commands.add_parser(
        "local",
        parents=[common],
        **formats,
        help="(default) router + simulated workers on localhost",
    )
    add_local_arguments(local)
    serve = commands.add_parser(
        "serve", parents=[common], **formats, help="run the router from a config"
    )
    serve.add_argument("--config", required=True, help="the TOML configuration file")
    serve.add_argument("--http-listen", default=None, help="HOST:PORT (overrides the file)")
    serve.add_argument(
        "--host",
        default=None,
        help="host of the HTTP listener, keeping the file's port (vLLM's spelling; "
        "not with --http-listen)",
    )
    serve.add_argument(
        "--port",
        type=int,
        default=None,
        help="port of the HTTP listener, keeping the file's host (vLLM's spelling; "
        "not with --http-listen)",
    )
    serve.add_argument("--ws-listen", default=None, help="HOST:PORT (overrides the file)")
    serve.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="run N router processes on the same listeners (overrides [server] processes)",
    )
    serve.add_argument(
        "--metrics-listen",
        default=None,
        help="HOST:PORT where the parent of --processes serves every process's /metrics",
    )
    serve.add_argument(
        "--ssl-certfile",
        default=None,
        help="PEM certificate chain: serve HTTPS/WSS (overrides [server] ssl_certfile)",
    )
    serve.add_argument(
        "--ssl-keyfile",
        default=None,
        help="PEM private key of --ssl-certfile (overrides [server] ssl_keyfile)",
    )
    serve.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="origins browsers may call the API from: comma-separated or a JSON list, "
        "'*' for any (overrides [server] allowed_origins)",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per HTTP request (as [server] access_log = true), at any --log-level",
    )
    worker = commands.add_parser(
        "worker", parents=[common], **formats, help="run one native worker"
    )
    add_worker_arguments(worker)
    check = commands.add_parser(
        "check-config", parents=[common], **formats, help="validate a configuration file"
    )
    add_check_config_arguments(check)
    bench = commands.add_parser(
        "bench",
        parents=[common],
        **formats,
        help="load an OpenAI-compatible endpoint and summarise",
    )
    add_bench_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the exit status."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(_with_command(arguments))
    configure_logging(args.log_level, args.log_format)
    raise_open_file_limit()
    runners = {
        "local": run_local,
        "serve": run_serve,
        "worker": run_worker,
        "check-config": run_check_config,
        "bench": run_bench,
    }
    return runners[args.command](args)


def _with_command(arguments: list[str]) -> list[str]:
    """``arguments`` with ``local`` put in where no command is named.

    Options before the command (``--log-level LEVEL``, ``--version``, ``-h``) stay in front.
    """
    index = 0
    while index < len(arguments):
        if arguments[index] in ("-h", "--help", "--version"):
            return arguments
        if arguments[index] in ("--log-level", "--log-format"):
            index += 2
        elif arguments[index].startswith(("--log-level=", "--log-format=")):
            index += 1
        else:
            break
    if index < len(arguments) and arguments[index] in COMMANDS:
        return arguments
    return [*arguments[:index], "local", *arguments[index:]]


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns ``(soft, hard)`` after.

    Every client connection, worker connection and listener holds a file
    descriptor, and the usual soft limit (1,024) would cap a router at about
    a thousand streams whatever its configuration says.  The hard limit is
    what the administrator allows; raising the soft limit up to it needs no
    privilege (nginx, HAProxy and Go's runtime do the same at start-up).  A
    refusal is logged and leaves the limit as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_NOFILE_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft, hard
    logger.debug("open-file limit raised from %d to %d", soft, target)
    return target, hard


def run_serve(args: argparse.Namespace) -> int:
    """``serve --config FILE``: run until SIGTERM/SIGINT, then drain."""
    try:
        config = load_config(args.config)
        server = config.server
        if args.http_listen:
            parse_host_port(args.http_listen, key="--http-listen")
            server = replace(server, http_listen=args.http_listen)
        server = host_port_overrides(server, args.host, args.port, http_listen=args.http_listen)
        if args.ws_listen:
            parse_host_port(args.ws_listen, key="--ws-listen")
            server = replace(server, ws_listen=args.ws_listen)
        if args.access_log:
            server = replace(server, http=replace(server.http, access_log=True))
        server = tls_overrides(server, args)
        if args.allowed_origins is not None:
            cors = CorsPolicy(parse_origins(args.allowed_origins))
            server = replace(server, http=replace(server.http, cors=cors))
        server = serve_processes_overrides(server, args)
        config = replace(config, server=server)
        child = child_spec()
        if child is None and server.processes > 1:
            # Each child checks the topology as a single router does.
            return run_processes(config, server.processes, child_command(args))
        check_topology(config)
        if server.ssl_certfile is not None:
            server_ssl_context(server.ssl_certfile, server.ssl_keyfile)  # fail before starting
    except ConfigError as exc:
        print(f"epd_actors serve: configuration error: {exc}", file=sys.stderr)
        return 2
    status = 0
    _tune_collector(config.server.gc_young_threshold)
    try:
        if child is None:
            trio.run(_serve, config)
        else:
            trio.run(serve_child, config, child)
    except* OSError as group:
        listeners = ", ".join(a for a in (server.http_listen, server.ws_listen) if a)
        print(
            f"epd_actors serve: cannot listen on {listeners}: {first_leaf(group)}",
            file=sys.stderr,
        )
        status = 2
    return status


def _tune_collector(young_threshold: int) -> None:
    """Set up the garbage collector for serving (:mod:`.collector`), and say so at debug."""
    tuning = tune_collector(young_threshold)
    if tuning is not None:
        logger.debug(
            "garbage collector: %d start-up objects frozen, thresholds %s",
            tuning.frozen,
            tuning.thresholds,
        )


def host_port_overrides(
    server: ServerConfig, host: str | None, port: int | None, *, http_listen: str | None
) -> ServerConfig:
    """``server`` with ``serve --host/--port`` laid over its ``http_listen``.

    Raises:
        ConfigError: given with ``--http-listen``, or a port out of range.
    """
    if host is None and port is None:
        return server
    if http_listen:
        raise ConfigError("--host/--port and --http-listen set the same listener: give one")
    file_host, file_port = parse_host_port(server.http_listen, key="[server] http_listen")
    host = file_host if host is None else host.strip("[]")
    port = file_port if port is None else port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: {port} is out of range")
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return replace(server, http_listen=listen)


async def _serve(config: FileConfig) -> None:
    """Serve until a signal; a second one stops at once (:mod:`.signals`)."""
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[object]) -> None:
                await serve_router(config, stop=stop, task_status=task_status)
                nursery.cancel_scope.cancel(reason="router stopped")  # stop watching signals

            addresses, _router = await nursery.start(serve)
            print(f"epd_actors: router listening on {addresses.http_url}", flush=True)
            if addresses.ws_url:
                print(f"epd_actors: WebSocket streaming on {addresses.ws_url}", flush=True)
            await stop_on_signals(
                signals, stop, nursery.cancel_scope.cancel, prog="epd_actors serve"
            )
