"""``python -m epd_actors``: the command line.

Subcommands:
    (none)      start a complete local deployment on simulated workers
    worker      run one native worker process
"""

from __future__ import annotations

import argparse
import logging
import sys

from .check_config import add_check_config_arguments, run_check_config
from .worker.cli import add_worker_arguments, run_worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m epd_actors",
        description="A Trio-native router for Encode/Prefill/Decode disaggregated LLM serving.",
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default)")
    commands = parser.add_subparsers(dest="command")
    worker = commands.add_parser("worker", help="run one native worker process")
    add_worker_arguments(worker)
    check = commands.add_parser("check-config", help="validate a configuration file")
    add_check_config_arguments(check)
    from .local import add_local_arguments

    local = commands.add_parser("local", help="the default: a local simulated deployment")
    add_local_arguments(local)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        args = parser.parse_args(["local", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "worker":
        return run_worker(args)
    if args.command == "check-config":
        return run_check_config(args)
    from .local import run_local

    return run_local(args)
