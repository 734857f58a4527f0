"""Helpers of the real-vLLM lane that run without vLLM: the NIXL patch, the port picker,
the routers' configuration, the reading of ``x-epd-timings`` and the tiny audio model's
weight names.

The lane itself (``tests/real_vllm``, marker ``real_vllm``) proves they work
against real engines; these tests pin their failure paths, which the lane
cannot provoke.
"""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest

from epd_actors.core.config import validate
from epd_actors.program.config_file import FileConfig, parse_config
from epd_actors.request import RequestTimings
from tests.real_vllm import fleet
from tests.real_vllm.make_tiny_models import published_name
from tests.real_vllm.patch_venv import NIXL_POLL, NIXL_SPIN, patch_nixl_progress_delay

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


def engine(name: str, stage: str, port: int, backend: str) -> fleet.Engine:
    """An engine as start_engine describes it (its process is never started)."""
    role = fleet.Role(name, stage, "qwen2vl")
    process = fleet.Process(name, ["true"], Path("unused.log"))
    scheme = "http" if backend == "openai_http" else "tcp"
    return fleet.Engine(role, process, f"{scheme}://127.0.0.1:{port}", "unused")


def lane_config(options: dict[str, list[str]] | None, backend: str = "openai_http") -> FileConfig:
    pools = {
        "encode": [engine("e", "encode", 9001, backend)],
        "prefill": [engine("p", "prefill", 9002, backend)],
        "decode": [engine("d", "decode", 9003, backend)],
    }
    text = fleet.router_toml("/models/qwen2vl", pools, backend, 9000, options)
    config = parse_config(tomllib.loads(text), environ={"EPD_AUTH_TOKEN": "secret"})
    validate(config.router)  # what `serve` checks at start-up
    return config


def test_the_reuse_router_remembers_encoder_outputs_in_its_encode_pool_only() -> None:
    config = lane_config({"encode": fleet.ENCODER_REUSE})
    reuse = {pool.stage: pool.encoder_reuse for pool in config.router.pools}
    assert reuse["encode"].mode == "ttl"
    assert reuse["encode"].scope == "shared"
    assert reuse["encode"].ttl_s == 600
    assert reuse["prefill"].mode == reuse["decode"].mode == "off"


def test_the_other_routers_do_not_reuse() -> None:
    for backend in ("openai_http", "native"):
        config = lane_config(None, backend)
        assert all(pool.encoder_reuse.mode == "off" for pool in config.router.pools)


def test_the_stages_a_router_ran_are_read_from_its_timings_header() -> None:
    timings = RequestTimings(
        queue_wait_s=0.001,
        stages={"encode": 0.01, "prefill": 0.02, "decode": 0.03},
        ttft_s=0.025,
        total_s=0.05,
        workers={"encode": ("e",), "prefill": ("p",), "decode": ("d",)},
    )
    assert fleet.ran_stages(timings.header_value()) == {"encode", "prefill", "decode"}
    skipped = RequestTimings(0.0, {"pd": 0.02}, None, 0.03, {"pd": ("pd",)})
    assert fleet.ran_stages(skipped.header_value()) == {"pd"}
    assert fleet.ran_stages("") == set()


@pytest.mark.parametrize(
    ("in_memory", "published"),
    [
        # transformers 5: the language model is a bare Qwen2Model, the head at the top
        (
            "model.language_model.layers.0.mlp.up_proj.weight",
            "language_model.model.layers.0.mlp.up_proj.weight",
        ),
        ("model.language_model.norm.weight", "language_model.model.norm.weight"),
        ("lm_head.weight", "language_model.lm_head.weight"),
        ("model.audio_tower.conv1.weight", "audio_tower.conv1.weight"),
        ("model.multi_modal_projector.linear.bias", "multi_modal_projector.linear.bias"),
        # transformers 4: already the published names
        ("language_model.model.embed_tokens.weight", "language_model.model.embed_tokens.weight"),
        ("language_model.lm_head.weight", "language_model.lm_head.weight"),
        ("audio_tower.layer_norm.bias", "audio_tower.layer_norm.bias"),
    ],
)
def test_the_tiny_audio_model_is_written_under_the_published_names(
    in_memory: str, published: str
) -> None:
    assert published_name(in_memory) == published
