"""The load generator: its summary math, its SSE scanning, and smoke runs against a router.

Benchmarks are not tests: these only check that ``python -m epd_actors bench``
and one benchmark scenario work on a tiny load (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import signal
import struct
import subprocess
import sys
import zlib
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from epd_actors.bench import (
    Distribution,
    LoadSpec,
    RequestRecord,
    Target,
    Workload,
    format_summary,
    percentile,
    run_load,
    summarize,
    synthetic_png,
)
from epd_actors.bench.cli import exit_status
from epd_actors.bench.client import _StreamScan
from epd_actors.bench.payload import BodyMaker, build_body
from epd_actors.bench.stats import parse_percentiles, parse_slos, parse_timings
from epd_actors.core.router import open_router
from epd_actors.frontends.http import HttpSettings, RouterHttpApp, serve_http
from epd_actors.simulator.engine import SimConfig
from epd_actors.testing import build_sim_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ROOT = Path(__file__).resolve().parents[2]
KEY = "bench-key"


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_distribution_of_nothing_is_nan() -> None:
    empty = Distribution.of([])
    assert empty.count == 0
    assert math.isnan(empty.p50)
    full = Distribution.of([0.1, 0.2, 0.3])
    assert full.mean == pytest.approx(0.2)
    assert full.max == 0.3


def _record(start: float, ttft: float, e2e: float, tokens: int, **kw: object) -> RequestRecord:
    record = RequestRecord(start=start, ttft=ttft, e2e=e2e, output_tokens=tokens)
    for key, value in kw.items():
        setattr(record, key, value)
    return record


def test_summarize_counts_rates_errors_and_tpot() -> None:
    records = [
        _record(0.0, 0.01, 0.11, 11, gaps=[0.05, 0.05]),
        _record(0.5, 0.03, 0.23, 21, gaps=[0.1]),
        _record(1.0, 0.0, 0.2, 0, error="HTTP 503: busy"),
        _record(1.0, 0.0, 0.2, 0, error="HTTP 503: busy"),
    ]
    summary = summarize(records, duration_s=2.0, client_cpu_s=0.5)
    assert summary.requests == 4
    assert summary.completed == 2
    assert summary.errors == {"HTTP 503: busy": 2}
    assert summary.request_rate == pytest.approx(1.0)
    assert summary.output_tokens == 32
    assert summary.output_token_rate == pytest.approx(16.0)
    assert summary.ttft.p50 == pytest.approx(0.02)
    assert summary.itl.count == 3
    assert summary.tpot.mean == pytest.approx(0.01)  # (0.1 / 10 + 0.2 / 20) / 2
    assert summary.client_cpu_util == pytest.approx(0.25)
    document = json.loads(json.dumps(summary.to_json()))
    assert document["ttft"]["count"] == 2
    text = format_summary(summary, title="t")
    assert "TTFT" in text
    assert "error x2: HTTP 503: busy" in text


def test_summary_of_only_failures_is_json_without_nan() -> None:
    summary = summarize([_record(0.0, 0.0, 0.1, 0, error="x")], duration_s=0.1, client_cpu_s=0.0)
    document = summary.to_json()
    assert document["ttft"] == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
        "quantiles": {"p50": None, "p90": None, "p99": None},
    }
    json.dumps(document, allow_nan=False)
    assert "-" in format_summary(summary)


def test_stream_scan_handles_events_split_across_reads() -> None:
    record = RequestRecord(start=0.0)
    scan = _StreamScan(record, t0=0.0)
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    text = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}\n\n'
    stream = role + text + text + usage + b"data: [DONE]\n\n"
    for index, cut in enumerate(range(0, len(stream), 17)):
        scan.feed(stream[cut : cut + 17], now=float(index))
    assert scan.done
    assert scan.error is None
    assert scan.events == 5
    assert scan.text_events == 2
    assert record.output_tokens == 7
    assert record.ttft is not None
    assert len(record.gaps) == 1


def test_stream_scan_sees_error_events() -> None:
    record = RequestRecord(start=0.0)
    scan = _StreamScan(record, t0=0.0)
    scan.feed(b'event: error\ndata: {"error":{"message":"boom"}}\n\n', now=1.0)
    assert scan.error is not None
    assert "boom" in scan.error


def test_synthetic_png_is_a_valid_png_of_about_the_size() -> None:
    png = synthetic_png(30_000, seed=1)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert 25_000 < len(png) < 35_000
    length = struct.unpack(">I", png[33:37])[0]
    assert png[37:41] == b"IDAT"
    width, height = struct.unpack(">II", png[16:24])
    raw = zlib.decompress(png[41 : 41 + length])
    assert len(raw) == height * (1 + width * 3)
    assert synthetic_png(1000, seed=1) != synthetic_png(1000, seed=2)


def test_bodies_and_targets() -> None:
    workload = Workload(images=2, image_bytes=500, mm_fraction=0.5, max_tokens=9)
    body = json.loads(build_body(workload, 3, with_images=True))
    assert body["max_tokens"] == 9
    assert body["stream_options"] == {"include_usage": True}
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]
    maker = BodyMaker(workload, seed=0)
    kinds = [isinstance(json.loads(maker.next_body())["messages"][0]["content"], list)]
    kinds += [
        isinstance(json.loads(maker.next_body())["messages"][0]["content"], list)
        for _ in range(199)
    ]
    assert 60 < sum(kinds) < 140
    target = Target.from_url("http://127.0.0.1:9/v1/", "/v1/completions", api_key="k")
    assert (target.host, target.port, target.path) == ("127.0.0.1", 9, "/v1/completions")
    assert target.url == "http://127.0.0.1:9/v1/completions"  # the title's, not /v1/v1/...
    assert ("Authorization", "Bearer k") in target.headers()
    with pytest.raises(ValueError, match="http"):
        Target.from_url("https://x", "/v1/completions")


@asynccontextmanager
async def served_router() -> AsyncIterator[str]:
    config = SimConfig(output_token_s=0.0, tokens_per_delta=4, first_token_s=0.0)
    fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1}, config=config)
    async with (
        open_router(fleet.router_config(), backend_factory=fleet.backend_factory) as router,
        trio.open_nursery() as nursery,
    ):
        await router.wait_ready()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        serve = functools.partial(serve_http, settings=HttpSettings(api_keys=(KEY,)))
        await nursery.start(serve, RouterHttpApp(router), listeners)
        port = listeners[0].socket.getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            nursery.cancel_scope.cancel(reason="test finished")


async def test_bench_command_against_an_in_process_router(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    async with served_router() as url:
        argv = [sys.executable, "-m", "epd_actors", "bench", "--url", url, "--api-key", KEY]
        argv += ["--concurrency", "3", "--requests", "10", "--max-tokens", "12"]
        argv += ["--images", "1", "--image-bytes", "2000", "--mm-fraction", "0.5"]
        argv += ["--json", str(out), "--records", "--no-progress"]
        with trio.fail_after(30):
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True)
    assert done.returncode == 0, done.stderr.decode()
    assert b"requests 10/10 ok" in done.stdout
    document = json.loads(out.read_text())
    assert document["summary"]["completed"] == 10
    assert document["summary"]["output_tokens"] == 120
    assert document["summary"]["ttft"]["p50"] > 0
    assert len(document["records"]) == 10
    assert all(r["status"] == 200 and r["output_tokens"] == 12 for r in document["records"])


async def test_open_loop_and_non_streaming_in_process() -> None:
    async with served_router() as url:
        target = Target.from_url(url, "/v1/completions", api_key=KEY)
        workload = Workload(endpoint="completions", max_tokens=5, stream=False)
        load = LoadSpec(rate=200.0, requests=12, warmup=2)
        with trio.fail_after(20):
            result = await run_load(target, workload, load)
        wrong = Target.from_url(url, "/v1/chat/completions", api_key="nope")
        with trio.fail_after(20):
            refused = await run_load(wrong, Workload(), LoadSpec(concurrency=2, requests=2))
    assert result.summary.completed == 12
    assert result.summary.output_tokens == 60
    assert refused.summary.completed == 0
    assert all(error.startswith("HTTP 401") for error in refused.summary.errors)


def benchmark_module(name: str) -> Any:
    """A module of ``benchmarks/`` (scripts beside each other, not a package), imported."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


