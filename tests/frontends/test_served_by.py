"""Which workers served a request: timings header, WebSocket ``done`` message, access log."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from epd_actors.frontends.http import HttpSettings
from epd_actors.frontends.ws_messages import done_message
from epd_actors.logs import ACCESS_LOGGER
from epd_actors.protocol import Usage
from epd_actors.request import DoneEvent, RequestTimings
from tests.frontends.test_http_frontend import CHAT, connected, sim_app

TIMINGS = RequestTimings(
    0.001,
    {"encode": 0.01, "prefill": 0.02, "decode": 0.05},
    0.03,
    0.08,
    {"encode": ("encode-1", "encode-0"), "prefill": ("prefill-0",), "decode": ("decode-0",)},
)


def test_the_timings_header_names_each_stages_workers() -> None:
    parts = TIMINGS.header_value().split(";")
    assert parts[-3:] == [
        "worker.encode=encode-1,encode-0",
        "worker.prefill=prefill-0",
        "worker.decode=decode-0",
    ]
    assert "decode=50.0" in parts


def test_served_by_is_a_dash_when_no_stage_finished() -> None:
    none = RequestTimings(0.0, {}, None, 0.0, {})
    assert none.served_by() == "-"
    assert "worker." not in none.header_value()
    assert TIMINGS.served_by() == "encode=encode-1,encode-0 prefill=prefill-0 decode=decode-0"


def test_the_websocket_done_message_names_the_workers() -> None:
    message = json.loads(done_message("a", DoneEvent("stop", Usage(1, 2), TIMINGS), request_id="r"))
    assert message["timings"]["workers"] == {
        "encode": ["encode-1", "encode-0"],
        "prefill": ["prefill-0"],
        "decode": ["decode-0"],
    }


@pytest.fixture
def access_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET)
    return caplog


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_request_names_its_workers(
    access_log: pytest.LogCaptureFixture, stream: bool
) -> None:
    settings = HttpSettings(linger_s=0.5, access_log=True)
    body = {**CHAT, "model": "sim-model", "stream": stream}
    async with sim_app({"prefill": 1, "decode": 2}) as (_, app), connected(app, settings) as c:
        reply = await c.request(
            "POST", "/v1/chat/completions", json_body=body, headers=(("x-request-id", "r-1"),)
        )
    assert reply.status == 200
    if stream:
        assert ";worker.prefill=prefill-0;worker.decode=decode-" in reply.body.decode()
    else:
        assert ";worker.prefill=prefill-0;worker.decode=decode-" in reply.headers["x-epd-timings"]
    (line,) = _access_lines(access_log)
    assert line.startswith('[r-1] "POST /v1/chat/completions" 200 ')
    served = line.rsplit(" ", 2)[-2:]
    assert served[0] == "prefill=prefill-0"
    assert served[1] in ("decode=decode-0", "decode=decode-1")


async def test_a_failed_request_names_the_workers_that_finished(
    access_log: pytest.LogCaptureFixture,
) -> None:
    settings = HttpSettings(linger_s=0.5, access_log=True)
    body = {**CHAT, "model": "sim-model"}
    async with (
        sim_app({"prefill": 1, "decode": 1}, generate_error_rate=1.0) as (_, app),
        connected(app, settings) as client,
    ):
        reply = await client.request("POST", "/v1/chat/completions", json_body=body)
    assert reply.status == 502
    assert reply.headers["x-epd-timings"].endswith(";worker.prefill=prefill-0")
    (line,) = _access_lines(access_log)
    assert line.endswith(" prefill=prefill-0")


async def test_a_request_that_never_ran_logs_a_dash(access_log: pytest.LogCaptureFixture) -> None:
    settings = replace(HttpSettings(linger_s=0.5), access_log=True)
    async with sim_app({"pd": 1}) as (_, app), connected(app, settings) as client:
        reply = await client.request("GET", "/health")
    assert reply.status == 200
    (line,) = _access_lines(access_log)
    assert line.endswith("ms -")
