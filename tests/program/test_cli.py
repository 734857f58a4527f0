"""The command line's own parsing: the default command, --log-level anywhere, --version."""

from __future__ import annotations

import pytest

from epd_actors import __version__
from epd_actors.program.cli import _with_command, build_parser


def parsed(arguments: list[str]) -> object:
    return build_parser().parse_args(_with_command(arguments))


@pytest.mark.parametrize(
    ("arguments", "command", "level"),
    [
        ([], "local", "WARNING"),
        (["--log-level", "info"], "local", "INFO"),
        (["--log-level=debug", "--port", "0"], "local", "DEBUG"),
        (["--log-level", "INFO", "check-config", "x.toml"], "check-config", "INFO"),
        (["check-config", "--log-level", "error", "x.toml"], "check-config", "ERROR"),
        (
            ["--log-level", "info", "check-config", "--log-level", "error", "x"],
            "check-config",
            "ERROR",
        ),
    ],
    ids=["nothing", "level-only", "level-then-local-options", "before", "after", "after-wins"],
)
def test_the_log_level_goes_before_or_after_the_command(
    arguments: list[str], command: str, level: str
) -> None:
    args = parsed(arguments)
    assert (args.command, args.log_level) == (command, level)  # type: ignore[attr-defined]


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parsed(["--log-level", "verbose"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'VERBOSE'" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parsed(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"epd_actors {__version__}"


@pytest.mark.parametrize(
    ("http_port", "ws_port", "expected"),
    [(8000, None, 8001), (0, None, 0), (9000, 7000, 7000), (0, -1, -1)],
    ids=["next-port", "any-port-with-port-0", "as-given", "none"],
)
def test_the_local_websocket_port_never_collides_with_port_0(
    http_port: int, ws_port: int | None, expected: int
) -> None:
    from epd_actors.program.local import local_ws_port

    assert local_ws_port(http_port, ws_port) == expected


def test_local_takes_a_drain_timeout() -> None:
    args = parsed(["--port", "0", "--drain-timeout", "2.5"])
    assert (args.port, args.ws_port, args.drain_timeout) == (0, None, 2.5)  # type: ignore[attr-defined]
    assert parsed([]).drain_timeout == 30.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "arguments",
    [["--log-format", "json", "check-config", "x"], ["check-config", "--log-format=json", "x"]],
    ids=["before", "after"],
)
def test_the_log_format_goes_before_or_after_the_command(arguments: list[str]) -> None:
    args = parsed(arguments)
    assert (args.command, args.log_format) == ("check-config", "json")  # type: ignore[attr-defined]


def test_local_and_serve_take_an_access_log_switch() -> None:
    assert parsed(["--access-log"]).access_log is True  # type: ignore[attr-defined]
    assert parsed([]).access_log is False  # type: ignore[attr-defined]
    serve = parsed(["serve", "--config", "x.toml", "--access-log"])
    assert serve.access_log is True  # type: ignore[attr-defined]
