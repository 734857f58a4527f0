"""Prefix-cache hits on a fleet of processes: this router's policies and vllm-router's, one trace.

    python benchmarks/fleet_cache_live.py --vllm-router "$(command -v vllm-router)" \\
        [--policies round_robin,cache_aware,kv_aware,vllm-router:cache_aware] [--json out.json]

The in-process :mod:`fleet_cache` compares this router's policies in virtual
time; this one runs the same trace (its :class:`~fleet_cache.Trace`: a few
long system prompts, many users, conversations that grow turn by turn)
against real processes on loopback, so a peer router can run it too:

* 4 simulated P and 4 simulated D workers serving vLLM's OpenAI HTTP API
  (``python -m epd_actors worker --serve-openai``), each P with a prefix cache
  of ``--cache-blocks`` blocks and prefill time proportional to the tokens
  it does not find cached (``--prefill-token-s`` per token); with
  ``kv_aware``, every P publishes its cache's KV events over ZMQ in vLLM's
  wire format;
* in front of them either this router (``python -m epd_actors serve``, the
  ``openai_http`` backend, the P pool's policy under test, the D pool on
  ``least_in_flight``) or vllm-router in its P/D mode
  (``--vllm-pd-disaggregation``) with ``--policy NAME`` for both pools
  (``vllm-router:cache_aware`` is its default).

Every system gets fresh workers (cold caches).  The client sends each round's
requests (``/v1/chat/completions``, one user message, streamed, ``--max-tokens``
tokens) with at most ``--concurrency`` in flight, and measures TTFT in real
time.  Reported per
system: the prefix-cache hit rate from the P workers' own counters
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` on
their ``/metrics``, as real vLLM exports them), TTFT p50 / p99, the busiest P
worker's requests over the mean, and the P requests each worker logged.

The simulated engines have no batch limit: a policy that piles requests onto
one P worker does not make them queue, so TTFT here shows what the cache
hits save, and the balance column shows the piling.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import trio
from fleet_cache import Trace, add_trace_arguments, percentile, trace_of, write_results
from harness import (
    ANNOUNCE,
    ROUTER_ANNOUNCE,
    Process,
    _env,
    free_port,
    router_argv,
    start_peer,
    vllm_router_argv,
    worker_argv,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

POLICIES = ("round_robin", "cache_aware", "kv_aware", "vllm-router:cache_aware")
"""This router's P-pool policies, and ``vllm-router:POLICY`` for the peer."""

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} (\S+)$", re.M)


@dataclass(frozen=True)
class Result:
    system: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    imbalance: float
    prefill_calls: dict[str, int]
    seconds: float


@dataclass
class Fleet:
    """The started workers: (role, worker id, URL) and each P worker's KV event endpoints."""

    workers: list[tuple[str, str, str]]
    kv_endpoints: dict[str, tuple[str, str]]


def sim_args(args: argparse.Namespace) -> list[str]:
    return [
        "--sim-prefill-token-s",
        str(args.prefill_token_s),
        "--sim-first-token-s",
        str(args.first_token_s),
        "--sim-output-token-s",
        "0",
        "--sim-prefix-cache-blocks",
        str(args.cache_blocks),
        "--sim-max-model-len",
        "32768",
    ]


def start_fleet(
    stack: ExitStack, store: str, args: argparse.Namespace, env: dict[str, str], *, kv: bool
) -> Fleet:
    fleet = Fleet([], {})
    for role in ("prefill", "decode"):
        for index in range(args.workers):
            worker_id = f"{role}-{index}"
            extra = sim_args(args)
            if kv and role == "prefill":
                pub = f"tcp://127.0.0.1:{free_port()}"
                replay = f"tcp://127.0.0.1:{free_port()}"
                extra += [
                    "--sim-kv-events-endpoint",
                    pub,
                    "--sim-kv-events-replay-endpoint",
                    replay,
                ]
                fleet.kv_endpoints[worker_id] = (pub, replay)
            argv = worker_argv(role, worker_id, store, cores=None, openai=True, extra=extra)
            process = Process(argv, env=env, pattern=ANNOUNCE)
            stack.callback(process.stop)
            fleet.workers.append((role, worker_id, process.announced))
    return fleet


def router_config(fleet: Fleet, policy: str) -> str:
    """This router over the fleet: the P pool on ``policy``, D on ``least_in_flight``."""
    lines = [
        f'model = "{MODEL}"',
        'auth_token_env = "EPD_AUTH_TOKEN"',
        "",
        "[server]",
        'http_listen = "127.0.0.1:0"',
        "",
    ]
    for role in ("prefill", "decode"):
        entries = []
        for worker_role, worker_id, url in fleet.workers:
            if worker_role != role:
                continue
            entry = f'{{ id = "{worker_id}", address = "{url}", backend = "openai_http"'
            if role == "prefill" and policy == "kv_aware":
                pub, replay = fleet.kv_endpoints[worker_id]
                entry += f', kv_events_endpoint = "{pub}", kv_events_replay_endpoint = "{replay}"'
            entries.append(entry + " }")
        chosen = policy if role == "prefill" else "least_in_flight"
        lines += [f"[pools.{role}]", f'policy = "{chosen}"']
        if role == "prefill" and policy == "kv_aware":
            lines += ["kv_events = true"]
        lines += [f"workers = [{', '.join(entries)}]", ""]
        if role == "prefill" and policy == "kv_aware":
            lines += ["[pools.prefill.policy_options]", 'tokenizer = "sim"', ""]
    return "\n".join(lines)


