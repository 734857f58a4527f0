"""A pool's KV event settings: whether the router subscribes, and where each engine publishes.

Theory of operation
-------------------
A pool with ``kv_events`` on runs one KV event subscriber per worker
(:mod:`.kv_feeds`).  Each worker's publisher is found, in this order:

1. the worker's own ``kv_events_endpoint`` (and ``kv_events_replay_endpoint``),
   given in its ``[[pools.X.workers]]`` entry or its ``WorkerEndpoint``;
2. else ``tcp://HOST:kv_events_port`` (and ``tcp://HOST:kv_events_replay_port``),
   where ``HOST`` is the host of the worker's own address (``tcp://HOST:PORT``
   for native workers, ``http://HOST:PORT`` for ``vllm serve``) -- the usual
   shape of a fleet in which every engine runs with the same
   ``--kv-events-config`` (``"endpoint": "tcp://*:5557"``).

A worker for which neither gives an endpoint (a ``unix:`` address and no
port rule) is a configuration error, naming the worker.

Pure data and checks; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from ..errors import ConfigError

__all__ = ["KVEventsSettings", "check_zmq_endpoint"]

_ENDPOINT_SCHEMES: Final = ("tcp://", "ipc://", "inproc://")


def check_zmq_endpoint(endpoint: str, *, key: str) -> None:
    """Refuse an endpoint libzmq could not connect to (``tcp://HOST:PORT``, ``ipc://PATH``).

    Raises:
        ConfigError: naming ``key``.
    """
    if not endpoint.startswith(_ENDPOINT_SCHEMES):
        raise ConfigError(
            f"{key}: {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)"
        )
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://") :]
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{key}: {endpoint!r} is not tcp://HOST:PORT")


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """Whether a pool's router follows its engines' KV events, and where they publish.

    Attributes:
        enabled: run one subscriber per worker, feeding the pool's index.
        port: the PUB port on each worker's host, for workers without an
            explicit ``kv_events_endpoint`` (None: every worker names its own).
        replay_port: the ROUTER (replay) port on each worker's host (None:
            no replay for derived endpoints; gaps then purge the worker).
        topic: the topic prefix subscribed to (vLLM's ``topic``; "" = all).
        max_blocks_per_worker / max_blocks: the bounds of the pool's index.
    """

    enabled: bool = False
    port: int | None = None
    replay_port: int | None = None
    topic: str = ""
    max_blocks_per_worker: int = 1 << 20
    max_blocks: int = 1 << 22

    def check(self, key: str) -> None:
        """Refuse out-of-range settings.

        Raises:
            ConfigError: naming ``key.kv_events_...``.
        """
        for name, port in (("port", self.port), ("replay_port", self.replay_port)):
            if port is not None and not 0 < port <= 65535:
                raise ConfigError(f"{key}.kv_events_{name}: {port} is out of range")
        if self.max_blocks_per_worker < 1 or self.max_blocks < 1:
            raise ConfigError(f"{key}.kv_index_max_blocks: the index bounds must be >= 1")

    def endpoints(
        self, address: str, endpoint: str | None, replay_endpoint: str | None
    ) -> tuple[str, str | None] | None:
        """The publisher and replay endpoints of a worker at ``address`` (None: none known).

        ``endpoint``/``replay_endpoint`` are the worker's own; they win over
        the port rule.  A worker's own endpoint with no replay endpoint of its
        own has no replay.
        """
        if endpoint is not None:
            return endpoint, replay_endpoint
        if self.port is None:
            return None
        host = _host_of(address)
        if host is None:
            return None
        replay = None if self.replay_port is None else f"tcp://{host}:{self.replay_port}"
        return f"tcp://{host}:{self.port}", replay


def _host_of(address: str) -> str | None:
    """The host of ``tcp://HOST:PORT`` or ``http(s)://HOST:PORT`` (bracketed for IPv6)."""
    if not address.startswith(("tcp://", "http://", "https://")):
        return None
    host = urlsplit(address).hostname
    if not host:
        return None
    return f"[{host}]" if ":" in host else host
