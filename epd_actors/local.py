"""The default command: a complete local deployment on simulated workers."""

from __future__ import annotations

import secrets
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import trio

from .deployment import WorkerSpec, open_local_workers
from .worker.cli import AUTH_TOKEN_ENV

if TYPE_CHECKING:
    import argparse


def add_local_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the default (``local``) command."""
    parser.add_argument("--encoders", type=int, default=1, help="simulated E workers (default 1)")
    parser.add_argument("--prefills", type=int, default=1, help="simulated P workers (default 1)")
    parser.add_argument("--decoders", type=int, default=1, help="simulated D workers (default 1)")


def local_specs(args: argparse.Namespace, store_dir: str) -> list[WorkerSpec]:
    """One spec per simulated worker, all sharing ``store_dir``."""
    store = ("--sim-store-dir", store_dir)
    specs = []
    for role, count in (
        ("encode", args.encoders),
        ("prefill", args.prefills),
        ("decode", args.decoders),
    ):
        specs += [WorkerSpec(role, f"{role}-{i}", store) for i in range(count)]
    return specs


async def serve_local(args: argparse.Namespace) -> None:
    """Start the workers, print where they are, run until SIGINT/SIGTERM."""
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="epd-sim-") as store_dir:
        specs = local_specs(args, store_dir)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_local_workers(specs, env={AUTH_TOKEN_ENV: token}) as workers:
                print("epd_actors: simulated workers are up (no GPU, no vLLM):", flush=True)
                for worker_id, address in workers.addresses.items():
                    print(f"  {worker_id:<12} {address}", flush=True)
                print("  Ctrl-C stops everything.", flush=True)
                async for _ in signals:
                    break
    print("epd_actors: stopped.", file=sys.stderr)


def run_local(args: argparse.Namespace) -> int:
    trio.run(serve_local, args)
    return 0
