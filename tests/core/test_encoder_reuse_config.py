"""``[pools.encode] reuse``: read from the file, checked by name, refused where it cannot apply."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from epd_actors.core.encoder_cache import EncoderReuse
from epd_actors.core.router import build_encoder_caches
from epd_actors.errors import ConfigError
from epd_actors.program.check_config import check_topology, describe
from epd_actors.program.config_file import load_config

if TYPE_CHECKING:
    from pathlib import Path

EPD = """
[pools.encode]
workers = [{ id = "e0", address = "tcp://127.0.0.1:9000" }]
{encode}
[pools.prefill]
workers = [{ id = "p0", address = "tcp://127.0.0.1:9001" }]
{prefill}
[pools.decode]
workers = [{ id = "d0", address = "tcp://127.0.0.1:9002" }]
"""


def write(tmp_path: Path, encode: str = "", prefill: str = "") -> Path:
    path = tmp_path / "epd.toml"
    path.write_text(EPD.replace("{encode}", encode).replace("{prefill}", prefill))
    return path


def test_reuse_is_off_unless_configured(tmp_path: Path) -> None:
    config = load_config(write(tmp_path), environ={})
    assert all(pool.encoder_reuse == EncoderReuse() for pool in config.router.pools)
    assert build_encoder_caches(config.router) == {}


def test_the_encode_pool_reads_every_reuse_key(tmp_path: Path) -> None:
    encode = (
        'reuse = "ttl"\nreuse_ttl_s = 30\nreuse_scope = "worker"\n'
        "reuse_max_entries = 100\nreuse_max_bytes = 4096\n"
    )
    config = load_config(write(tmp_path, encode), environ={})
    pool = config.router.pool("encode")
    assert pool is not None
    assert pool.encoder_reuse == EncoderReuse("ttl", 30.0, "worker", 100, 4096)
    check_topology(config)
    (name,) = build_encoder_caches(config.router)
    assert name == "encode"
    assert "reuse=ttl reuse_ttl_s=30 reuse_scope=worker" in describe(config)


@pytest.mark.parametrize(
    ("encode", "key"),
    [
        ('reuse = "always"', r"pools\.encode\.reuse must be one of"),
        ('reuse = "ttl"\nreuse_ttl_s = 0', r"pools\.encode\.reuse_ttl_s"),
        ('reuse = "ttl"\nreuse_scope = "cluster"', r"pools\.encode\.reuse_scope"),
        ("reuse_max_entries = 0", r"pools\.encode\.reuse_max_entries"),
        ("reuse = 1", r"pools\.encode\.reuse: expected a string"),
    ],
)
def test_bad_reuse_settings_name_their_key(tmp_path: Path, encode: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, encode), environ={})


def test_reuse_on_a_stage_that_produces_no_encoder_outputs_is_refused(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, prefill='reuse = "ttl"'), environ={})
    with pytest.raises(ConfigError, match=r"pools\.prefill\.reuse: only a stage that produces"):
        check_topology(config)
