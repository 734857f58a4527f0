"""``python -m epd_actors check-config FILE``: validate a configuration and explain it.

Every error in one run, the warnings, and the secrets a real start needs
(:mod:`.config_report`); the structure is checked without the secrets being
set.  Exit status 0 when the file would start (warnings or not), else 2.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.actors import STAGE_ACTORS, stage_policy
from ..core.config import DEADLINE_NAMES
from ..core.router import bind_local_prefill, build_catalog, build_encoder_caches, build_pools
from ..core.supervisor import Supervisor
from .config_report import check_tables

if TYPE_CHECKING:
    import argparse

    from ..core.config import PoolConfig
    from .config_file import FileConfig


def add_check_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the TOML configuration to validate")


def describe(config: FileConfig) -> str:
    """A human-readable summary of a valid configuration."""
    router, server = config.router, config.server
    lines = [f"model:      {router.model}"]
    for model in router.served_models():
        stages = sorted(
            (p.stage for p in router.pools if router.pool_model(p) == model),
            key=lambda s: STAGE_ACTORS[s].order,
        )
        adapters = [a.name for a in router.lora_adapters(model)]
        lora = f"   LoRA adapters: {', '.join(adapters)}" if adapters else ""
        label = "topology:  " if model == router.model else f"topology of {model}:"
        lines.append(f"{label} {' -> '.join(stages)}{lora}")
    lines += [
        f"http:       {server.http_listen}"
        + (f"   websocket: {server.ws_listen}" if server.ws_listen else ""),
        f"api keys:   {len(server.http.api_keys) or 'none (open)'}"
        f"   admin routes: {'on' if server.http.admin_keys else 'off'}",
        f"worker auth token: {'set' if router.auth_token else 'NOT SET'}",
        "deadlines:  "
        + ", ".join(f"{name}={getattr(router.deadlines, name):g}s" for name in DEADLINE_NAMES),
    ]
    for pool in router.pools:
        lines.append(
            f"pool {router.pool_name(pool)}: policy={stage_policy(pool.stage, pool.policy)} "
            f"max_in_flight_per_worker={pool.max_in_flight_per_worker}"
            + (" lora_loading" if pool.lora_loading else "")
            + _reuse_summary(pool)
        )
        lines += [f"  - {w.worker_id} {w.backend} {w.address}" for w in pool.workers]
    if config.discovery is not None:
        lines += config.discovery.describe()
    return "\n".join(lines)


def _reuse_summary(pool: PoolConfig) -> str:
    reuse = pool.encoder_reuse
    if not reuse.enabled:
        return ""
    return f" reuse={reuse.mode} reuse_ttl_s={reuse.ttl_s:g} reuse_scope={reuse.scope}"


def check_topology(config: FileConfig) -> None:
    """Build (without starting) the supervisor, so topology errors surface here too."""
    pools = build_pools(config.router)
    supervisor = Supervisor(
        pools,
        catalog=build_catalog(config.router, pools),
        encoder_caches=build_encoder_caches(config.router),
    )
    bind_local_prefill(config.router, pools, supervisor)


def run_check_config(args: argparse.Namespace) -> int:
    name = args.file
    try:
        data = tomllib.loads(Path(name).read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"{name}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except tomllib.TOMLDecodeError as exc:
        print(f"{name}: invalid TOML: {exc}", file=sys.stderr)
        return 2
    report = check_tables(data, check=check_topology)
    for error in report.errors:
        print(f"{name}: error: {error}", file=sys.stderr)
    for warning in report.warnings:
        print(f"{name}: warning: {warning}", file=sys.stderr)
    for secret in report.secrets:
        print(f"{name}: a real start needs {secret}")
    if report.config is None:
        print(f"{name}: invalid configuration ({len(report.errors)} error(s))", file=sys.stderr)
        return 2
    print(f"{name}: OK")
    print(describe(report.config))
    return 0
