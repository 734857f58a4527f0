"""``[server] stream_coalescing``: read, checked, handed to both front ends and both backends."""

from __future__ import annotations

import pytest

from epd_actors.errors import ConfigError
from epd_actors.program.config_file import parse_config

POOL = {"pools": {"pd": {"workers": [{"id": "pd0", "address": "tcp://127.0.0.1:9000"}]}}}


def test_ready_is_the_default_and_merges_everywhere() -> None:
    config = parse_config(dict(POOL), environ={})
    assert config.server.stream_coalescing == "ready"
    assert config.server.http.stream_coalescing == config.server.ws.stream_coalescing == "ready"
    assert config.router.native.merge_reads
    assert config.router.openai_http.merge_reads


def test_off_reaches_the_front_ends_and_the_backends() -> None:
    config = parse_config({**POOL, "server": {"stream_coalescing": "off"}}, environ={})
    assert config.server.stream_coalescing == "off"
    assert config.server.http.stream_coalescing == config.server.ws.stream_coalescing == "off"
    assert not config.router.native.merge_reads
    assert not config.router.openai_http.merge_reads


def test_an_unknown_mode_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"server\.stream_coalescing: must be one of ready, off"):
        parse_config({**POOL, "server": {"stream_coalescing": "window"}}, environ={})


@pytest.mark.parametrize("table", ["native", "openai_http"])
def test_merge_reads_is_set_only_by_stream_coalescing(table: str) -> None:
    with pytest.raises(ConfigError, match="merge_reads"):
        parse_config({**POOL, table: {"merge_reads": False}}, environ={})
