"""Worker membership changes made through the admin API, as replicas exchange them.

A :class:`WorkerChange` is what :class:`~epd_actors.router.Router` reports
after an operator added, drained or removed a worker, and what a replica
applies when it reads another replica's change.  It travels as a JSON object
(:meth:`WorkerChange.to_json` / :meth:`WorkerChange.from_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

from ...errors import ConfigError

Action = Literal["add", "drain", "resume", "remove"]
ACTIONS: tuple[Action, ...] = ("add", "drain", "resume", "remove")


@dataclass(frozen=True, slots=True)
class WorkerChange:
    """One operator change of a worker.

    Attributes:
        action: ``add``, ``drain``, ``resume`` (undo a drain) or ``remove``.
        worker_id: the worker (replicas name workers alike).
        stage, model, address, backend: what ``add`` needs (empty otherwise;
            ``model`` empty: the router's default model).
        kv_events_endpoint, kv_events_replay_endpoint: the worker's own KV
            event endpoints, for ``add`` (empty: the pool's port rule).
        origin: the router instance that made the change (set when shared).
    """

    action: Action
    worker_id: str
    stage: str = ""
    model: str = ""
    address: str = ""
    backend: str = "native"
    origin: str = ""
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerChange:
        """Parse one change.

        Raises:
            ConfigError: not a JSON object of a known action with string fields.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"a shared worker change is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("action") not in ACTIONS:
            raise ConfigError(f"a shared worker change has no known action: {data!r}")
        fields = {}
        defaults = {"backend": "native"}
        for name in (
            "worker_id",
            "stage",
            "model",
            "address",
            "backend",
            "origin",
            "kv_events_endpoint",
            "kv_events_replay_endpoint",
        ):
            value = data.get(name, defaults.get(name, ""))
            if not isinstance(value, str):
                raise ConfigError(f"a shared worker change has a non-string {name}: {value!r}")
            fields[name] = value
        if not fields["worker_id"]:
            raise ConfigError("a shared worker change names no worker")
        return cls(action=data["action"], **fields)