@pytest.mark.processes
def smoke_run(tmp_path: Path, scenario: str, *extra: str, timeout: float = 90) -> dict[str, Any]:
    """``run_router_overhead.py`` on a tiny load of ``scenario`` (2 streams, 10 requests)."""
    script = ROOT / "benchmarks" / "run_router_overhead.py"
    argv = [sys.executable, str(script), "--name", "smoke", "--out-dir", str(tmp_path)]
    argv += ["--scenarios", scenario, "--concurrency", "2", "--rounds", "1", *extra]
    argv += ["--requests", "10", "--requests-per-client", "1", "--warmup", "2", "--no-plots"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads((tmp_path / "smoke.json").read_text())
    return document


@pytest.mark.parametrize(
    ("paced", "simulator"),
    [
        ((), "--sim-output-token-s 0 --sim-tokens-per-delta 16"),
        (("--token-s", "0.001"), "--sim-output-token-s 0.001 --sim-tokens-per-delta 1"),
    ],
)
def test_one_benchmark_scenario_on_a_tiny_load(
    tmp_path: Path, paced: tuple[str, ...], simulator: str
) -> None:
    document = smoke_run(tmp_path, "native-pd", *paced, timeout=60)
    assert document["settings"]["simulator"] == simulator
    (row,) = document["medians"]
    assert row["scenario"] == "native-pd"
    assert row["errors"] == 0
    assert row["router_cpu_ms_per_req"] > 0


@pytest.mark.processes
def test_the_http_pd_scenario_hands_p_kv_params_to_d(tmp_path: Path) -> None:
    # The same checkout as its own baseline: the A/B machinery, not a comparison.
    baseline = ("--baseline", str(ROOT), "--baseline-scenarios", "http-pd")
    document = smoke_run(tmp_path, "http-pd", *baseline)
    rows = {row["scenario"]: row for row in document["medians"]}
    assert sorted(rows) == ["http-pd", "http-pd@base"]
    for row in rows.values():
        assert row["errors"] == 0
        assert row["handoffs"] == {"requests": 10, "with_handle": 10, "ok": 10}


@pytest.mark.processes
def test_a_processes_variant_counts_every_router_process(tmp_path: Path) -> None:
    variant = ("--processes-scenarios", "native-pd", "--router-processes", "2")
    document = smoke_run(tmp_path, "native-pd", *variant)
    rows = {row["scenario"]: row for row in document["medians"]}
    assert sorted(rows) == ["native-pd", "native-pd@2proc"]
    assert "serve --processes 2" in document["settings"]["scenarios"]["native-pd@2proc"]
    for row in rows.values():
        assert row["errors"] == 0
        split = row["router_user_ms_per_req"] + row["router_system_ms_per_req"]
        assert split == pytest.approx(row["router_cpu_ms_per_req"])


@pytest.mark.processes
def test_a_process_tree_s_cpu_includes_its_descendants() -> None:
    harness = benchmark_module("harness")
    cpu_times, tree_cpu_times = harness.cpu_times, harness.tree_cpu_times
    burn = (
        "import sys, time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('burnt', flush=True); time.sleep(30)"
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    argv = [sys.executable, "-c", parent]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True) as tree:
        try:
            assert tree.stdout is not None
            assert tree.stdout.readline() == "burnt\n"  # the grandchild's CPU is spent
            assert sum(cpu_times(tree.pid)) < 0.25
            assert sum(tree_cpu_times(tree.pid)) >= 0.3
        finally:
            os.killpg(tree.pid, signal.SIGKILL)  # the grandchild too


def test_vllm_router_gets_p_and_d_in_its_pd_mode() -> None:
    vllm_router_argv = benchmark_module("harness").vllm_router_argv
    endpoints = [("prefill", "p-0", "http://127.0.0.1:1"), ("decode", "d-0", "http://127.0.0.1:2")]
    argv = vllm_router_argv("vllm-router", 9000, 9001, endpoints, pd=True)
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:1"
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:2"
    assert "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--worker-startup-check-interval") + 1] == "1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    plain = vllm_router_argv("vllm-router", 9000, 9001, endpoints, pd=False)
    assert "--vllm-pd-disaggregation" not in plain
    assert plain[plain.index("--worker-urls") + 1 :][:2] == [url for _, _, url in endpoints]


