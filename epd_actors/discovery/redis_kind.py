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

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import DiscoveryKind, DiscoverySettings, register_discovery_kind
from .redis_settings import RedisDiscoverySettings, RedisPool

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config_tables import ConfigTable
    from ..core.config import RouterConfig
    from .base import Discovery


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
