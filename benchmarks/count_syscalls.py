"""How many system calls the router makes per output token: a count, not a timing.

The companion of ``count_calls.py`` for the kernel side.  Starts the
simulated workers of one of ``run_router_overhead.py``'s router scenarios and
the router under ``strace -c -f``, loads it with the bench for ``--requests``
requests, stops it, and does the same with ``--requests`` plus ``--extra``
requests.  The difference between the two counts, divided by the extra
requests' output tokens, is the cost per token without start-up and
shut-down.  Prints the calls per token, each system call's share, and the
reads that found nothing (``EAGAIN``).  ``--baseline`` counts another checkout
the same way, for a before and after; ``--scenario vllm-router-pd`` counts
vllm-router in P/D mode over the same workers, for the side by side::

    python benchmarks/count_syscalls.py --scenario http-pd --token-s 0.01 --step-clock
    python benchmarks/count_syscalls.py --scenario http-pd --token-s 0.01 --step-clock \\
        --baseline <checkout>
    python benchmarks/count_syscalls.py --scenario vllm-router-pd --token-s 0.01 --step-clock \\
        --vllm-router $(command -v vllm-router)

Needs ``strace`` (Linux).  The router runs slower under ``strace``, so reads
that would merge at full speed may not; compare counts of one run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from count_calls import ROUTER_SCENARIOS, add_count_arguments, checkouts, run_load

# Peer routers counted beside ours (a checkout's code does not change them: no --baseline).
PEER_SCENARIOS = ("vllm-router-pd",)

# strace -c's table: "% time  seconds  usecs/call  calls  [errors]  syscall"
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:(\d+)\s+)?(\w+)\s*$")


def parse_summary(text: str) -> dict[str, tuple[int, int]]:
    """``strace -c``'s summary: system call -> (calls, errors)."""
    counts: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        match = _ROW.match(line)
        if match and match.group(3) != "total":
            calls, errors, name = match.groups()
            counts[name] = (int(calls), int(errors or 0))
    return counts


def count_load(
    args: argparse.Namespace, source: str | None, requests: int
) -> tuple[int, dict[str, tuple[int, int]]]:
    """Completed requests and the router's system calls for one load of ``requests``."""
    with tempfile.TemporaryDirectory(prefix="epd-syscalls-") as tmp:
        workdir = Path(tmp)
        out = workdir / "strace.txt"
        wrapper = ("strace", "-c", "-f", "-o", str(out), "--")
        completed = run_load(
            args, source, requests, workdir, router_wrapper=wrapper, vllm_router=args.vllm_router
        )
        # strace wrote its summary when the router exited (the load's end stopped it).
        return completed, parse_summary(out.read_text(encoding="utf-8"))


def per_token(
    args: argparse.Namespace, source: str | None
) -> tuple[int, dict[str, tuple[float, float]]]:
    """Tokens measured, and each system call's (calls, errors) per token."""
    done_small, small = count_load(args, source, args.requests)
    done_large, large = count_load(args, source, args.requests + args.extra)
    tokens = (done_large - done_small) * args.max_tokens
    if tokens <= 0:
        raise SystemExit("the second load completed no more requests than the first")
    rows = {}
    for name, (calls, errors) in large.items():
        before_calls, before_errors = small.get(name, (0, 0))
        if calls > before_calls:
            rows[name] = ((calls - before_calls) / tokens, (errors - before_errors) / tokens)
    return tokens, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scenarios = (*ROUTER_SCENARIOS, *PEER_SCENARIOS)
    add_count_arguments(parser, requests=100, extra=256, scenarios=scenarios)
    parser.add_argument("--vllm-router", default=None, help="path of the vllm-router program")
    parser.set_defaults(scenario="http-pd", top=8)
    args = parser.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("count_syscalls.py needs strace")
    if args.scenario in PEER_SCENARIOS and args.baseline:
        raise SystemExit("--baseline changes our router's code, not a peer's")
    for label, source in checkouts(args):
        tokens, rows = per_token(args, source)
        total = sum(calls for calls, _ in rows.values())
        print(f"{args.scenario}, {label}: {total:.2f} system calls per token ({tokens:,} tokens)")
        ranked = sorted(rows.items(), key=lambda item: -item[1][0])
        for name, (calls, errors) in ranked[: args.top]:
            failed = f"  ({errors:.2f} failed)" if errors else ""
            print(f"  {calls:6.2f}  {name}{failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
