"""Where the router spends its CPU: sample it with py-spy under the standard load.

Starts the simulated workers of one of ``run_router_overhead.py``'s router
scenarios (``--scenario``, default ``native-epd``: E+P+D over the native
protocol; ``http-pd`` is P+D through the ``openai_http`` backend), runs the
router under ``py-spy record --format raw`` for ``--seconds``, loads it with the
bench (concurrency 32, 64 output tokens or ``--max-tokens``), and prints the functions with the
most samples: *self* (the function was on top of the stack) and *inclusive*.

    pip install py-spy
    python benchmarks/profile_router.py --seconds 10 [--scenario http-pd]

py-spy starts the router itself, so no ptrace permission beyond a parent's
is needed.  The raw samples are written to ``--out`` (folded stacks).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import run_bench, start_scenario
from run_router_overhead import add_pacing_arguments, scenarios

ROUTER_SCENARIOS = ("native-pd", "native-epd", "native-e-pd", "http-pd", "http-epd")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="keep the folded stacks here")
    parser.add_argument("--scenario", choices=ROUTER_SCENARIOS, default="native-epd")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output tokens per request (1: where a request's own CPU goes)",
    )
    add_pacing_arguments(parser)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    scenario = scenarios(args.token_s, step_clock=args.step_clock)[args.scenario]
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="epd-prof-") as tmp:
        workdir = Path(tmp)
        folded = Path(args.out) if args.out else workdir / "router.folded"
        wrapper = (py_spy, "record", "--format", "raw", "--rate", "250", "--nonblocking")
        wrapper += ("--duration", str(int(args.seconds) + 2), "-o", str(folded), "--")
        start_scenario(scenario, stack, workdir, router_wrapper=wrapper)
        document = run_bench(
            scenario.url,
            concurrency=args.concurrency,
            requests=None,
            max_tokens=args.max_tokens,
            cores=None,
            out=workdir / "bench.json",
            extra=("--duration", str(args.seconds)),
        )
        summary = document["summary"]
        print(f"load: {summary['completed']} requests, {summary['request_rate']:.0f} req/s")
        assert scenario.router is not None
        scenario.router.popen.wait(timeout=args.seconds + 30)
        report(folded, args.top)
    return 0


def report(folded: Path, top: int) -> None:
    self_counts: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.read_text(encoding="utf-8").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue  # not a sample line (py-spy may still be finishing the file)
        count = int(count_text)
        frames = [f.split(" (", 1)[0] + " " + _where(f) for f in stack.split(";")]
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    print(f"{total} samples")
    print("top self:")
    for frame, count in self_counts.most_common(top):
        print(f"  {count / total * 100:5.1f}%  {frame}")
    print("top inclusive:")
    for frame, count in inclusive.most_common(top):
        print(f"  {count / total * 100:5.1f}%  {frame}")


def _where(frame: str) -> str:
    if " (" not in frame:
        return ""
    location = frame.split(" (", 1)[1].rstrip(")")
    path, _, _line = location.rpartition(":")
    parts = Path(path).parts
    if not parts:
        return ""
    short = "/".join(parts[parts.index("epd_actors") :]) if "epd_actors" in parts else parts[-1]
    return f"({short})"


if __name__ == "__main__":
    sys.exit(main())
