"""The command line's own parsing: the default command, --log-level anywhere, --version."""

from __future__ import annotations

import pytest

from epd_actors import __version__
from epd_actors.cli import _with_command, build_parser


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
