"""Every command-line option has help text with its default; serve --host/--port; a taken port."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from epd_actors.errors import ConfigError
from epd_actors.program.cli import build_parser, host_port_overrides
from epd_actors.program.config_file import ServerConfig

if TYPE_CHECKING:
    from pathlib import Path


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def test_every_option_of_every_command_has_help_text() -> None:
    missing = [
        f"{name or 'top'} {action.option_strings or action.dest}"
        for name, parser in commands().items()
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert missing == []


@pytest.mark.parametrize("command", ["", "local", "serve", "worker", "check-config", "bench"])
def test_help_shows_every_default(command: str) -> None:
    parser = commands()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, False, "", argparse.SUPPRESS):
            continue
        if "default" in (action.help or ""):
            continue  # the help names its default in its own words
        assert f"(default: {default})" in text, action.option_strings


def test_host_and_port_override_the_files_http_listen() -> None:
    server = ServerConfig(http_listen="127.0.0.1:8000")
    assert host_port_overrides(server, None, None, http_listen=None) is server
    assert host_port_overrides(server, "0.0.0.0", None, http_listen=None).http_listen == (
        "0.0.0.0:8000"
    )
    assert host_port_overrides(server, None, 9000, http_listen=None).http_listen == (
        "127.0.0.1:9000"
    )
    assert host_port_overrides(server, "::1", 1, http_listen=None).http_listen == "[::1]:1"
    with pytest.raises(ConfigError, match="same listener"):
        host_port_overrides(server, None, 9000, http_listen="127.0.0.1:1")
    with pytest.raises(ConfigError, match="out of range"):
        host_port_overrides(server, None, 70000, http_listen=None)


def test_serve_parses_host_and_port() -> None:
    args = build_parser().parse_args(["serve", "--config", "x", "--host", "h", "--port", "5"])
    assert (args.host, args.port) == ("h", 5)


@pytest.mark.processes
def test_a_taken_port_fails_naming_the_address(tmp_path: Path) -> None:
    config = tmp_path / "epd.toml"
    config.write_text(
        'model = "m"\n[server]\nhttp_listen = "127.0.0.1:0"\n'
        '[pools.pd]\nworkers = [{ id = "a", address = "tcp://127.0.0.1:1" }]\n'
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "epd_actors", "serve", "--config", str(config)]
        done = subprocess.run(
            [*command, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}:" in done.stderr
    assert "in use" in done.stderr
