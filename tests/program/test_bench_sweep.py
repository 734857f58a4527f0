"""The load generator's sweeps, progress line and plots (`--sweep`, `--progress`, `--plot`)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import sys
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.bench import LoadSpec, RequestRecord, Target, Workload, run_load, summarize
from epd_actors.bench.cli import add_bench_arguments, run_bench
from epd_actors.bench.plot import PlotUnavailable, plot_sweep, require_pyplot
from epd_actors.bench.progress import PROGRESS_INTERVAL_S, ProgressLine, progress_stream
from epd_actors.bench.sweep import format_sweep_table, parse_sweep, single_point, sweep_points
from tests.program.test_bench import KEY, served_router

if TYPE_CHECKING:
    from pathlib import Path

    from epd_actors.bench import Summary
    from epd_actors.bench.sweep import SweepPoint


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def _summary(ttft: float, gap: float, n: int = 4) -> Summary:
    records = []
    for i in range(n):
        record = RequestRecord(start=float(i), ttft=ttft, e2e=ttft + 3 * gap, output_tokens=4)
        record.gaps = [gap, gap, gap]
        records.append(record)
    return summarize(records, duration_s=2.0, client_cpu_s=0.0)


# ---------------------------------------------------------------- sweeps


def test_a_sweep_is_a_knob_and_its_values() -> None:
    assert parse_sweep("concurrency=1, 4,16") == ("concurrency", (1.0, 4.0, 16.0))
    assert parse_sweep("rate=2.5,10") == ("rate", (2.5, 10.0))
    base = LoadSpec(requests=7, warmup=2)
    points = sweep_points(base, "concurrency=1,8")
    assert [(p.label, p.load.concurrency, p.load.rate) for p in points] == [
        ("concurrency=1", 1, None),
        ("concurrency=8", 8, None),
    ]
    assert all(p.load.requests == 7 and p.load.warmup == 2 for p in points)
    rates = sweep_points(base, "rate=5,20")
    assert [(p.label, p.load.rate) for p in rates] == [("rate=5", 5.0), ("rate=20", 20.0)]
    assert single_point(LoadSpec(concurrency=3)).label == "concurrency=3"
    assert single_point(LoadSpec(rate=9.0)).label == "rate=9"


@pytest.mark.parametrize(
    "text",
    [
        "concurrency",
        "threads=1,2",
        "concurrency=",
        "concurrency=0",
        "concurrency=1.5",
        "rate=-1",
        "rate=nan",
        "rate=inf",
        "concurrency=2,2",
    ],
)
def test_bad_sweeps(text: str) -> None:
    with pytest.raises(ValueError, match="--sweep"):
        parse_sweep(text)


def test_a_sweep_refuses_a_fixed_load_and_a_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    url = "http://127.0.0.1:9"
    assert run_bench(_args("--url", url, "--sweep", "concurrency=1,2", "--concurrency", "4")) == 2
    assert "drop --concurrency and --rate" in capsys.readouterr().err
    assert run_bench(_args("--url", url, "--sweep", "rate=1", "--rate", "4")) == 2
    assert run_bench(_args("--url", url, "--sweep", "rate=0")) == 2
    assert "a rate must be > 0" in capsys.readouterr().err


def test_the_sweep_table_has_a_row_per_point() -> None:
    points = sweep_points(LoadSpec(), "concurrency=1,16")
    rows = [(points[0], _summary(0.010, 0.002)), (points[1], _summary(0.040, 0.005))]
    lines = format_sweep_table(rows).splitlines()
    assert lines[0] == "sweep (latencies in ms)"
    assert lines[1].split() == [
        "point", "ok", "req/s", "tok/s",
        "TTFT", "p50", "TTFT", "p90", "TTFT", "p99",
        "ITL", "p50", "ITL", "p90", "ITL", "p99",
    ]  # fmt: skip
    assert len(lines) == 4
    assert lines[2].split()[:3] == ["concurrency=1", "4/4", "2.0"]
    assert lines[3].split()[4] == "40.00"  # TTFT p50 of the second point
    assert lines[3].split()[7] == "5.00"  # ITL p50
    objectives = summarize([], duration_s=1.0, client_cpu_s=0.0, slos={"ttft": 0.1})
    with_goodput = format_sweep_table([(points[0], objectives)]).splitlines()
    assert "goodput" in with_goodput[1]
    assert "-" in with_goodput[2].split()  # no samples: no latency
    assert format_sweep_table([]) == ""


async def test_a_rate_sweep_against_an_in_process_router() -> None:
    results = []
    async with served_router() as url:
        target = Target.from_url(url, "/v1/chat/completions", api_key=KEY)
        for point in sweep_points(LoadSpec(requests=6), "rate=100,400"):
            with trio.fail_after(20):
                result = await run_load(target, Workload(max_tokens=3), point.load)
            results.append((point, result.summary))
    assert [(p.label, s.completed) for p, s in results] == [("rate=100", 6), ("rate=400", 6)]
    assert len(format_sweep_table(results).splitlines()) == 4


async def test_the_sweep_command_writes_a_list_and_a_table(tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with_plot = importlib.util.find_spec("matplotlib") is not None
    async with served_router() as url:
        argv = [sys.executable, "-m", "epd_actors", "bench", "--url", url, "--api-key", KEY]
        argv += ["--sweep", "concurrency=1,3", "--requests", "6", "--max-tokens", "4"]
        argv += ["--percentiles", "50,99", "--max-failure-ratio", "0", "--json", str(out)]
        argv += ["--plot", str(png)] if with_plot else []
        with trio.fail_after(30):
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True)
    assert done.returncode == 0, done.stderr.decode()
    documents = json.loads(out.read_text())
    assert [d["load"]["concurrency"] for d in documents] == [1, 3]
    assert [d["mode"] for d in documents] == ["closed", "closed"]
    assert [d["point"] for d in documents] == [
        {"name": "concurrency", "value": 1.0},
        {"name": "concurrency", "value": 3.0},
    ]
    assert all(d["summary"]["completed"] == 6 for d in documents)
    stdout = done.stdout.decode()
    assert "\r" not in stdout  # a pipe: no progress line
    assert "== concurrency=1" in stdout
    assert "== concurrency=3" in stdout
    table = stdout[stdout.index("sweep (latencies in ms)") :].splitlines()
    assert table[1].split()[:6] == ["point", "ok", "req/s", "tok/s", "TTFT", "p50"]
    assert [row.split()[:2] for row in table[2:4]] == [
        ["concurrency=1", "6/6"],
        ["concurrency=3", "6/6"],
    ]
    if with_plot:  # else test_a_plot_is_a_png reports the skip
        assert png.read_bytes().startswith(b"\x89PNG")
        assert f"plot written to {png}" in stdout


# ---------------------------------------------------------------- progress line


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_only_on_a_terminal_unless_asked() -> None:
    tty, pipe = _Tty(), io.StringIO()
    assert progress_stream(None, tty) is tty
    assert progress_stream(None, pipe) is None
    assert progress_stream(False, tty) is None
    assert progress_stream(True, pipe) is pipe
    assert _args("--url", "http://x", "--no-progress").progress is False


async def test_the_progress_line_redraws_at_most_four_times_a_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tty = _Tty()
    meter = ProgressLine(tty, 10, "concurrency=4")
    meter.done, meter.failed, meter.in_flight = 3, 1, 2
    started = trio.current_time()
    with trio.move_on_after(1.1):
        await meter.run(started)
    lines = tty.getvalue().split("\r")[1:]
    assert PROGRESS_INTERVAL_S == 0.25
    assert len(lines) == 4  # at 0.25, 0.5, 0.75 and 1.0 s
    assert lines[-1].startswith("concurrency=4: 3/10 done, 1 failed, 2 in flight,   1.0 s,")
    assert lines[-1].rstrip().endswith("3.0 req/s")
    meter.clear()
    cleared = tty.getvalue().split("\r")
    assert cleared[-1] == ""
    assert cleared[-2].strip() == ""
    assert len(cleared[-2]) == max(len(line) for line in lines)


async def test_no_stream_no_line(autojump_clock: trio.testing.MockClock) -> None:
    meter = ProgressLine(None, None)
    with trio.fail_after(1):
        await meter.run(trio.current_time())  # returns at once
    meter.clear()
    tty = _Tty()
    ProgressLine(tty, None).clear()  # nothing drawn: nothing to blank
    assert tty.getvalue() == ""
    duration = ProgressLine(tty, None)
    duration.done = 5
    duration.draw(2.0)
    assert tty.getvalue() == "\r5 done, 0 failed, 0 in flight,   2.0 s,     2.5 req/s "


# ---------------------------------------------------------------- plots


def test_a_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when absent
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(PlotUnavailable, match=r"pip install 'epd_actors\[bench\]'"):
        require_pyplot()
    png = tmp_path / "p.png"
    # Nothing listens on port 9: the refusal comes before any request.
    assert run_bench(_args("--url", "http://127.0.0.1:9", "--plot", str(png))) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib, the optional 'bench' extra" in err
    assert not png.exists()


def _points(text: str) -> list[tuple[SweepPoint, Summary]]:
    points = sweep_points(LoadSpec(), text)
    return [(p, _summary(0.01 * (i + 1), 0.002 * (i + 1))) for i, p in enumerate(points)]


@pytest.mark.parametrize("sweep", ["concurrency=1,4,16", "rate=5,8"])
def test_a_plot_is_a_png(tmp_path: Path, sweep: str) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib (the bench extra) is not installed: PNG not checked"
    )
    png = tmp_path / "sweep.png"
    plot_sweep(str(png), _points(sweep), title="bench")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
    one = tmp_path / "one.png"
    plot_sweep(str(one), [(single_point(LoadSpec(concurrency=2)), _summary(0.01, 0.001))], title="")
    assert one.read_bytes().startswith(b"\x89PNG")
    empty = summarize([], duration_s=0.0, client_cpu_s=0.0)
    assert math.isnan(empty.request_rate)
    nan_png = tmp_path / "nan.png"
    plot_sweep(str(nan_png), [(single_point(LoadSpec()), empty)], title="all failed")
    assert nan_png.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_sweep(str(tmp_path / "none.png"), [], title="")
