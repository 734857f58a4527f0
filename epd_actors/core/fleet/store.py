"""The store a ``[shared]`` section names: Redis for a URL, nothing without one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ConfigError

if TYPE_CHECKING:
    from .settings import SharedSettings
    from .state import FleetStore


def open_store(settings: SharedSettings) -> FleetStore | None:
    """The Redis store of ``settings.redis_url``, or None when sharing is off.

    Raises:
        ConfigError: a URL is configured but coredis is not installed.
    """
    if not settings.enabled:
        return None
    try:
        from .redis_state import RedisFleetStore  # coredis is optional: import it only now
    except ImportError as exc:
        raise ConfigError(
            f"shared.redis_url needs the coredis package ({exc}): pip install 'epd_actors[redis]'"
        ) from None

    return RedisFleetStore(settings)
