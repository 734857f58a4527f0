"""Logging: JSON lines for log pipelines, and an access log that shows whatever the root level."""

from __future__ import annotations

import json
import logging

import pytest

from epd_actors.frontends.http_app import HttpSettings
from epd_actors.logs import ACCESS_LOGGER, JsonFormatter, configure_logging
from tests.frontends.test_http_frontend import ScriptedApp, connected


def test_a_json_line_carries_time_level_logger_message_and_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "epd_actors.x", logging.ERROR, __file__, 1, "failed %s", ("r1",), exc_info=True
        )
        record.exc_info = __import__("sys").exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["level"], entry["logger"], entry["message"]) == (
        "ERROR",
        "epd_actors.x",
        "failed r1",
    )
    assert entry["ts"].endswith("+00:00")
    assert "ValueError: boom" in entry["exception"]


def test_configure_logging_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("INFO", "xml")


async def test_the_access_log_shows_at_the_default_warning_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # the capturing handler takes everything (restored after)
    logging.getLogger().setLevel(logging.WARNING)  # the root level a router runs at by default
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET)
    async with connected(ScriptedApp(), HttpSettings(access_log=True)) as client:
        reply = await client.request("GET", "/health", headers=(("x-request-id", "abc"),))
    assert reply.status == 200
    (line,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith('[abc] "GET /health" 200 ')


async def test_no_access_log_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with connected(ScriptedApp(), HttpSettings()) as client:
        await client.request("GET", "/health")
    assert [r for r in caplog.records if r.name == ACCESS_LOGGER] == []
