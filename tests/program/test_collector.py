"""The router program's garbage-collector set-up: frozen start-up objects, a higher threshold."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import pytest

from epd_actors.errors import ConfigError
from epd_actors.program import cli
from epd_actors.program.collector import DEFAULT_YOUNG_THRESHOLD, tune_collector
from epd_actors.program.config_file import parse_config

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

POOLS = {"pools": {"pd": {"workers": [{"id": "pd0", "address": "tcp://127.0.0.1:9000"}]}}}


@pytest.fixture
def collector() -> Iterator[None]:
    """Give the test process its collector back as it was."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


class _Alive:
    """A container object the collector tracks."""


@pytest.mark.usefixtures("collector")
def test_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    before = _Alive()
    _, middle, old = gc.get_threshold()
    tuning = tune_collector(12_345)
    assert tuning is not None
    assert gc.get_threshold() == tuning.thresholds == (12_345, middle, old)
    assert tuning.frozen == gc.get_freeze_count() > 0
    # The permanent generation is not among the collected objects; later ones are.
    after = _Alive()
    tracked = {id(o) for o in gc.get_objects()}
    assert id(before) not in tracked
    assert id(after) in tracked


@pytest.mark.usefixtures("collector")
def test_zero_leaves_the_collector_as_python_set_it() -> None:
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    assert tune_collector(0) is None
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)


def test_config_default_and_setting() -> None:
    assert parse_config(POOLS, environ={}).server.gc_young_threshold == DEFAULT_YOUNG_THRESHOLD
    data: dict[str, Any] = {**POOLS, "server": {"gc_young_threshold": 0}}
    assert parse_config(data, environ={}).server.gc_young_threshold == 0
    with pytest.raises(ConfigError, match=r"server\.gc_young_threshold: must be >= 0"):
        parse_config({**POOLS, "server": {"gc_young_threshold": -1}}, environ={})
    with pytest.raises(ConfigError, match=r"server\.gc_young_threshold"):
        parse_config({**POOLS, "server": {"gc_young_threshold": "high"}}, environ={})


@pytest.mark.usefixtures("collector")
def test_serve_sets_it_up_before_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.toml"
    config.write_text(
        '[server]\ngc_young_threshold = 23456\n[pools.pd]\nworkers = [{ id = "pd0", '
        'address = "tcp://127.0.0.1:9000" }]\n'
    )
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(cli.trio, "run", lambda *args: seen.append(gc.get_threshold()))
    assert cli.main(["serve", "--config", str(config)]) == 0
    assert [thresholds[0] for thresholds in seen] == [23456]
