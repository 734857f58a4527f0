"""EndpointSlices as workers: a sans-IO view of one pool's slices.

Theory of operation: the Kubernetes API hands out EndpointSlice objects (as
plain JSON-shaped mappings here, whatever client fetched them).
:func:`workers_of_slice` turns one slice into the workers it names, each in
one of three states taken from the endpoint's conditions, as the
EndpointSlice API defines them (``discovery.k8s.io/v1``):

- ``ready`` (``conditions.ready``; absent means ready, "unknown state ...
  consumers should interpret this unknown state as ready"): eligible for work;
- ``terminating`` (``conditions.terminating``; absent means false): the pod is
  going away; it gets no new work and what it holds finishes (draining),
  whether or not it is still ``serving``;
- otherwise ``not_ready``: it failed its readiness probe; no new work until it
  is ready again.

:class:`SliceSet` holds the slices of one pool by name, applies watch events
(``ADDED``/``MODIFIED`` replace a slice, ``DELETED`` drops it) or a whole
relisted set, and merges them into the pool's workers by id (an endpoint seen
in two slices while the controller moves it counts once, in its most
eligible state).

A pool may name two more of the slices' ports, ``kv_events_port`` and
``kv_events_replay_port`` (the Service's ports where each engine publishes KV
events and answers replays, e.g. ``kv-events`` = 5557): each worker then
subscribes at ``tcp://HOST:PORT`` of that port (no such port on a slice: the
router's pool rule applies).

A worker's id is ``NAME@HOST:PORT``: the pod's name (the endpoint's
``targetRef``, else its ``hostname``, else the slice's name), its first
address and the slice's port.  Its identity also carries the pod's uid, so a
pod restarted under the same name and address is a new worker all the same.

No I/O and no clock: everything here is tested with plain dictionaries.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import ConfigError


class EndpointState(enum.Enum):
    READY = "ready"
    NOT_READY = "not_ready"
    TERMINATING = "terminating"

    @property
    def eligible(self) -> bool:
        """Whether the worker may be given new work."""
        return self is EndpointState.READY


# Which state wins when one worker appears in two slices.
_PREFERENCE = {EndpointState.READY: 0, EndpointState.NOT_READY: 1, EndpointState.TERMINATING: 2}


@dataclass(frozen=True, slots=True)
class DiscoveredWorker:
    """One endpoint of a slice, as a worker of the router.

    Attributes:
        worker_id: ``NAME@HOST:PORT``, unique across the router's pools.
        address: what the backend dials (``address_format`` filled in).
        uid: the pod's uid (None when the endpoint names no pod).
        state: what its conditions say.
        kv_events_endpoint / kv_events_replay_endpoint: where its engine
            publishes KV events and answers replays, when the source says
            (None: the pool's ``kv_events_port`` rule).  Read when the worker
            is added.
    """

    worker_id: str
    address: str
    uid: str | None
    state: EndpointState
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def same_instance(self, other: DiscoveredWorker) -> bool:
        """The same pod at the same address (a restarted pod is another)."""
        return self.uid == other.uid and self.address == other.address


def check_address_format(text: str, *, key: str) -> str:
    """``text`` if it is a template with ``{host}`` and ``{port}`` and nothing else.

    Raises:
        ConfigError: naming ``key``.
    """
    try:
        filled = text.format(host="h", port=1)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"{key}: {text!r} may name only {{host}} and {{port}} ({exc})") from None
    if "{host}" not in text or "{port}" not in text or not filled:
        raise ConfigError(f"{key}: {text!r} must contain {{host}} and {{port}}")
    return text


def _state(conditions: Mapping[str, object]) -> EndpointState:
    if conditions.get("terminating") is True:
        return EndpointState.TERMINATING
    if conditions.get("ready", True) is False:
        return EndpointState.NOT_READY
    return EndpointState.READY


def _port(ports: object, name: str) -> int | None:
    if not isinstance(ports, list):
        return None
    for entry in ports:
        if isinstance(entry, Mapping) and (entry.get("name") or "") == name:
            port = entry.get("port")
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                return port
    return None


def slice_name(obj: Mapping[str, object]) -> str:
    """``metadata.name`` of a slice ("" when it has none)."""
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else ""


KVPorts = tuple[str | None, str | None]
"""The names of a slice's KV events port and replay port (None: not looked for)."""


def _kv_endpoints(ports: object, names: KVPorts, host: str) -> tuple[str | None, str | None]:
    """``tcp://HOST:PORT`` of the named KV events ports (the replay one only with the first)."""
    pub_name, replay_name = names
    pub = None if pub_name is None else _port(ports, pub_name)
    if pub is None:
        return None, None
    replay = None if replay_name is None else _port(ports, replay_name)
    return f"tcp://{host}:{pub}", None if replay is None else f"tcp://{host}:{replay}"


def workers_of_slice(
    obj: Mapping[str, object],
    *,
    port_name: str,
    address_format: str,
    kv_ports: KVPorts = (None, None),
) -> list[DiscoveredWorker]:
    """The workers one EndpointSlice names (those with an address and the named port).

    A slice without a port called ``port_name`` ("" matches an unnamed port)
    names no workers; so does an endpoint without addresses.  Entries of the
    wrong shape are skipped, never raised: a bad slice must not stop the watch.
    ``kv_ports`` names the ports of each worker's KV event endpoints.
    """
    port = _port(obj.get("ports"), port_name)
    endpoints = obj.get("endpoints")
    if port is None or not isinstance(endpoints, list):
        return []
    fallback = slice_name(obj)
    found = []
    for endpoint in endpoints:
        if not isinstance(endpoint, Mapping):
            continue
        addresses = endpoint.get("addresses")
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            continue
        host = addresses[0]
        ref = endpoint.get("targetRef")
        ref = ref if isinstance(ref, Mapping) else {}
        name = ref.get("name") or endpoint.get("hostname") or fallback
        uid = ref.get("uid")
        conditions = endpoint.get("conditions")
        shown = f"[{host}]" if ":" in host else host
        kv_pub, kv_replay = _kv_endpoints(obj.get("ports"), kv_ports, shown)
        found.append(
            DiscoveredWorker(
                worker_id=f"{name}@{shown}:{port}",
                address=address_format.format(host=shown, port=port),
                uid=uid if isinstance(uid, str) else None,
                state=_state(conditions if isinstance(conditions, Mapping) else {}),
                kv_events_endpoint=kv_pub,
                kv_events_replay_endpoint=kv_replay,
            )
        )
    return found


class SliceSet:
    """The EndpointSlices of one pool, by name, and the workers they add up to.

    Args:
        port_name: the slices' port the workers serve on.
        address_format: ``{host}`` and ``{port}`` -> a backend address.
        kv_ports: the slices' KV events and replay ports (see the module docstring).
    """

    def __init__(
        self, *, port_name: str, address_format: str, kv_ports: KVPorts = (None, None)
    ) -> None:
        self.port_name = port_name
        self.address_format = address_format
        self.kv_ports = kv_ports
        self._slices: dict[str, list[DiscoveredWorker]] = {}

    def __len__(self) -> int:
        return len(self._slices)

    def _workers(self, obj: Mapping[str, object]) -> list[DiscoveredWorker]:
        return workers_of_slice(
            obj,
            port_name=self.port_name,
            address_format=self.address_format,
            kv_ports=self.kv_ports,
        )

    def replace_all(self, objects: Iterable[Mapping[str, object]]) -> None:
        """Forget every slice and take ``objects`` (a fresh list)."""
        self._slices = {slice_name(obj): self._workers(obj) for obj in objects}

    def apply(self, event_type: str, obj: Mapping[str, object]) -> bool:
        """Apply one watch event; True when it may have changed the workers.

        ``BOOKMARK`` (and any type the API may add) changes nothing.
        """
        name = slice_name(obj)
        if event_type in ("ADDED", "MODIFIED"):
            self._slices[name] = self._workers(obj)
            return True
        if event_type == "DELETED":
            return self._slices.pop(name, None) is not None
        return False

    def workers(self) -> dict[str, DiscoveredWorker]:
        """Every worker of every slice, by id; a duplicate keeps its most eligible state."""
        merged: dict[str, DiscoveredWorker] = {}
        for workers in self._slices.values():
            for worker in workers:
                seen = merged.get(worker.worker_id)
                if seen is None or _PREFERENCE[worker.state] < _PREFERENCE[seen.state]:
                    merged[worker.worker_id] = worker
        return merged
