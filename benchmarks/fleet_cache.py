"""Prefix-cache hits a routing policy creates on a fleet: round_robin, cache_aware, kv_aware.

    python benchmarks/fleet_cache.py [--users 64] [--turns 6] [--concurrency 16] [--json out.json]

One in-process fleet per policy -- 4 simulated P workers with prefix caches of
``--cache-blocks`` blocks each and 4 D workers -- behind a real router
(``open_router``): the P pool routes with the policy under test, with
``kv_events`` on and every P engine publishing its cache's KV events in memory
(:class:`~epd_actors.simulator.kv_memory.MemoryKVEventPublisher`), so
``kv_aware`` reads the router's real subscriber, decoder and index.

The trace: ``--systems`` long system prompts, ``--users`` users each holding
one conversation on one of them, growing by a user turn and an assistant
answer per turn; each round sends every user's next turn, in a shuffled order
(seeded), ``--concurrency`` requests in flight at a time.  The P pool holds
at most ``--slots`` calls per worker, so a policy that piles calls onto one
worker queues them.

Time is virtual (Trio's ``MockClock`` with autojump): the simulator's
latencies (50 us per uncached prompt token, 2 ms to the first token) are
model time, so TTFT shows what the cache hits save and what queueing costs,
not this machine's speed, and every run gives the same numbers.

Reported per policy: the prefix-cache hit rate from the engines' own
counters (hit tokens / prompt tokens, P and, with ``+local``, D), TTFT p50 /
p99, balance (the busiest P worker's prefill calls over the mean), the P calls
made, and the requests the decoders prefilled themselves.

``kv_aware+local`` adds conditional disaggregation: the decoders prefill
locally (the simulator's ``local_prefill``, with prefix caches that keep the
blocks they received), the D pool routes with ``kv_aware`` on its own KV
events, and the P pool has ``local_prefill_below_tokens = --local-below``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import trio
import trio.testing

from epd_actors import GenerationRequest, Prompt, SamplingParams, open_router
from epd_actors.core.config import PoolConfig, RouterConfig, WorkerEndpoint
from epd_actors.core.kv_settings import KVEventsSettings
from epd_actors.request import DeltaEvent, DoneEvent
from epd_actors.simulator.kv_memory import MemoryKVEventPublisher
from epd_actors.testing import build_sim_fleet, sim_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from epd_actors.core.kv_feeds import KVSourceSpec

POLICIES = ("round_robin", "cache_aware", "kv_aware", "kv_aware+local")
"""The P pool's policy; ``+local``: and conditional disaggregation (``--local-below``)."""


@dataclass(frozen=True)
class Trace:
    systems: int
    system_words: int
    users: int
    turns: int
    user_words: int
    answer_words: int
    seed: int

    def rounds(self) -> list[list[tuple[int, str]]]:
        """Per round, the (user, prompt) pairs in the order they are sent."""
        rng = random.Random(self.seed)
        systems = [
            " ".join(f"sys{s}w{i}" for i in range(self.system_words)) for s in range(self.systems)
        ]
        history = [systems[u % self.systems] for u in range(self.users)]
        out = []
        for turn in range(self.turns):
            order = list(range(self.users))
            rng.shuffle(order)
            batch = []
            for u in order:
                question = " ".join(f"u{u}t{turn}q{i}" for i in range(self.user_words))
                history[u] = f"{history[u]} {question}"
                batch.append((u, history[u]))
                answer = " ".join(f"u{u}t{turn}a{i}" for i in range(self.answer_words))
                history[u] = f"{history[u]} {answer}"
            out.append(batch)
        return out


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace's options (:class:`Trace`), shared with ``fleet_cache_live.py``."""
    parser.add_argument("--systems", type=int, default=4, help="system prompts")
    parser.add_argument("--system-words", type=int, default=1024)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-words", type=int, default=48)
    parser.add_argument("--answer-words", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the arguments and results here")


def trace_of(args: argparse.Namespace) -> Trace:
    """The :class:`Trace` that :func:`add_trace_arguments`' options describe."""
    return Trace(
        args.systems,
        args.system_words,
        args.users,
        args.turns,
        args.user_words,
        args.answer_words,
        args.seed,
    )


def write_results(args: argparse.Namespace, results: Sequence[object]) -> None:
    """``--json``: the arguments and the results (dataclasses), when the option is given."""
    if args.json:
        rows = [asdict(r) for r in results]  # type: ignore[call-overload]
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "results": rows}, out, indent=2)


