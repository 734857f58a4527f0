"""pyzmq, imported on first use: it is the optional ``kv-events`` extra."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

__all__ = ["import_zmq"]


def import_zmq() -> Any:
    """Import pyzmq, or explain which extra installs it.

    Raises:
        ConfigError: pyzmq is not installed.
    """
    try:
        import zmq
    except ImportError:
        raise ConfigError(
            "KV events need pyzmq: pip install 'epd_actors[kv-events]' (or pyzmq>=25)"
        ) from None
    return zmq
