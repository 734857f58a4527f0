"""The TOML configuration file: ``python -m epd_actors serve --config epd.toml``.

Theory of operation: :func:`load_config` reads TOML into plain tables and
:func:`parse_config` walks them with a small :class:`ConfigTable` reader that pops
each known key (checking its type and range) and then refuses whatever is
left, so a misspelt key is an error that names it (``server.idel_timeout_s``)
instead of a silently ignored setting.  The result is a :class:`FileConfig`:
the :class:`~epd_actors.core.config.RouterConfig` plus the front-end settings.

Secrets (worker auth token, API keys, admin key) can be given inline, through
an environment variable (``*_env``), or a file (``*_file``); docs/configuration.md
lists every key with its default.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends.native.settings import NativeSettings
from ..backends.openai_http.settings import OpenAIHttpSettings
from ..config_tables import ConfigTable, read_settings
from ..core.config import (
    ActorLimits,
    AdmissionLimits,
    Deadlines,
    ModelConfig,
    PoolConfig,
    RouterConfig,
    WorkerEndpoint,
)
from ..core.encoder_cache import EncoderReuse
from ..core.fleet.settings import SharedSettings
from ..core.health import HealthPolicy
from ..core.kv_settings import KVEventsSettings
from ..core.retry import RetryPolicy
from ..core.tracing.config import TracingConfig
from ..errors import ConfigError
from ..frontends.cors import CorsPolicy
from ..frontends.http_app import HttpSettings
from ..frontends.ws import WsSettings
from ..lora import LoraAdapter
from ..openai.coalescing import STREAM_COALESCING_MODES, check_stream_coalescing
from ..openai.fields import UNKNOWN_FIELD_CHOICES, FieldPolicy
from ..openai.media import MediaLimits, MediaPolicy
from .collector import DEFAULT_YOUNG_THRESHOLD

if TYPE_CHECKING:
    from ..discovery import DiscoverySettings


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The front ends: where they listen, their settings, and how they drain.

    Attributes:
        http_listen: ``HOST:PORT`` of the OpenAI-compatible HTTP server.
        ws_listen: ``HOST:PORT`` of the WebSocket server, or None for none.
        drain_timeout_s: on SIGTERM, how long in-flight requests may finish
            after the listeners closed, before the rest are cancelled.
        drain_notice_s: on SIGTERM, how long ``/health`` and ``/readyz``
            answer 503 ``draining`` while the listeners still accept, before
            they close (0: close at once).
        http: the HTTP server's limits, timeouts and keys.
        ws: the WebSocket server's limits, timeouts and keys.
        processes: how many router processes serve the listeners (``serve
            --processes``; see :mod:`epd_actors.processes`).
        metrics_listen: ``HOST:PORT`` where the parent of several router
            processes serves their metrics, each series labelled with its
            ``process``; None for none.
        ssl_certfile: a PEM certificate chain: TLS on every listener (None: plain TCP).
        ssl_keyfile: its PEM private key (None: in ``ssl_certfile``).
        ws_on_http: the HTTP listener also serves the WebSocket API: a
            ``GET`` of ``ws.path`` with ``Upgrade: websocket`` (true by default).
        stream_coalescing: ``ready`` (default): a response merges the deltas
            already queued for it into one SSE event (WebSocket message), never
            waiting for more; ``off``: one event per delta the router received
            from its worker, and no backend merges the deltas of one read
            (:mod:`~epd_actors.openai.coalescing`).  Copied into ``http``,
            ``ws``, ``[native]`` and ``[openai_http]``.
        gc_young_threshold: the garbage collector's youngest-generation
            threshold for the router process, which also freezes what start-up
            allocated (:mod:`~epd_actors.program.collector`); 0 leaves
            Python's collector as it is.
    """

    http_listen: str = "127.0.0.1:8000"
    ws_listen: str | None = None
    drain_timeout_s: float = 30.0
    http: HttpSettings = field(default_factory=HttpSettings)
    ws: WsSettings = field(default_factory=WsSettings)
    drain_notice_s: float = 0.0
    processes: int = 1
    metrics_listen: str | None = None
    ws_on_http: bool = True
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    stream_coalescing: str = "ready"
    gc_young_threshold: int = DEFAULT_YOUNG_THRESHOLD


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Everything a configuration file says."""

    router: RouterConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    discovery: DiscoverySettings | None = None
    """``[discovery]``: where workers are found at run time (None: only the listed ones)."""


def load_config(
    path: str | os.PathLike[str], *, environ: dict[str, str] | None = None
) -> FileConfig:
    """Read and validate a TOML configuration file.

    Raises:
        ConfigError: unreadable file, invalid TOML, or an invalid key (named).
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{os.fspath(path)}: invalid TOML: {exc}") from None
    return parse_config(data, environ=dict(os.environ) if environ is None else environ)


