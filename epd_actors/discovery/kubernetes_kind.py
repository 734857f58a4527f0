"""The ``kubernetes`` discovery kind: its settings, read from ``[discovery]``.

The watch itself is in :mod:`epd_actors.discovery.kubernetes`, imported (with
lightkube, the optional ``kubernetes`` extra) only when a router starts one,
so ``check-config`` validates a file without it.

Keys (docs/deployment.md, "On Kubernetes", has an example)::

    [discovery]
    kind = "kubernetes"
    namespace = "epd"                 # default: the service account's, else the context's
    kubeconfig = "/path/to/config"    # default: in-cluster, else $KUBECONFIG or ~/.kube/config
    context = "name"                  # a kubeconfig context (default: its current one)
    backend = "openai_http"           # how discovered workers are reached
    port = "http"                     # the EndpointSlice port they serve on
    address_format = "http://{host}:{port}"
    watch_timeout_s = 290             # the API server ends each watch after this long
    request_timeout_s = 10            # connect/list timeout
    backoff_start_s = 0.5             # retry delay while the API server is away ...
    backoff_max_s = 30                # ... doubling up to this

    [[discovery.pools]]
    stage = "decode"
    model = "..."                     # default: the router's model
    selector = { "epd-actors.io/role" = "decode" }   # default: that label = stage
    # backend, port and address_format may be set per pool too
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.backend_kinds import backend_kind
from ..errors import ConfigError
from .base import DiscoveryKind, DiscoverySettings, register_discovery_kind
from .endpoints import check_address_format

if TYPE_CHECKING:
    from collections.abc import Mapping

    from prometheus_client import CollectorRegistry

    from ..core.config import RouterConfig
    from ..program.config_file import _Table
    from .base import Discovery

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
    """

    stage: str
    model: str | None
    selector: Mapping[str, str]
    backend: str
    port: str
    address_format: str

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
            for p in self.pools
        ]
        return lines


def _selector(table: _Table, stage: str) -> dict[str, str]:
    if not table.has("selector"):
        return {ROLE_LABEL: stage}
    raw = table.mapping("selector")
    if not raw:
        raise ConfigError(f"{table.key('selector')}: must name at least one label")
    for name, value in raw.items():
        if not isinstance(value, str) or not name or any(c in name + value for c in ",=!() "):
            raise ConfigError(
                f"{table.key('selector')}.{name}: expected a label value (a string without "
                "',', '=', '!', '(', ')' or spaces)"
            )
    return {name: str(value) for name, value in raw.items()}


def _pool(table: _Table, router: RouterConfig, defaults: tuple[str, str, str]) -> KubernetesPool:
    stage = table.string("stage", None)
    if not stage:
        raise ConfigError(f"{table.key('stage')}: required")
    model = table.string("model", None)
    served = model or router.model
    if not any(p.stage == stage and router.pool_model(p) == served for p in router.pools):
        raise ConfigError(
            f"{table.key('stage')}: no [pools.{stage}] of model {served!r} to put its workers in"
        )
    backend = table.string("backend", defaults[0]) or defaults[0]
    port = table.string("port", defaults[1])
    address_format = table.string("address_format", defaults[2]) or defaults[2]
    selector = _selector(table, stage)
    table.done()
    check_address_format(address_format, key=table.key("address_format"))
    backend_kind(backend, key=table.key("backend")).check_address(
        address_format.format(host="10.0.0.1", port=8000), key=table.key("address_format")
    )
    return KubernetesPool(stage, model, selector, backend, port or "", address_format)


@register_discovery_kind
class KubernetesKind(DiscoveryKind):
    """Workers from the EndpointSlices of one namespace, one label selector per pool."""

    name = "kubernetes"

    def parse(self, table: _Table, router: RouterConfig) -> DiscoverySettings:
        backend = table.string("backend", "openai_http") or "openai_http"
        port = table.string("port", "http") or ""
        address_format = table.string("address_format", "http://{host}:{port}") or ""
        check_address_format(address_format, key=table.key("address_format"))
        defaults = (backend, port, address_format)
        pools = tuple(_pool(t, router, defaults) for t in table.tables("pools"))
        if not pools:
            raise ConfigError(f"{table.key('pools')}: name at least one pool to discover")
        seen: set[tuple[str, str | None]] = set()
        for index, pool in enumerate(pools):
            if (pool.stage, pool.model) in seen:
                raise ConfigError(f"{table.key('pools')}[{index}]: pool {pool.label} given twice")
            seen.add((pool.stage, pool.model))
        fixed: dict[str, object] = {
            "kind": self.name,
            "pools": pools,
            "namespace": table.string("namespace", None),
            "kubeconfig": table.string("kubeconfig", None),
            "context": table.string("context", None),
        }
        from ..program.config_file import read_settings

        return read_settings(table, KubernetesSettings, **fixed)

    def open(self, settings: DiscoverySettings, registry: CollectorRegistry) -> Discovery:
        assert isinstance(settings, KubernetesSettings)
        try:
            from .kubernetes import KubernetesDiscovery
        except ImportError as exc:
            raise ConfigError(
                f"discovery kind 'kubernetes' needs lightkube ({exc}); "
                "install it with: pip install 'epd_actors[kubernetes]'"
            ) from None
        return KubernetesDiscovery(settings, registry)
