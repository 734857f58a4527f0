"""How long a change on one router takes to show on another through a real Redis.

Starts a redis-server on a free loopback port, two routers over the same
simulated workers with the default ``[shared]`` periods (publish every 0.2 s),
and measures, ``--rounds`` times: an admin drain on router A until router B has
the worker drained, and a request held on A until B counts it as remote load.

    python benchmarks/fleet_propagation.py --rounds 20

Needs redis-server and the ``redis`` extra.  Prints medians and maxima (ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from typing import TYPE_CHECKING

from epd_actors.core.fleet import SharedSettings
from epd_actors.core.fleet.redis_state import RedisFleetStore
from tests.fleet.redis_server import RedisServer
from tests.fleet.replicas import Workers, held, replicas

if TYPE_CHECKING:
    from collections.abc import Callable


async def until(condition: Callable[[], bool]) -> None:
    """Poll every millisecond: what is measured is when the condition turns true."""
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.001)


async def measure(url: str, rounds: int) -> dict[str, list[float]]:
    settings = SharedSettings(redis_url=url)
    drains: list[float] = []
    loads: list[float] = []
    async with replicas(2, Workers(rounds + 1), settings, RedisFleetStore(settings)) as (a, b):
        assert b.fleet is not None
        await b.fleet.wait_exchanges(2)
        for n in range(rounds):
            worker = f"pd-{n + 1:d}"
            member = b.pools["pd"].get(worker)
            assert member is not None
            start = trio.current_time()
            a.drain_worker(worker)
            await until(lambda member=member: member.drained)
            drains.append(trio.current_time() - start)
            async with held(a, f"load-{n}"):
                start = trio.current_time()
                await until(lambda: bool(b.fleet and b.fleet.status().remote_in_flight))
                loads.append(trio.current_time() - start)
            await until(lambda: not (b.fleet and b.fleet.status().remote_in_flight))
    return {"admin drain reaches B": drains, "A's load seen by B": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(Path(workdir))
        server.start()
        try:
            results = trio.run(measure, server.url, args.rounds)
        finally:
            server.stop()
    for name, samples in results.items():
        ms = [s * 1000 for s in samples]
        median, worst = statistics.median(ms), max(ms)
        print(f"{name}: median {median:.0f} ms, max {worst:.0f} ms ({len(ms)} rounds)")


if __name__ == "__main__":
    main()