def parse_config(data: dict[str, object], *, environ: dict[str, str] | None = None) -> FileConfig:
    """Validate already-parsed TOML tables (see :func:`load_config`)."""
    env = dict(os.environ) if environ is None else environ
    top = ConfigTable(data, "")
    model = top.string("model", "sim-model") or "sim-model"
    auth_token = top.secret("auth_token", env) or ""
    server = _server(top.table("server"), env)
    deadlines = read_settings(top.table("deadlines"), Deadlines)
    actors = read_settings(top.table("actors"), ActorLimits)
    retries = read_settings(top.table("retries"), RetryPolicy)
    health = read_settings(top.table("health"), HealthPolicy)
    admission = read_settings(top.table("admission"), AdmissionLimits)
    # ``off``: the backends hand on each delta as received, unmerged.
    merge_reads = server.stream_coalescing == "ready"
    native = read_settings(top.table("native"), NativeSettings, merge_reads=merge_reads)
    openai_http_table = top.table("openai_http")
    api_key = openai_http_table.secret("api_key", env)
    openai_http = read_settings(
        openai_http_table, OpenAIHttpSettings, api_key=api_key, merge_reads=merge_reads
    )
    shared_table = top.table("shared")
    redis_url = shared_table.secret("redis_url", env) or ""
    shared = read_settings(shared_table, SharedSettings, redis_url=redis_url)
    tracing = read_settings(top.table("tracing"), TracingConfig)
    pools = _pools(top)
    models = tuple(_model(table) for table in top.tables("models"))
    discovery_table = top.table("discovery")
    top.done()
    router = RouterConfig(
        pools,
        auth_token=auth_token,
        model=model,
        models=models,
        deadlines=deadlines,
        actors=actors,
        retries=retries,
        health=health,
        admission=admission,
        native=native,
        openai_http=openai_http,
        shared=shared,
        tracing=tracing,
    )
    return FileConfig(router, server, _discovery(discovery_table, router))


def _discovery(table: ConfigTable, router: RouterConfig) -> DiscoverySettings | None:
    """``[discovery]``: its ``kind`` names a registered kind, which reads the rest."""
    from ..discovery import discovery_kind

    kind = table.string("kind", None)
    if kind is None:
        table.done()
        return None
    return discovery_kind(kind, key=table.key("kind")).parse(table, router)


def _server(table: ConfigTable, env: dict[str, str]) -> ServerConfig:
    defaults = ServerConfig()
    api_keys = table.strings("api_keys")
    if table.has("api_keys_env"):
        name = table.string("api_keys_env", None)
        assert name is not None
        raw = env.get(name)
        if raw is None:
            key = table.key("api_keys_env")
            raise ConfigError(f"{key}: environment variable {name} is not set")
        api_keys += tuple(k.strip() for k in raw.split(",") if k.strip())
    admin_key = table.secret("admin_key", env)
    http_listen = table.string("http_listen", defaults.http_listen) or defaults.http_listen
    ws_listen = table.string("ws_listen", None)
    metrics_listen = table.string("metrics_listen", None)
    processes = table.integer("processes", defaults.processes, minimum=1)
    listens = (("http_listen", http_listen), ("ws_listen", ws_listen))
    for key, value in (*listens, ("metrics_listen", metrics_listen)):
        if value is not None:
            parse_host_port(value, key=table.key(key))
    drain_timeout_s = table.number("drain_timeout_s", defaults.drain_timeout_s, minimum=0.001)
    drain_notice_s = table.number("drain_notice_s", defaults.drain_notice_s, minimum=0.0)
    access_log = table.boolean("access_log", False)
    gc_young_threshold = table.integer("gc_young_threshold", defaults.gc_young_threshold)
    ws_on_http = table.boolean("ws_on_http", defaults.ws_on_http)
    ssl_certfile = table.string("ssl_certfile", None)
    ssl_keyfile = table.string("ssl_keyfile", None)
    if ssl_keyfile is not None and ssl_certfile is None:
        raise ConfigError(f"{table.key('ssl_keyfile')}: needs ssl_certfile too")
    fields = _field_policy(table)
    coalescing = table.string("stream_coalescing", STREAM_COALESCING_MODES[0])
    assert coalescing is not None
    check_stream_coalescing(coalescing, key=table.key("stream_coalescing"))
    try:
        cors = CorsPolicy(table.strings("allowed_origins"))
    except ConfigError as exc:
        raise ConfigError(f"{table.key('allowed_origins')}: {exc}") from None
    media = _media(table.table("media"))
    http = read_settings(
        table.table("http"),
        HttpSettings,
        api_keys=api_keys,
        admin_keys=() if admin_key is None else (admin_key,),
        access_log=access_log,
        media=media,
        fields=fields,
        cors=cors,
        stream_coalescing=coalescing,
    )
    ws = read_settings(
        table.table("ws"),
        WsSettings,
        api_keys=api_keys,
        media=media,
        fields=fields,
        stream_coalescing=coalescing,
    )
    table.done()
    return ServerConfig(
        http_listen,
        ws_listen,
        drain_timeout_s,
        http,
        ws,
        drain_notice_s,
        processes=processes,
        metrics_listen=metrics_listen,
        ws_on_http=ws_on_http,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        stream_coalescing=coalescing,
        gc_young_threshold=gc_young_threshold,
    )


