"""``[shared]``: where router replicas share loose state, and how often.

Off by default (``redis_url`` empty): a single router needs nothing else
installed.  See docs/configuration.md (``[shared]``) and docs/scale-out.md
("What replicas share").
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from ...errors import ConfigError

REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """How this router shares state with its replicas.

    Attributes:
        redis_url: ``redis://[[user]:password@]host:port/db``, ``rediss://...``
            (TLS; ``?ssl_ca_certs=PATH`` names a private CA) or
            ``unix://[:password@]/path.sock``; empty: nothing is shared.
        router_id: how the other replicas name this one (default: host name,
            process id and a random suffix, so two processes never collide).
        key_prefix: the prefix of every Redis key (several fleets may share one
            Redis under different prefixes).
        publish_interval_s: how often this router publishes its counts and
            reads everyone else's (and the admin changes).
        ttl_s: how long a router's published state outlives its last publish:
            a dead router's counts, and its entry among the live routers,
            disappear after at most this long.  Also how long a reader keeps
            using remote counts after Redis stopped answering.
        timeout_s: the bound on each exchange with Redis.
        max_requests_in_flight: the fleet-wide admission limit (requests in
            flight over all live routers, counted a publish interval late);
            0: none, each router only applies its own ``[admission]`` limit.
        admin_history: how many admin changes Redis keeps for replicas that
            start later (approximately; older ones are trimmed).
        admin_ttl_s: how long the admin changes are kept after the last one.
    """

    redis_url: str = ""
    router_id: str = ""
    key_prefix: str = "epd"
    publish_interval_s: float = 0.2
    ttl_s: float = 2.0
    timeout_s: float = 0.5
    max_requests_in_flight: int = 0
    admin_history: int = 1000
    admin_ttl_s: float = 86400.0

    def __post_init__(self) -> None:
        if self.redis_url:
            scheme = urlsplit(self.redis_url).scheme
            if scheme not in REDIS_SCHEMES:
                raise ConfigError(
                    f"shared.redis_url: scheme {scheme!r} is not one of {', '.join(REDIS_SCHEMES)}"
                )
        for name in ("publish_interval_s", "ttl_s", "timeout_s", "admin_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"shared.{name} must be a positive number, got {value!r}")
        if self.ttl_s < 2 * self.publish_interval_s:
            raise ConfigError(
                "shared.ttl_s must be at least twice shared.publish_interval_s "
                f"(got {self.ttl_s:g} and {self.publish_interval_s:g})"
            )
        if self.max_requests_in_flight < 0:
            raise ConfigError("shared.max_requests_in_flight must be >= 0")
        if self.admin_history < 1:
            raise ConfigError("shared.admin_history must be >= 1")
        if not self.key_prefix:
            raise ConfigError("shared.key_prefix must not be empty")

    @property
    def enabled(self) -> bool:
        """Whether a Redis URL is configured."""
        return bool(self.redis_url)

    def resolved_router_id(self) -> str:
        """``router_id``, or a fresh one naming the host and the process."""
        if self.router_id:
            return self.router_id
        return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def redacted_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