@dataclass(frozen=True)
class Result:
    policy: str
    requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    imbalance: float
    prefill_calls: dict[str, int]
    decisions: dict[str, int]
    local_prefills: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_policy(name: str, trace: Trace, args: argparse.Namespace) -> Result:
    policy, _, variant = name.partition("+")
    local = variant == "local"
    cached = sim_config(prefix_cache_blocks=args.cache_blocks, output_token_s=0.0)
    decoders = sim_config(
        prefix_cache_blocks=args.cache_blocks, output_token_s=0.0, local_prefill=local
    )
    fleet = build_sim_fleet(
        {"prefill": 4, "decode": 4}, configs={"prefill": cached, "decode": decoders}
    )
    publishers: dict[str, MemoryKVEventPublisher] = {}
    for worker_id, engine in fleet.engines.items():
        if engine.prefix_cache is not None:
            publishers[worker_id] = MemoryKVEventPublisher()
            engine.prefix_cache.sink = publishers[worker_id]

    def sources(spec: KVSourceSpec) -> contextlib.AbstractContextManager[MemoryKVEventPublisher]:
        return contextlib.nullcontext(publishers[spec.worker_id])

    def endpoints(stage: str) -> tuple[WorkerEndpoint, ...]:
        members = fleet.pools[stage].members
        return tuple(WorkerEndpoint(m.worker_id, "tcp://127.0.0.1:1") for m in members)

    options = {"tokenizer": "sim"} if policy == "kv_aware" else {}
    kv_on = KVEventsSettings(enabled=True, port=5557)
    decode = (
        PoolConfig("decode", endpoints("decode"), policy="kv_aware", kv_events=kv_on)
        if local
        else PoolConfig("decode", endpoints("decode"), policy="least_in_flight")
    )
    config = RouterConfig(
        (
            PoolConfig(
                "prefill",
                endpoints("prefill"),
                policy=policy,
                policy_options=options,
                max_in_flight_per_worker=args.slots,
                kv_events=kv_on,
                local_prefill_below_tokens=args.local_below if local else 0,
            ),
            decode,
        )
    )
    ttfts: list[float] = []
    async with open_router(
        config, backend_factory=fleet.backend_factory, kv_source_factory=sources
    ) as router:
        limiter = trio.CapacityLimiter(args.concurrency)

        async def one(n: int, prompt: str) -> None:
            async with limiter:
                request = GenerationRequest(
                    Prompt(text=prompt),
                    sampling=SamplingParams(max_tokens=4),
                    request_id=f"{name}-{n}",
                )
                start = trio.current_time()
                first = None
                async with router.generate(request) as events:
                    async for event in events:
                        if first is None and isinstance(event, DeltaEvent):
                            first = trio.current_time() - start
                        last = event
                if not isinstance(last, DoneEvent) or first is None:
                    raise RuntimeError(f"request {n} failed: {last!r}")
                ttfts.append(first)

        policy_of_p = router.pools["prefill"].policy
        rule = getattr(router.supervisor.actors["prefill"], "local_prefill", None)
        n = 0
        for batch in trace.rounds():
            async with trio.open_nursery() as nursery:
                for _, prompt in batch:
                    nursery.start_soon(one, n, prompt)
                    n += 1
    counters = fleet.counters("prefill")
    caches = [e.prefix_cache.counters() for e in fleet.engines.values() if e.prefix_cache]

    hit = sum(c.hit_tokens for c in caches)
    total = sum(c.query_tokens for c in caches)
    calls = {w: c.prefill_requests for w, c in counters.items()}
    mean = statistics.fmean(calls.values())
    return Result(
        name,
        n,
        hit / total if total else 0.0,
        percentile(ttfts, 0.5) * 1e3,
        percentile(ttfts, 0.99) * 1e3,
        max(calls.values()) / mean if mean else 0.0,
        calls,
        asdict(stats) if (stats := getattr(policy_of_p, "stats", None)) else {},
        rule.local if rule is not None else 0,
    )


def _seed_trio_scheduler(seed: int) -> None:
    """Trio shuffles its run queue with a module-level Random; seeding it makes a run repeatable.

    (A private attribute: a benchmark may lean on it, the package does not.)
    """
    from trio._core import _run

    rng = getattr(_run, "_r", None)
    if rng is not None:
        rng.seed(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_arguments(parser)
    parser.add_argument("--slots", type=int, default=4, help="P calls per worker at once")
    parser.add_argument("--cache-blocks", type=int, default=512, help="blocks per P cache")
    parser.add_argument(
        "--local-below",
        type=int,
        default=256,
        help="+local: skip P below this many tokens the best decoder lacks",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    trace = trace_of(args)
    results = []
    for policy in args.policies.split(","):
        _seed_trio_scheduler(args.seed)
        clock = trio.testing.MockClock(autojump_threshold=0)
        results.append(trio.run(run_policy, policy, trace, args, clock=clock))
    print(
        f"{'policy':<15} {'requests':>8} {'hit rate':>9} {'TTFT p50':>9} {'p99':>8} "
        f"{'max/mean':>9} {'P calls':>8} {'local':>6}"
    )
    for r in results:
        print(
            f"{r.policy:<15} {r.requests:>8} {r.hit_rate:>9.1%} {r.ttft_p50_ms:>7.1f}ms "
            f"{r.ttft_p99_ms:>6.1f}ms {r.imbalance:>9.2f} {sum(r.prefill_calls.values()):>8} "
            f"{r.local_prefills:>6}  {r.decisions or ''}"
        )
    write_results(args, results)


if __name__ == "__main__":
    main()