def _field_policy(table: ConfigTable) -> FieldPolicy:
    choice = table.string("unknown_fields", "reject")
    if choice not in UNKNOWN_FIELD_CHOICES:
        raise ConfigError(
            f"{table.key('unknown_fields')}: must be one of {', '.join(UNKNOWN_FIELD_CHOICES)}, "
            f"got {choice!r}"
        )
    return FieldPolicy(unknown=choice)  # type: ignore[arg-type]


def _media(table: ConfigTable) -> MediaLimits:
    prefixes = table.strings("allowed_url_prefixes")
    local_dirs = table.strings("allowed_local_dirs")
    try:
        policy = MediaPolicy(url_prefixes=prefixes, local_dirs=local_dirs)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{table.key('allowed_url_prefixes')}: {exc}") from None
    return read_settings(table, MediaLimits, policy=policy)


def _pools(top: ConfigTable) -> tuple[PoolConfig, ...]:
    """``[pools.STAGE]`` (one pool) or ``[[pools.STAGE]]`` (one per model) for each stage."""
    pools: list[PoolConfig] = []
    for stage, table in top.table("pools").stage_tables():
        pools += [_pool(stage, entry) for entry in table]
    return tuple(pools)


def _model(table: ConfigTable) -> ModelConfig:
    name = table.string("name", None)
    if not name:
        raise ConfigError(f"{table.key('name')}: required")
    adapters = []
    for entry in table.tables("lora_adapters"):
        adapter_name = entry.string("name", None)
        if not adapter_name:
            raise ConfigError(f"{entry.key('name')}: required")
        adapters.append(LoraAdapter(adapter_name, entry.string("path", None)))
        entry.done()
    table.done()
    return ModelConfig(name, tuple(adapters))


def _pool(stage: str, table: ConfigTable) -> PoolConfig:
    workers = []
    for worker in table.tables("workers"):
        worker_id = worker.string("id", None)
        address = worker.string("address", None)
        if not worker_id:
            raise ConfigError(f"{worker.key('id')}: required")
        if not address:
            raise ConfigError(f"{worker.key('address')}: required")
        backend = worker.string("backend", "native") or "native"
        kv_endpoint = worker.string("kv_events_endpoint", None)
        kv_replay = worker.string("kv_events_replay_endpoint", None)
        worker.done()
        workers.append(WorkerEndpoint(worker_id, address, backend, kv_endpoint, kv_replay))
    config = PoolConfig(
        stage=stage,
        workers=tuple(workers),
        policy=table.string("policy", None),
        max_in_flight_per_worker=table.integer("max_in_flight_per_worker", 256, minimum=1),
        policy_options=table.mapping("policy_options"),
        model=table.string("model", None),
        lora_loading=table.boolean("lora_loading", False),
        encoder_reuse=_encoder_reuse(table),
        kv_events=_kv_events(table),
        local_prefill_below_tokens=table.integer("local_prefill_below_tokens", 0, minimum=0),
    )
    table.done()
    return config


def _kv_events(table: ConfigTable) -> KVEventsSettings:
    """A pool's ``kv_events``, ``kv_events_port``, ``kv_events_replay_port``,
    ``kv_events_topic`` and ``kv_index_max_blocks[_per_worker]`` (see
    ``kv_settings.KVEventsSettings``)."""
    default = KVEventsSettings()
    port = table.integer("kv_events_port", 0, minimum=1) if table.has("kv_events_port") else None
    replay = (
        table.integer("kv_events_replay_port", 0, minimum=1)
        if table.has("kv_events_replay_port")
        else None
    )
    return KVEventsSettings(
        enabled=table.boolean("kv_events", default.enabled),
        port=port,
        replay_port=replay,
        topic=table.string("kv_events_topic", default.topic) or "",
        max_blocks_per_worker=table.integer(
            "kv_index_max_blocks_per_worker", default.max_blocks_per_worker, minimum=1
        ),
        max_blocks=table.integer("kv_index_max_blocks", default.max_blocks, minimum=1),
    )


def _encoder_reuse(table: ConfigTable) -> EncoderReuse:
    """A pool's ``reuse``, ``reuse_ttl_s``, ``reuse_scope``, ``reuse_max_entries`` and
    ``reuse_max_bytes`` (see ``encoder_cache.EncoderReuse``)."""
    default = EncoderReuse()
    reuse = EncoderReuse(
        mode=table.string("reuse", default.mode) or default.mode,
        ttl_s=table.number("reuse_ttl_s", default.ttl_s),
        scope=table.string("reuse_scope", default.scope) or default.scope,
        max_entries=table.integer("reuse_max_entries", default.max_entries, minimum=1),
        max_bytes=table.integer("reuse_max_bytes", default.max_bytes, minimum=1),
    )
    reuse.check(table.path)
    return reuse


def parse_host_port(text: str, *, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) -> (host, port).

    Raises:
        ConfigError: naming ``key``.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: {text!r} is not HOST:PORT")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{key}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range")
    return host, port
