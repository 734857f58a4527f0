"""The outage handling every discovery kind shares: backoff, one line per outage, the metrics."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry

from epd_actors.discovery.watch_loop import Backoff, SourceHealth, SourceMetrics, StartOnce

if TYPE_CHECKING:
    import pytest

LOGGER = logging.getLogger("epd_actors.discovery.test_kind")


def health(registry: CollectorRegistry, label: str = "decode") -> SourceHealth:
    metrics = SourceMetrics(registry, errors_help="Failed reads, by pool")
    return SourceHealth(label, metrics, source="the source", attempts="reads", logger=LOGGER)


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER.name]


def test_the_waits_double_up_to_the_maximum_and_start_over_after_a_success() -> None:
    backoff = Backoff(1.0, 8.0)
    assert [backoff.next_delay() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    backoff.reset()
    assert [backoff.next_delay() for _ in range(2)] == [1.0, 2.0]


def test_jittered_waits_are_drawn_from_the_upper_half_of_each_step() -> None:
    backoff = Backoff(0.5, 2.0, rng=random.Random(3))
    draws = random.Random(3)
    expected = [step * (0.5 + 0.5 * draws.random()) for step in (0.5, 1.0, 2.0, 2.0)]
    delays = [backoff.next_delay() for _ in range(4)]
    assert delays == expected
    assert all(step / 2 <= d <= step for d, step in zip(delays, (0.5, 1.0, 2.0, 2.0), strict=True))


def test_equal_start_and_maximum_is_a_fixed_period() -> None:
    backoff = Backoff(0.25, 0.25)
    assert {backoff.next_delay() for _ in range(5)} == {0.25}


async def test_an_outage_is_one_warning_and_one_info_line_with_the_backoff_between(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    registry = CollectorRegistry()
    pool = health(registry)
    backoff = Backoff(1.0, 4.0)
    answers = [False, False, False, False, False, True, True, False, True]
    attempts: list[float] = []
    for answered in answers:
        attempts.append(trio.current_time())
        if answered:
            pool.succeeded()
            backoff.reset()
            await trio.sleep(10.0)  # the kind's period between good reads
        else:
            pool.failed("refused", workers=2)
            await backoff.wait()
    # Failures at 0, 1, 3, 7, 11 (1, 2, 4, 4, capped); the answer at 15; the next
    # outage waits from the start again.
    assert attempts == [0.0, 1.0, 3.0, 7.0, 11.0, 15.0, 25.0, 35.0, 36.0]
    assert lines(caplog) == [
        (
            "WARNING",
            "discovery of pool decode: the source is unreachable or refused (refused); "
            "keeping the last view of 2 workers and retrying",
        ),
        *[("DEBUG", "discovery of pool decode: still failing: refused")] * 4,
        ("INFO", "discovery of pool decode: the source answers again after 5 failed reads"),
        (
            "WARNING",
            "discovery of pool decode: the source is unreachable or refused (refused); "
            "keeping the last view of 2 workers and retrying",
        ),
        ("INFO", "discovery of pool decode: the source answers again after 1 failed reads"),
    ]
    assert (pool.up, pool.failures, pool.errors) == (True, 0, 6)
    assert registry.get_sample_value("epd_discovery_errors_total", {"pool": "decode"}) == 6
    assert registry.get_sample_value("epd_discovery_up", {"pool": "decode"}) == 1


def test_up_follows_the_last_attempt_and_a_first_answer_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    registry = CollectorRegistry()
    pool = health(registry, "prefill")
    assert registry.get_sample_value("epd_discovery_up", {"pool": "prefill"}) == 0
    assert not pool.up
    pool.succeeded()
    assert lines(caplog) == []
    assert registry.get_sample_value("epd_discovery_up", {"pool": "prefill"}) == 1
    pool.failed("gone", workers=0)
    assert registry.get_sample_value("epd_discovery_up", {"pool": "prefill"}) == 0
    assert [level for level, _ in lines(caplog)] == ["WARNING"]


async def test_start_once_reports_started_on_the_first_call_only() -> None:
    calls: list[str] = []

    async def task(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = StartOnce(task_status)
        calls.append(f"done={started.done}")
        started()
        calls.append("started")
        started()  # a second report would raise RuntimeError
        assert started.done
        calls.append("again")

    async with trio.open_nursery() as nursery:
        await nursery.start(task)
    assert calls == ["done=False", "started", "again"]
