"""CORS on the HTTP front end: preflights, the headers of ordinary answers, the settings."""

from __future__ import annotations

import pytest

from epd_actors.errors import ConfigError
from epd_actors.frontends.cors import EXPOSED, CorsPolicy, parse_origins
from epd_actors.frontends.http_app import HttpSettings
from epd_actors.program.config_file import parse_config
from epd_actors.request import UsageEvent

from .test_http_frontend import ScriptedApp, Usage, connected, delta, done

APP = "https://app.example"
SETTINGS = HttpSettings(cors=CorsPolicy((APP, "http://localhost:3000")))
PREFLIGHT = (
    ("origin", APP),
    ("access-control-request-method", "POST"),
    ("access-control-request-headers", "authorization, content-type"),
)


async def test_a_preflight_from_an_allowed_origin() -> None:
    async with connected(ScriptedApp(), SETTINGS) as client:
        reply = await client.request("OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert reply.status == 204
    assert reply.headers["access-control-allow-origin"] == APP
    assert reply.headers["access-control-allow-methods"] == "POST, OPTIONS"
    assert reply.headers["access-control-allow-headers"] == "authorization, content-type"
    assert reply.headers["access-control-max-age"] == "600"
    assert reply.headers["vary"] == "origin"
    assert reply.body == b""


async def test_a_preflight_needs_no_api_key_and_a_refused_origin_gets_no_grant() -> None:
    settings = HttpSettings(api_keys=("k",), cors=SETTINGS.cors)
    other = (("origin", "https://evil.example"), *PREFLIGHT[1:])
    async with connected(ScriptedApp(), settings) as client:
        allowed = await client.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
        refused = await client.request("OPTIONS", "/v1/completions", headers=other)
    assert allowed.status == 204
    assert allowed.headers["access-control-allow-origin"] == APP
    assert refused.status == 204
    assert not [name for name in refused.headers if name.startswith("access-control-")]
    assert refused.headers["vary"] == "origin"


async def test_ordinary_answers_carry_the_grant_streams_and_errors_too() -> None:
    app = ScriptedApp([delta("ok"), UsageEvent(Usage(3, 1)), done()])
    body = {"model": "m", "prompt": "x", "stream": True}
    origin = (("origin", "HTTP://LOCALHOST:3000"),)  # scheme and host compare without case
    async with connected(app, SETTINGS) as client:
        streamed = await client.request("POST", "/v1/completions", json_body=body, headers=origin)
        missing = await client.request("GET", "/nowhere", headers=origin)
        plain = await client.request("GET", "/livez")
    for reply in (streamed, missing):
        assert reply.headers["access-control-allow-origin"] == "HTTP://LOCALHOST:3000"
        assert reply.headers["access-control-expose-headers"] == EXPOSED
    assert streamed.status == 200
    assert missing.status == 404
    assert "access-control-allow-origin" not in plain.headers
    assert plain.headers["vary"] == "origin"


async def test_any_origin_and_none() -> None:
    wildcard = HttpSettings(cors=CorsPolicy(("*",)))
    async with connected(ScriptedApp(), wildcard) as client:
        preflight = await client.request("OPTIONS", "/v1/models", headers=PREFLIGHT)
        get = await client.request("GET", "/v1/models", headers=(("origin", APP),))
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert preflight.headers["access-control-allow-methods"] == "GET, HEAD, OPTIONS"
    assert "vary" not in preflight.headers
    assert get.headers["access-control-allow-origin"] == "*"
    async with connected(ScriptedApp()) as client:
        off = await client.request("OPTIONS", "/v1/models", headers=PREFLIGHT)
    assert off.status == 204
    assert off.headers["allow"] == "GET, HEAD, OPTIONS"
    assert not [name for name in off.headers if name.startswith("access-control-")]


def test_requested_headers_that_are_not_names_are_not_echoed() -> None:
    headers = dict(SETTINGS.cors.preflight_headers(APP, "POST", "x-a, bad header\r\n"))
    assert "access-control-allow-headers" not in headers
    assert headers["access-control-allow-origin"] == APP


@pytest.mark.parametrize("origin", ["https://app.example/", "app.example", "https://a/b", ""])
def test_malformed_origins_are_configuration_errors(origin: str) -> None:
    with pytest.raises(ConfigError, match="not '\\*' or scheme://host"):
        CorsPolicy((origin,))


def test_settings_from_the_file_and_the_command_line() -> None:
    pools = {"pools": {"pd": {"workers": [{"id": "pd0", "address": "tcp://127.0.0.1:9000"}]}}}
    config = parse_config({**pools, "server": {"allowed_origins": [APP]}})
    assert config.server.http.cors == CorsPolicy((APP,))
    with pytest.raises(ConfigError, match=r"^server\.allowed_origins: 'x' is not"):
        parse_config({**pools, "server": {"allowed_origins": ["x"]}})
    assert parse_origins(f"{APP}, http://localhost:3000") == (APP, "http://localhost:3000")
    assert parse_origins('["*"]') == ("*",)
    with pytest.raises(ConfigError, match="--allowed-origins"):
        parse_origins("[1]")
    with pytest.raises(ConfigError, match="--allowed-origins"):
        parse_origins("nope")
