"""The soak test's per-request judge (benchmarks/soak_checks.py) catches each broken invariant.

The soak run reports 0 violations only if its checker can see them: each test
here feeds a stream that breaks one invariant (or none) the way a faulty
router would write it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
checks = importlib.import_module("soak_checks")

REFERENCE = "alpha beta gamma delta"


def chunk(content: str | None = None, finish: str | None = None) -> list[str]:
    delta = {} if content is None else {"content": content}
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return [f"data: {json.dumps(body)}", ""]


def error(code: str) -> list[str]:
    body = {"error": {"message": "boom", "type": "upstream_error", "param": None, "code": code}}
    return ["event: error", f"data: {json.dumps(body)}", ""]


DONE = ["data: [DONE]", ""]
TIMINGS = [": timings queue=0.001", ""]


def judge(lines: list[str], reference: str = REFERENCE) -> tuple[str, list[str]]:
    check = checks.judge_stream(lines, reference)
    return check.outcome, check.violations


def test_a_complete_stream_of_the_simulators_text_is_ok() -> None:
    lines = [
        *chunk("alpha"),
        *chunk(" beta gamma"),
        *chunk(" delta"),
        *chunk(finish="length"),
        *TIMINGS,
        *DONE,
    ]
    assert judge(lines) == ("ok", [])


def test_an_error_after_some_text_is_a_typed_failure_not_a_violation() -> None:
    lines = [*chunk("alpha beta"), *TIMINGS, *error("WorkerDisconnected")]
    assert judge(lines) == ("stream:WorkerDisconnected", [])


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ([*chunk("alpha"), *error("engine_error"), *DONE], "[DONE] after an error event"),
        ([*chunk(REFERENCE), *chunk(finish="stop"), *DONE, *DONE], "after the terminal one"),
        ([*chunk("alpha"), *error("a"), *error("b")], "after the terminal one"),
        ([*chunk("alpha beta")], "without a terminal event"),
        ([*chunk("alpha"), *chunk("alpha beta"), *error("x")], "left the simulator's output"),
        ([*chunk("alpha beta"), *chunk(finish="length"), *DONE], "characters of the simulator's"),
        ([*chunk(REFERENCE), *DONE], "[DONE] without a finish_reason"),
        ([*chunk("alpha"), "data: {not json", "", *error("x")], "not a chat chunk"),
        (["event: error", "data: oops", ""], "without an OpenAI error body"),
    ],
    ids=[
        "done-after-error",
        "two-dones",
        "two-errors",
        "cut",
        "repeated-after-retry",
        "short-success",
        "no-finish-reason",
        "garbage-chunk",
        "garbage-error",
    ],
)
def test_each_broken_invariant_is_reported(lines: list[str], problem: str) -> None:
    _outcome, violations = judge(lines)
    assert len(violations) == 1
    assert problem in violations[0]


def test_a_cut_stream_is_its_own_outcome() -> None:
    assert judge(chunk("alpha"))[0] == "cut"


def test_a_refusal_before_the_stream_is_counted_by_status_and_code() -> None:
    body = {"error": {"message": "no", "type": "service_unavailable_error", "code": None}}
    assert checks.refused_outcome(503, body) == ("503:service_unavailable_error", [])
    kind, problems = checks.refused_outcome(502, "<html>bad gateway</html>")
    assert kind == "502:unreadable"
    assert problems == ["HTTP 502 without an OpenAI error body"]


def test_the_tally_adds_up_requests_faults_violations_and_samples() -> None:
    tally = checks.Tally()
    tally.record(checks.Outcome("ok"), "r1")
    tally.record(checks.Outcome("stream:x", image=True), "r2")
    tally.record(checks.Outcome("cut", ("the stream ended without a terminal event",)), "r3")
    tally.fault("kill_9")
    tally.violation("worker d0 still runs or queues 1 requests")
    for at, rss, fds in ((0.0, 100, 17), (1.0, 140, 25), (2.0, 120, 17)):
        tally.samples.append(checks.ProcessSample(at, rss, fds))
    summary = tally.summary()
    assert summary["requests"] == 3
    assert summary["successes"] == 1
    assert summary["image_requests"] == 1
    assert summary["failures"] == {"cut": 1, "stream:x": 1}
    assert summary["faults"] == {"kill_9": 1}
    assert summary["violations"] == 2
    assert summary["violation_examples"] == [
        "r3: the stream ended without a terminal event",
        "worker d0 still runs or queues 1 requests",
    ]
    assert summary["router_rss_kib"] == {
        "first": 100,
        "quarter": 100,
        "half": 140,
        "last": 120,
        "max": 140,
    }
    assert summary["router_fds"] == {"first": 17, "quarter": 17, "half": 25, "last": 17, "max": 25}