def test_the_per_token_cost_benchmark_times_every_step() -> None:
    script = ROOT / "benchmarks" / "per_token_cost.py"
    argv = [sys.executable, str(script), "--number", "64", "--repeat", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 16
    timed = [line for line in lines if " µs" in line]
    assert len(timed) == 12  # every timed step; the four call counts are lines of their own
    records = [line for line in timed if line.startswith("record ")]
    assert len(records) == 2
    assert all("(frozen dataclass" in line for line in records)
    for line in timed:
        micros = float(line.split(" µs")[0].split()[-1])
        assert micros > 0, line
    assert "(74-byte frame)" in lines[0]
    assert any("Python calls" in line for line in lines)
    assert any("(one event per read, relay)" in line for line in timed)
    assert any("(one event per read, at once)" in line for line in timed)


# ---------------------------------------------------------------- operator options


def test_input_and_total_token_throughput() -> None:
    records = [_record(0.0, 0.01, 0.11, 10), _record(0.0, 0.01, 0.11, 6)]
    records[0].input_tokens, records[1].input_tokens = 30, 14
    summary = summarize(records, duration_s=2.0, client_cpu_s=0.0)
    assert summary.input_tokens == 44
    assert summary.input_token_rate == pytest.approx(22.0)
    assert summary.total_token_rate == pytest.approx(30.0)  # (44 + 16) / 2
    assert "input 22 tokens/s (44 tokens), total 30 tokens/s" in format_summary(summary)


def test_goodput_counts_requests_that_meet_every_objective() -> None:
    fast = _record(0.0, 0.05, 0.15, 11, gaps=[0.01])  # tpot 10 ms
    slow_first = _record(0.0, 0.3, 0.4, 11, gaps=[0.01])  # ttft 300 ms
    slow_tokens = _record(0.0, 0.05, 1.05, 11, gaps=[0.1])  # tpot 100 ms
    failed = _record(0.0, 0.01, 0.02, 0, error="HTTP 503: busy")
    slos = parse_slos(["ttft:200", "tpot:50"])
    assert slos == {"ttft": pytest.approx(0.2), "tpot": pytest.approx(0.05)}
    records = [fast, slow_first, slow_tokens, failed]
    summary = summarize(records, duration_s=2.0, client_cpu_s=0.0, slos=slos)
    assert summary.good == 1
    assert summary.goodput == pytest.approx(0.5)
    assert "goodput 0.5 req/s (1/4 requests, 25%, met ttft<=200ms tpot<=50ms)" in format_summary(
        summary
    )
    only_e2e = summarize(records, duration_s=2.0, client_cpu_s=0.0, slos=parse_slos(["e2e:500"]))
    assert only_e2e.good == 2
    assert math.isnan(summarize(records, duration_s=2.0, client_cpu_s=0.0).goodput)


@pytest.mark.parametrize("item", ["ttft", "ttft:", "ttft:-1", "ttft:nan", "itl:5", "ttft:x"])
def test_bad_objectives(item: str) -> None:
    with pytest.raises(ValueError, match="--goodput"):
        parse_slos([item])


def test_chosen_percentiles() -> None:
    assert parse_percentiles("50, 99.9") == (50.0, 99.9)
    for bad in ("", "101", "x,1"):
        with pytest.raises(ValueError, match="--percentiles"):
            parse_percentiles(bad)
    records = [_record(0.0, t / 1000, 0.2, 2) for t in range(1, 101)]
    summary = summarize(records, duration_s=1.0, client_cpu_s=0.0, percentiles=(50.0, 99.9))
    assert set(summary.ttft.quantiles) == {"p50", "p99.9"}
    assert summary.ttft.quantiles["p99.9"] == pytest.approx(
        percentile([r.ttft or 0 for r in records], 99.9)
    )
    assert summary.ttft.p99 == pytest.approx(0.09901)  # the fixed three stay
    header = format_summary(summary).splitlines()[3]
    assert header.split() == ["latency", "(ms)", "mean", "p50", "p99.9", "max"]


def test_stage_breakdown_from_the_timings() -> None:
    assert parse_timings(
        "encode=10.5;prefill=3;decode=40;queue=0.5;ttft=14;worker.decode=d0;x="
    ) == {
        "encode": pytest.approx(0.0105),
        "prefill": pytest.approx(0.003),
        "decode": pytest.approx(0.04),
        "queue": pytest.approx(0.0005),
        "ttft": pytest.approx(0.014),
    }
    records = [_record(0.0, 0.01, 0.1, 2), _record(0.0, 0.01, 0.1, 2), _record(0.0, 0.01, 0.1, 2)]
    records[0].stages = {"prefill": 0.002, "decode": 0.05}
    records[1].stages = {"prefill": 0.004}
    summary = summarize(records, duration_s=1.0, client_cpu_s=0.0)
    assert summary.stages["prefill"].count == 2
    assert summary.stages["prefill"].mean == pytest.approx(0.003)
    assert summary.stages["decode"].count == 1
    assert "stage prefill" in format_summary(summary)
    assert json.loads(json.dumps(summary.to_json()))["stages"]["decode"]["count"] == 1


def test_stream_scan_reads_the_timings_comment_and_the_prompt_tokens() -> None:
    record = RequestRecord(start=0.0)
    scan = _StreamScan(record, t0=0.0)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    scan.feed(usage + b": timings prefill=2.0;decode=8.0;worker.decode=d0\n\ndata: [DONE]\n\n", 1.0)
    assert scan.done
    assert (record.input_tokens, record.output_tokens) == (3, 1)
    assert record.stages == {"prefill": pytest.approx(0.002), "decode": pytest.approx(0.008)}


def test_the_exit_status_by_failure_ratio() -> None:
    ok, failed = _record(0.0, 0.01, 0.1, 2), _record(0.0, 0.0, 0.1, 0, error="HTTP 500: x")
    quarter = summarize([ok, ok, ok, failed], duration_s=1.0, client_cpu_s=0.0)
    assert quarter.failure_ratio == pytest.approx(0.25)
    assert exit_status(quarter, None) == 0
    assert exit_status(quarter, 0.25) == 0
    assert exit_status(quarter, 0.2) == 1
    none_ok = summarize([failed], duration_s=1.0, client_cpu_s=0.0)
    assert exit_status(none_ok, 1.0) == 1


async def test_the_options_against_an_in_process_router(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    async with served_router() as url:
        argv = [sys.executable, "-m", "epd_actors", "bench", "--url", url, "--api-key", KEY]
        argv += ["--concurrency", "2", "--requests", "6", "--max-tokens", "4", "--no-progress"]
        argv += ["--goodput", "ttft:60000", "e2e:60000", "--percentiles", "50,99.9"]
        argv += ["--max-failure-ratio", "0", "--json", str(out)]
        with trio.fail_after(30):
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True)
            summary = json.loads(out.read_text())["summary"]
            wrong = [*argv[:7], "nope", *argv[8:]]  # the API key
            refused = await trio.run_process(
                wrong, capture_stdout=True, capture_stderr=True, check=False
            )
    assert done.returncode == 0, done.stderr.decode()
    assert summary["good"] == 6
    assert summary["input_tokens"] > 0
    assert set(summary["ttft"]["quantiles"]) == {"p50", "p99.9"}
    assert {"prefill", "decode", "ttft"} <= set(summary["stages"])
    assert b"stage decode" in done.stdout
    assert refused.returncode == 1  # every request refused (401)


def test_the_live_fleet_benchmark_configures_each_policy_it_compares() -> None:
    import tomllib

    from epd_actors.program.config_file import parse_config

    live = benchmark_module("fleet_cache_live")
    Fleet, router_config = live.Fleet, live.router_config
    vllm_router_argv = benchmark_module("harness").vllm_router_argv
    workers = [("prefill", "prefill-0", "http://127.0.0.1:1")]
    workers += [("decode", "decode-0", "http://127.0.0.1:2")]
    fleet = Fleet(workers, {"prefill-0": ("tcp://127.0.0.1:3", "tcp://127.0.0.1:4")})
    for policy in ("round_robin", "cache_aware", "kv_aware"):
        text = router_config(fleet, policy)
        config = parse_config(tomllib.loads(text), environ={"EPD_AUTH_TOKEN": "t"}).router
        pools = {pool.stage: pool for pool in config.pools}
        assert (pools["prefill"].policy, pools["decode"].policy) == (policy, "least_in_flight")
        assert pools["prefill"].kv_events.enabled == (policy == "kv_aware")
    (prefill,) = pools["prefill"].workers
    assert prefill.kv_events_endpoint == "tcp://127.0.0.1:3"
    argv = vllm_router_argv("vllm-router", 1, 2, workers, pd=True, policy="cache_aware")
    assert argv[argv.index("--policy") + 1] == "cache_aware"


def test_paired_ratios_divide_within_each_round() -> None:
    overhead = benchmark_module("run_router_overhead")
    paired_lines, paired_ratios = overhead.paired_lines, overhead.paired_ratios
    cpu = {  # (scenario, round) -> router CPU ms per request
        ("http-pd", 0): 9.0,
        ("http-pd@base", 0): 10.0,
        ("http-pd", 1): 12.0,
        ("http-pd@base", 1): 10.0,
        ("http-pd", 2): 11.0,
        ("http-pd@base", 2): 12.0,
        ("vllm-router-pd", 0): 4.5,
        ("vllm-router-pd", 1): 6.0,
        ("direct", 0): None,
    }
    rows = [
        {"scenario": name, "concurrency": 256, "round": index, "router_cpu_ms_per_req": value}
        for (name, index), value in cpu.items()
    ]
    pairs = {(p["scenario"], p["reference"]): p for p in paired_ratios(rows)}
    assert sorted(pairs) == [
        ("http-pd", "http-pd@base"),
        ("http-pd", "vllm-router-pd"),
        ("http-pd@base", "vllm-router-pd"),
    ]
    ab = pairs[("http-pd", "http-pd@base")]
    assert ab["rounds"] == 3
    # Each round's own ratio: 9/10, 12/10, 11/12; not a ratio of the medians.
    assert ab["median"] == pytest.approx(11 / 12)
    assert (ab["low"], ab["high"]) == (pytest.approx(0.9), pytest.approx(1.2))
    peer = pairs[("http-pd", "vllm-router-pd")]
    assert peer["rounds"] == 2  # vllm-router did not run in round 2
    assert peer["median"] == pytest.approx(2.0)
    (line,) = paired_lines([peer])
    assert line == "http-pd / vllm-router-pd  c=256  2.00 (2.00-2.00) over 2 rounds"
