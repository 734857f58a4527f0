"""check-config: every error in one run, warnings, "did you mean", secrets not needed to check."""

from __future__ import annotations

import tomllib
from typing import TYPE_CHECKING

import pytest

from epd_actors.errors import ConfigError
from epd_actors.program.check_config import check_topology
from epd_actors.program.cli import main
from epd_actors.program.config_file import parse_config
from epd_actors.program.config_report import PLACEHOLDER, check_tables

if TYPE_CHECKING:
    from pathlib import Path

POOLS = """
[pools.prefill]
workers = [{ id = "p0", address = "tcp://127.0.0.1:9000" }]
[pools.decode]
workers = [{ id = "d0", address = "tcp://127.0.0.1:9001" }]
"""


def check(text: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return check_tables(tomllib.loads(text), environ=environ or {}, check=check_topology)


def test_a_valid_file_reads_with_no_error_and_no_warning() -> None:
    report = check(POOLS)
    assert report.errors == []
    assert report.warnings == []
    assert report.secrets == []
    assert report.config is not None


def test_every_independent_error_in_one_run() -> None:
    text = """
[server]
htpp_listen = "127.0.0.1:8000"
drain_timeout_s = "soon"
[server.http]
max_body_byte = 10
[deadlines]
request_timeout_s = -1
""" + POOLS.replace('"tcp://127.0.0.1:9001"', '"tcp://nowhere"')
    report = check(text)
    assert report.config is None
    assert report.errors == [
        "server.drain_timeout_s: expected a number, got str",
        "unknown key(s): server.http.max_body_byte (did you mean server.http.max_body_bytes?)",
        "unknown key(s): server.htpp_listen (did you mean server.http_listen?)",
        "deadlines.request_timeout_s: must be a finite number >= 0",
        "pools.decode.workers[0].address: 'tcp://nowhere' needs HOST:PORT",
    ]


def test_a_consequence_of_taking_a_key_out_is_not_reported() -> None:
    report = check(POOLS.replace('"tcp://127.0.0.1:9001"', '"tcp://nowhere"'))
    assert len(report.errors) == 1  # not also "address: required"


def test_did_you_mean_in_an_ordinary_start_too() -> None:
    with pytest.raises(ConfigError, match=r"pools\.prefill\.workers\[0\]\.adress \(did you mean"):
        parse_config(
            tomllib.loads(
                POOLS.replace(
                    'address = "tcp://127.0.0.1:9000"',
                    'adress = "x", address = "tcp://127.0.0.1:9000"',
                )
            )
        )
    with pytest.raises(ConfigError, match=r"unknown key\(s\): zzz$"):
        parse_config({**tomllib.loads(POOLS), "zzz": 1})  # nothing close: no suggestion


def test_secrets_need_not_be_set_to_check_and_are_listed(tmp_path: Path) -> None:
    present = tmp_path / "admin"
    present.write_text("adm")
    text = (
        f"""
auth_token_env = "EPD_AUTH_TOKEN"
[server]
api_keys_env = "EPD_API_KEYS"
admin_key_file = "{present}"
[openai_http]
api_key_file = "{tmp_path / "missing"}"
"""
        + POOLS
    )
    report = check(text, environ={"EPD_API_KEYS": "k"})
    assert report.errors == []
    assert report.secrets == [
        "environment variable EPD_AUTH_TOKEN (auth_token_env)",
        f"file {tmp_path / 'missing'} (openai_http.api_key_file)",
    ]
    assert report.config is not None
    assert report.config.router.auth_token == PLACEHOLDER
    assert report.config.server.http.admin_keys == ("adm",)


def test_warnings_empty_pool_public_listener_http_address() -> None:
    text = """
[server]
http_listen = "0.0.0.0:8000"
ws_listen = "[::1]:8001"
[pools.prefill]
workers = []
[pools.decode]
workers = [{ id = "d0", address = "tcp://127.0.0.1:9001" }]
"""
    report = check(text)
    assert report.errors == []
    assert len(report.warnings) == 2
    assert report.warnings[0].startswith("pool prefill has no workers and no [discovery]")
    assert report.warnings[1].startswith("server.http_listen = '0.0.0.0:8000' is reachable")
    keyed = check(text.replace("[server]", '[server]\napi_keys = ["k"]'))
    assert [w for w in keyed.warnings if "reachable" in w] == []


def test_an_http_address_hints_at_the_openai_http_backend() -> None:
    text = POOLS.replace('"tcp://127.0.0.1:9001"', '"http://127.0.0.1:9001"')
    report = check(text)
    assert report.errors == [
        "pools.decode.workers[0].address: 'http://127.0.0.1:9001' is not tcp://HOST:PORT "
        "or unix:PATH"
    ]
    assert report.warnings == [
        "pools.decode.workers[0].address = 'http://127.0.0.1:9001' is an HTTP server: a "
        '`vllm serve` instance is reached with backend = "openai_http" (the native backend '
        "speaks tcp://)"
    ]
    fine = check(text.replace('address = "http', 'backend = "openai_http", address = "http'))
    assert fine.errors == fine.warnings == []


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "epd.toml"
    path.write_text('auth_token_env = "EPD_NOT_SET_HERE"\n' + POOLS)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "a real start needs environment variable EPD_NOT_SET_HERE (auth_token_env)" in out
    assert f"{path}: OK" in out
    path.write_text("[server]\nnope = 1\nzzz = 2\n" + POOLS + "[deadlines]\nx = 1\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: error: unknown key(s): server.nope, server.zzz" in err
    assert f"{path}: error: unknown key(s): deadlines.x" in err
    assert "invalid configuration (2 error(s))" in err
