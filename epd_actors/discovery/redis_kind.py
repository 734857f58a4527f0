"""The ``redis`` discovery kind: workers that register themselves in Redis.

Its settings are read here from ``[discovery]``; the reader itself is in
:mod:`epd_actors.discovery.redis_discovery`, imported (with coredis, the
optional ``redis`` extra) only when a router starts one, so ``check-config``
validates a file without it.  The record and its keys:
:mod:`epd_actors.discovery.registrations`.

Keys (docs/scale-out.md, "Workers registered in Redis", has an example)::

    [discovery]
    kind = "redis"
    redis_url = "redis://host:6379/0"   # default: [shared] redis_url
    key_prefix = "epd"                  # default: [shared] key_prefix
    period_s = 1.0                      # how often each pool's registrations are read
    timeout_s = 0.5                     # the bound on each read

    [[discovery.pools]]                 # default: every configured pool
    stage = "decode"
    model = "..."                       # default: the router's model
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..core.fleet.settings import REDIS_SCHEMES, redacted_url
from ..errors import ConfigError
from .base import DiscoveryKind, DiscoverySettings, register_discovery_kind
from .registrations import pool_key

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config_tables import ConfigTable
    from ..core.config import RouterConfig
    from .base import Discovery


@dataclass(frozen=True, slots=True)
class RedisPool:
    """One router pool whose workers register in Redis.

    Attributes:
        stage: the pool's stage.
        model: the pool's model as configured (None: the router's).
        served_model: the model it serves (what the workers register under).
    """

    stage: str
    model: str | None
    served_model: str

    @property
    def label(self) -> str:
        return self.stage if self.model is None else f"{self.stage}@{self.model}"


@dataclass(frozen=True, slots=True)
class RedisDiscoverySettings(DiscoverySettings):
    """``[discovery]`` with ``kind = "redis"`` (see the module docstring)."""

    redis_url: str = ""
    key_prefix: str = "epd"
    period_s: float = 1.0
    timeout_s: float = 0.5
    pools: tuple[RedisPool, ...] = ()

    def __post_init__(self) -> None:
        scheme = urlsplit(self.redis_url).scheme
        if not self.redis_url:
            raise ConfigError("discovery.redis_url: required (or set [shared] redis_url)")
        if scheme not in REDIS_SCHEMES:
            raise ConfigError(
                f"discovery.redis_url: scheme {scheme!r} is not one of {', '.join(REDIS_SCHEMES)}"
            )
        for name in ("period_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"discovery.{name} must be a positive number, got {value!r}")
        if not self.key_prefix:
            raise ConfigError("discovery.key_prefix must not be empty")
        if not self.pools:
            raise ConfigError("discovery.pools: no pool to discover")

    def describe(self) -> list[str]:
        lines = [
            f"discovery:  redis, {redacted_url(self.redis_url)}, read every {self.period_s:g} s"
        ]
        lines += [
            f"  pool {p.label}: registrations {pool_key(self.key_prefix, p.stage, p.served_model)}"
            for p in self.pools
        ]
        return lines


def _pool(table: ConfigTable, router: RouterConfig) -> RedisPool:
    stage = table.string("stage", None)
    if not stage:
        raise ConfigError(f"{table.key('stage')}: required")
    model = table.string("model", None)
    table.done()
    served = model or router.model
    if router.pool(stage, served) is None:
        raise ConfigError(
            f"{table.key('stage')}: no [pools.{stage}] of model {served!r} to put its workers in"
        )
    return RedisPool(stage, model, served)


@register_discovery_kind
class RedisKind(DiscoveryKind):
    """Workers from their own TTL'd registrations in Redis, read per pool every period."""

    name = "redis"

    def parse(self, table: ConfigTable, router: RouterConfig) -> DiscoverySettings:
        if table.has("pools"):
            pools = tuple(_pool(t, router) for t in table.tables("pools"))
            if not pools:
                raise ConfigError(f"{table.key('pools')}: name at least one pool to discover")
        else:
            pools = tuple(
                RedisPool(
                    p.stage, None if p.model in (None, router.model) else p.model,
                    router.pool_model(p),
                )
                for p in router.pools
            )  # fmt: skip
        seen: set[tuple[str, str]] = set()
        for index, pool in enumerate(pools):
            if (pool.stage, pool.served_model) in seen:
                raise ConfigError(f"{table.key('pools')}[{index}]: pool {pool.label} given twice")
            seen.add((pool.stage, pool.served_model))
        from ..config_tables import read_settings

        shared = router.shared
        return read_settings(
            table,
            RedisDiscoverySettings,
            kind=self.name,
            pools=pools,
            redis_url=table.string("redis_url", None) or shared.redis_url,
            key_prefix=table.string("key_prefix", None) or shared.key_prefix,
        )

    def open(self, settings: DiscoverySettings, registry: CollectorRegistry) -> Discovery:
        assert isinstance(settings, RedisDiscoverySettings)
        try:
            from .redis_discovery import RedisDiscovery
        except ImportError as exc:
            raise ConfigError(
                f"discovery kind 'redis' needs coredis ({exc}); "
                "install it with: pip install 'epd_actors[redis]'"
            ) from None
        return RedisDiscovery(settings, registry)
