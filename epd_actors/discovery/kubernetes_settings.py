"""The settings of the ``kubernetes`` discovery kind: pools by label selector, credentials.

Read from ``[discovery]`` by :mod:`.kubernetes_kind`; used by the watch in
:mod:`.kubernetes`.  Plain data: nothing here imports lightkube.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import DiscoverySettings

if TYPE_CHECKING:
    from collections.abc import Mapping


ROLE_LABEL = "epd-actors.io/role"
"""The label whose value is the stage, on each role's Service (copied onto its EndpointSlices)."""
MODEL_LABEL = "epd-actors.io/model"
"""The label naming a model, for pools of a model other than the default."""
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True, slots=True)
class KubernetesPool:
    """The EndpointSlices of one router pool.

    Attributes:
        stage: the pool's stage.
        model: the pool's model (None: the router's).
        selector: label -> value; a slice must carry all of them.
        backend: the backend kind of its workers.
        port: the name of the slices' port its workers serve on ("": unnamed).
        address_format: the backend address, from ``{host}`` and ``{port}``.
        kv_events_port / kv_events_replay_port: the names of the slices' ports
            where each engine publishes KV events / answers replays (None:
            the router's pool rule finds them).
    """

    stage: str
    model: str | None
    selector: Mapping[str, str]
    backend: str
    port: str
    address_format: str
    kv_events_port: str | None = None
    kv_events_replay_port: str | None = None

    @property
    def selector_text(self) -> str:
        """The ``labelSelector`` query value."""
        return ",".join(f"{key}={value}" for key, value in sorted(self.selector.items()))

    @property
    def label(self) -> str:
        return self.stage if self.model is None else f"{self.stage}@{self.model}"


@dataclass(frozen=True, slots=True)
class KubernetesSettings(DiscoverySettings):
    """``[discovery]`` with ``kind = "kubernetes"`` (see the module docstring)."""

    pools: tuple[KubernetesPool, ...] = ()
    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    service_account_dir: str = SERVICE_ACCOUNT_DIR
    watch_timeout_s: float = 290.0
    request_timeout_s: float = 10.0
    backoff_start_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.watch_timeout_s < 1:
            raise ConfigError("watch_timeout_s must be >= 1")
        if self.request_timeout_s <= 0:
            raise ConfigError("request_timeout_s must be > 0")
        if not 0 < self.backoff_start_s <= self.backoff_max_s:
            raise ConfigError("need 0 < backoff_start_s <= backoff_max_s")

    def describe(self) -> list[str]:
        where = self.kubeconfig or "in-cluster service account, else $KUBECONFIG"
        lines = [
            f"discovery:  kubernetes, namespace {self.namespace or '(from the credentials)'}, "
            f"credentials: {where}"
        ]
        lines += [
            f"  pool {p.label}: EndpointSlices {p.selector_text}, port {p.port or '(unnamed)'}, "
            f"{p.backend} {p.address_format}"
            + ("" if p.kv_events_port is None else f", KV events port {p.kv_events_port}")
            + ("" if p.kv_events_replay_port is None else f", replay {p.kv_events_replay_port}")
            for p in self.pools
        ]
        return lines
