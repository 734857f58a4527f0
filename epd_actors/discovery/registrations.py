"""Worker registrations in Redis: key names and the record, shared by worker and router (sans-IO).

A worker started with ``--register redis://...`` keeps one record alive while
it serves; a router with ``[discovery] kind = "redis"`` reads the records of
each of its pools.  Keys, under a prefix (``epd`` below, the ``[shared]``
``key_prefix`` by default):

==============================  ======  =============================================
key                             type    what
==============================  ======  =============================================
``epd:worker:ID``               string  worker ID's :class:`Registration` (JSON),
                                        ``PX ttl``: gone when ID stops refreshing it
``epd:workers:STAGE:MODEL``     set     the ids registered for that pool (an index;
                                        ids whose record expired are removed by the
                                        next reader), ``PX`` ten TTLs, refreshed by
                                        each worker's refresh
==============================  ======  =============================================

A record may also name where the worker's engine publishes KV events
(``kv_events_endpoint``, ``kv_events_replay_endpoint``: ZMQ endpoints, the
same keys as a configured worker's); a record without them leaves the pool's
``kv_events_port`` rule to find them.

A record names the worker's instance (a random token drawn when its process
starts), so a worker restarted under the same id and address is a new worker
to the router (removed, then added again), as a restarted pod is.

No I/O: the worker's registrar and the router's reader do that.
"""

from __future__ import annotations

import enum
import json
import math
import secrets
from dataclasses import dataclass

from ..core.kv_settings import check_zmq_endpoint
from ..errors import ConfigError
from .endpoints import DiscoveredWorker, EndpointState


class RegistrationState(enum.Enum):
    READY = "ready"
    """The worker serves: route to it."""
    DRAINING = "draining"
    """The worker finishes what it holds and takes nothing new."""
    STOPPED = "stopped"
    """The worker exited: remove it now (the record expires by itself)."""


_ENDPOINT_STATES = {
    RegistrationState.READY: EndpointState.READY,
    RegistrationState.DRAINING: EndpointState.TERMINATING,
    RegistrationState.STOPPED: EndpointState.TERMINATING,
}


KV_ENDPOINT_FIELDS = ("kv_events_endpoint", "kv_events_replay_endpoint")
"""The record's optional fields naming the worker's KV event endpoints."""


class RegistrationError(ValueError):
    """A record that cannot be read (skipped by the router, never raised to it)."""


def worker_key(prefix: str, worker_id: str) -> str:
    """The key of one worker's record."""
    return f"{prefix}:worker:{worker_id}"


def pool_key(prefix: str, stage: str, model: str) -> str:
    """The index of one pool's registered worker ids."""
    return f"{prefix}:workers:{stage}:{model}"


def new_instance() -> str:
    """A fresh instance token for a starting worker process."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Registration:
    """What one worker says of itself.

    Attributes:
        worker_id: unique across the fleet (the router's worker id).
        stage: the pool's stage it serves.
        model: the model it serves.
        address: what a router dials (``tcp://HOST:PORT``, ``unix:PATH``, or an
            ``http://`` URL for an ``openai_http`` worker).
        backend: the router's backend kind for it (``native``, ``openai_http``).
        instance: this process's token (see the module docstring).
        ttl_s: the record's time to live; the worker refreshes it at least
            three times within it.  A router removes a worker whose record has
            been missing for this long (see ``redis_discovery``).
        state: ready, draining, or stopped (it exited).
        kv_events_endpoint / kv_events_replay_endpoint: where its engine
            publishes KV events (ZMQ PUB) and answers replays (ROUTER); None:
            the router's pool finds them by its port rule.
    """

    worker_id: str
    stage: str
    model: str
    address: str
    backend: str
    instance: str
    ttl_s: float
    state: RegistrationState = RegistrationState.READY
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def to_json(self) -> str:
        record: dict[str, object] = {
            "worker_id": self.worker_id,
            "stage": self.stage,
            "model": self.model,
            "address": self.address,
            "backend": self.backend,
            "instance": self.instance,
            "ttl_s": self.ttl_s,
            "state": self.state.value,
        }
        for name in KV_ENDPOINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                record[name] = value
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Registration:
        """Read a record.

        Raises:
            RegistrationError: not JSON, a field missing or of the wrong type, an unknown
                state, a KV events endpoint that is not a ZMQ endpoint (or a replay
                endpoint without one).
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RegistrationError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RegistrationError("not a JSON object")
        values: dict[str, str] = {}
        for name in ("worker_id", "stage", "model", "address", "backend", "instance", "state"):
            value = data.get(name)
            if not isinstance(value, str) or not value:
                raise RegistrationError(f"field {name!r} missing or not a string")
            values[name] = value
        raw_ttl = data.get("ttl_s")
        if isinstance(raw_ttl, bool) or not isinstance(raw_ttl, (int, float)):
            raise RegistrationError("field 'ttl_s' missing or not a number")
        ttl_s = float(raw_ttl)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise RegistrationError("field 'ttl_s' must be a positive number")
        try:
            state = RegistrationState(values.pop("state"))
        except ValueError:
            raise RegistrationError(f"unknown state {data['state']!r}") from None
        kv: dict[str, str | None] = {}
        for name in KV_ENDPOINT_FIELDS:
            value = data.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise RegistrationError(f"field {name!r} is not a string")
                try:
                    check_zmq_endpoint(value, key=f"field {name!r}")
                except ConfigError as exc:
                    raise RegistrationError(str(exc)) from None
            kv[name] = value
        if kv["kv_events_replay_endpoint"] is not None and kv["kv_events_endpoint"] is None:
            raise RegistrationError("field 'kv_events_replay_endpoint' needs kv_events_endpoint")
        return cls(
            ttl_s=ttl_s,
            state=state,
            kv_events_endpoint=kv["kv_events_endpoint"],
            kv_events_replay_endpoint=kv["kv_events_replay_endpoint"],
            **values,
        )

    def as_discovered(self) -> DiscoveredWorker:
        """The worker as the reconciler sees it (draining reads as terminating)."""
        return DiscoveredWorker(
            self.worker_id,
            self.address,
            self.instance,
            _ENDPOINT_STATES[self.state],
            self.kv_events_endpoint,
            self.kv_events_replay_endpoint,
        )
