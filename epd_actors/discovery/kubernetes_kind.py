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
    kv_events_port = "kv-events"      # the slices' port where engines publish KV events
    kv_events_replay_port = "kv-replay"   # ... and answer replays (both default: none)
    watch_timeout_s = 290             # the API server ends each watch after this long
    request_timeout_s = 10            # connect/list timeout
    backoff_start_s = 0.5             # retry delay while the API server is away ...
    backoff_max_s = 30                # ... doubling up to this

    [[discovery.pools]]
    stage = "decode"
    model = "..."                     # default: the router's model
    selector = { "epd-actors.io/role" = "decode" }   # default: that label = stage
    # backend, port, address_format and the kv_events ports may be set per pool too
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.backend_kinds import backend_kind
from ..errors import ConfigError
from .base import DiscoveryKind, DiscoverySettings, register_discovery_kind
from .endpoints import KVPorts, check_address_format
from .kubernetes_settings import (
    ROLE_LABEL,
    KubernetesPool,
    KubernetesSettings,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config_tables import ConfigTable
    from ..core.config import RouterConfig
    from .base import Discovery


def _selector(table: ConfigTable, stage: str) -> dict[str, str]:
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


def _kv_ports(table: ConfigTable, defaults: KVPorts) -> KVPorts:
    """``kv_events_port`` / ``kv_events_replay_port``: port names (a replay one needs the other)."""
    names = (
        table.string("kv_events_port", defaults[0]) or None,
        table.string("kv_events_replay_port", defaults[1]) or None,
    )
    if names[1] is not None and names[0] is None:
        raise ConfigError(f"{table.key('kv_events_replay_port')}: needs kv_events_port")
    return names


def _pool(
    table: ConfigTable, router: RouterConfig, defaults: tuple[str, str, str], kv: KVPorts
) -> KubernetesPool:
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
    kv_ports = _kv_ports(table, kv)
    table.done()
    check_address_format(address_format, key=table.key("address_format"))
    backend_kind(backend, key=table.key("backend")).check_address(
        address_format.format(host="10.0.0.1", port=8000), key=table.key("address_format")
    )
    return KubernetesPool(stage, model, selector, backend, port or "", address_format, *kv_ports)


@register_discovery_kind
class KubernetesKind(DiscoveryKind):
    """Workers from the EndpointSlices of one namespace, one label selector per pool."""

    name = "kubernetes"

    def parse(self, table: ConfigTable, router: RouterConfig) -> DiscoverySettings:
        backend = table.string("backend", "openai_http") or "openai_http"
        port = table.string("port", "http") or ""
        address_format = table.string("address_format", "http://{host}:{port}") or ""
        check_address_format(address_format, key=table.key("address_format"))
        defaults = (backend, port, address_format)
        kv = _kv_ports(table, (None, None))
        pools = tuple(_pool(t, router, defaults, kv) for t in table.tables("pools"))
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
        from ..config_tables import read_settings

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
