"""Helpers of the real-vLLM lane that run without vLLM: the NIXL patch and the port picker.

The lane itself (``tests/real_vllm``, marker ``real_vllm``) proves they work
against real engines; these tests pin their failure paths, which the lane
cannot provoke.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import pytest

from tests.real_vllm import fleet
from tests.real_vllm.patch_venv import NIXL_POLL, NIXL_SPIN, patch_nixl_progress_delay

if TYPE_CHECKING:
    from pathlib import Path

API_LINES = "        agent_config.useProgThread = nixl_conf.enable_pthread\n        {}"


def nixl_package(site: Path, name: str, line: str) -> Path:
    api = site / name / "_api.py"
    api.parent.mkdir(parents=True)
    api.write_text(API_LINES.format(line), encoding="utf-8")
    return api


def test_the_nixl_progress_delay_is_patched_once_in_every_package(tmp_path: Path) -> None:
    cu12 = nixl_package(tmp_path, "nixl_cu12", NIXL_SPIN)
    cu13 = nixl_package(tmp_path, "nixl_cu13", NIXL_SPIN)
    assert patch_nixl_progress_delay(tmp_path) == [str(cu12), str(cu13)]
    patched = cu13.read_text(encoding="utf-8")
    assert NIXL_POLL in patched
    assert NIXL_SPIN not in patched
    assert patch_nixl_progress_delay(tmp_path) == [str(cu12), str(cu13)]  # idempotent
    assert cu13.read_text(encoding="utf-8") == patched


def test_a_nixl_release_without_the_line_fails_loudly(tmp_path: Path) -> None:
    nixl_package(tmp_path, "nixl_cu13", "agent_config.pthrDelay = delay\n")
    with pytest.raises(SystemExit, match="does not set pthrDelay as expected"):
        patch_nixl_progress_delay(tmp_path)


def test_no_nixl_package_is_reported(tmp_path: Path) -> None:
    assert patch_nixl_progress_delay(tmp_path) == []


def test_lane_ports_avoid_the_ephemeral_range_and_never_repeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n", encoding="ascii")
    monkeypatch.setattr(fleet, "EPHEMERAL_RANGE", ranges)
    monkeypatch.setattr(fleet, "_handed_out", set())
    ports = [fleet.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= port < 32768 for port in ports)
    # A kernel whose ephemeral range starts low: ports come from above it.
    ranges.write_text("1024\t50000\n", encoding="ascii")
    assert 50000 < fleet.free_port() <= 65535


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(fleet, "_fixed_port_range", lambda: range(port, port + 1))
        monkeypatch.setattr(fleet, "_handed_out", set())
        with pytest.raises(RuntimeError, match="no free loopback port"):
            fleet.free_port()
