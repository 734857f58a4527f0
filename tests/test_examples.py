"""The runnable examples run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.processes
def test_embed_in_trio_example_streams_two_requests() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed_in_trio.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.count("[length]") == 2
    assert "encode=" in result.stdout
    assert "[error]" not in result.stdout