def start_system(
    stack: ExitStack,
    workdir: Path,
    fleet: Fleet,
    system: str,
    vllm_router: str | None,
    env: dict[str, str],
) -> str:
    """Start the router under test in front of ``fleet``; its base URL."""
    peer, _, peer_policy = system.partition(":")
    if peer == "vllm-router":
        if vllm_router is None:
            raise SystemExit(f"{system} needs --vllm-router PATH")
        port = free_port()
        argv = vllm_router_argv(
            vllm_router, port, free_port(), fleet.workers, pd=True, policy=peer_policy
        )
        return start_peer(stack, argv, port, env, name=system).announced
    config = workdir / f"{system}.toml"
    config.write_text(router_config(fleet, system), encoding="utf-8")
    router = Process(router_argv(config, cores=None), env=env, pattern=ROUTER_ANNOUNCE)
    stack.callback(router.stop)
    return router.announced


def scrape_hits(fleet: Fleet) -> tuple[float, float]:
    """(hit tokens, queried tokens), summed over the P workers' ``/metrics``."""
    hits = queries = 0.0
    for role, _, url in fleet.workers:
        if role != "prefill":
            continue
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        for name, value in _COUNTER.findall(text):
            if name == "hits":
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


def prefill_calls(fleet: Fleet) -> dict[str, int]:
    """The requests each P worker logged (``GET /debug/requests``)."""
    calls = {}
    for role, worker_id, url in fleet.workers:
        if role == "prefill":
            with urllib.request.urlopen(url + "/debug/requests", timeout=10) as response:
                calls[worker_id] = len(json.loads(response.read())["requests"])
    return calls


async def replay(url: str, trace: Trace, args: argparse.Namespace) -> tuple[list[float], int]:
    """Send the trace, round by round; (TTFT of each successful request, errors)."""
    ttfts: list[float] = []
    errors = 0
    limiter = trio.CapacityLimiter(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:

        async def one(prompt: str) -> None:
            nonlocal errors
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "stream": True,
            }
            async with limiter:
                start = time.perf_counter()
                first: float | None = None
                done = False
                try:
                    async with client.stream("POST", CHAT, json=body) as reply:
                        if reply.status_code != 200:
                            await reply.aread()
                            errors += 1
                            return
                        async for line in reply.aiter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif first is None and line.startswith("data: "):
                                choices = json.loads(line[6:]).get("choices") or [{}]
                                if (choices[0].get("delta") or {}).get("content"):
                                    first = time.perf_counter() - start
                except httpx.HTTPError:
                    errors += 1
                    return
                if first is None or not done:
                    errors += 1
                else:
                    ttfts.append(first)

        for batch in trace.rounds():
            async with trio.open_nursery() as nursery:
                for _, prompt in batch:
                    nursery.start_soon(one, prompt)
    return ttfts, errors


def run_system(system: str, trace: Trace, args: argparse.Namespace, workdir: Path) -> Result:
    with ExitStack() as stack:
        store = tempfile.mkdtemp(prefix="fleet-", dir=workdir)
        env = _env(secrets.token_urlsafe(16))  # the workers' and the router's
        fleet = start_fleet(stack, store, args, env, kv=system == "kv_aware")
        url = start_system(stack, workdir, fleet, system, args.vllm_router, env)
        time.sleep(args.settle_s)  # noqa: TID251 (a plain script: health probes, KV subscriptions)
        start = time.perf_counter()
        ttfts, errors = trio.run(replay, url, trace, args)
        seconds = time.perf_counter() - start
        hits, queries = scrape_hits(fleet)
        calls = prefill_calls(fleet)
    mean = statistics.fmean(calls.values()) if calls else 0.0
    return Result(
        system,
        len(ttfts) + errors,
        errors,
        hits / queries if queries else 0.0,
        percentile(ttfts, 0.5) * 1e3 if ttfts else float("nan"),
        percentile(ttfts, 0.99) * 1e3 if ttfts else float("nan"),
        max(calls.values()) / mean if mean else 0.0,
        calls,
        seconds,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_arguments(parser)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--vllm-router", default=None, help="path of the vllm-router program")
    parser.add_argument("--workers", type=int, default=4, help="P workers, and as many D")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--cache-blocks", type=int, default=256, help="blocks per P cache")
    parser.add_argument("--prefill-token-s", type=float, default=50e-6)
    parser.add_argument("--first-token-s", type=float, default=0.002)
    parser.add_argument("--settle-s", type=float, default=2.0)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    trace = trace_of(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="fleet-cache-live-") as tmp:
        for system in args.policies.split(","):
            result = run_system(system, trace, args, Path(tmp))
            results.append(result)
            print(f"{system}: done in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    print(
        f"{'system':<24} {'requests':>8} {'errors':>6} {'hit rate':>9} {'TTFT p50':>9} "
        f"{'p99':>8} {'max/mean':>9}  P requests per worker"
    )
    for r in results:
        print(
            f"{r.system:<24} {r.requests:>8} {r.errors:>6} {r.hit_rate:>9.1%} "
            f"{r.ttft_p50_ms:>7.1f}ms {r.ttft_p99_ms:>6.1f}ms {r.imbalance:>9.2f}  "
            f"{sorted(r.prefill_calls.values())}"
        )
    write_results(args, results)


if __name__ == "__main__":
    main()
