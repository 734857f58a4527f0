"""The settings of the ``redis`` discovery kind: which pools, where, how often.

Read from ``[discovery]`` by :mod:`.redis_kind`; used by the reader in
:mod:`.redis_discovery`.  Plain data: nothing here imports coredis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..core.fleet.settings import REDIS_SCHEMES, redacted_url
from ..errors import ConfigError
from .base import DiscoverySettings
from .registrations import pool_key


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
