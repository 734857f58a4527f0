"""The TOML configuration file: ``python -m epd_actors serve --config epd.toml``.

Theory of operation: :func:`load_config` reads TOML into plain tables and
:func:`parse_config` walks them with a small :class:`_Table` reader that pops
each known key (checking its type and range) and then refuses whatever is
left, so a misspelt key is an error that names it (``server.idel_timeout_s``)
instead of a silently ignored setting.  The result is a :class:`FileConfig`:
the :class:`~epd_actors.core.config.RouterConfig` plus the front-end settings.

Secrets (worker auth token, API keys, admin key) can be given inline, through
an environment variable (``*_env``), or a file (``*_file``); docs/configuration.md
lists every key with its default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..backends.native.settings import NativeSettings
from ..backends.openai_http.settings import OpenAIHttpSettings
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
from ..core.retry import RetryPolicy
from ..core.tracing.config import TracingConfig
from ..errors import ConfigError
from ..frontends.http_app import HttpSettings
from ..frontends.ws import WsSettings
from ..lora import LoraAdapter
from ..openai.fields import UNKNOWN_FIELD_CHOICES, FieldPolicy
from ..openai.media import MediaLimits, MediaPolicy

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
    """

    http_listen: str = "127.0.0.1:8000"
    ws_listen: str | None = None
    drain_timeout_s: float = 30.0
    http: HttpSettings = field(default_factory=HttpSettings)
    ws: WsSettings = field(default_factory=WsSettings)
    drain_notice_s: float = 0.0
    processes: int = 1
    metrics_listen: str | None = None


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Everything a configuration file says."""

    router: RouterConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    discovery: DiscoverySettings | None = None
    """``[discovery]``: where workers are found at run time (None: only the listed ones)."""


class _Table:
    """Reads one TOML table; each getter pops its key; ``done()`` refuses leftovers."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'config'}: expected a table")
        self._data = dict(data)
        self._path = path

    @property
    def path(self) -> str:
        return self._path

    def key(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _pop(self, name: str, kinds: tuple[type, ...], what: str) -> object:
        value = self._data.pop(name)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.key(name)}: expected {what}, got a boolean")
        if not isinstance(value, kinds):
            raise ConfigError(f"{self.key(name)}: expected {what}, got {type(value).__name__}")
        return value

    def has(self, name: str) -> bool:
        return name in self._data

    def string(self, name: str, default: str | None) -> str | None:
        if name not in self._data:
            return default
        return str(self._pop(name, (str,), "a string"))

    def number(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        if name not in self._data:
            return default
        value = float(self._pop(name, (int, float), "a number"))  # type: ignore[arg-type]
        if not math.isfinite(value) or value < minimum:
            raise ConfigError(f"{self.key(name)}: must be a finite number >= {minimum:g}")
        return value

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        if name not in self._data:
            return default
        value = self._pop(name, (int,), "an integer")
        assert isinstance(value, int)
        if value < minimum:
            raise ConfigError(f"{self.key(name)}: must be >= {minimum}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        if name not in self._data:
            return default
        return bool(self._pop(name, (bool,), "true or false"))

    def strings(self, name: str) -> tuple[str, ...]:
        if name not in self._data:
            return ()
        value = self._pop(name, (list,), "a list of strings")
        assert isinstance(value, list)
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{self.key(name)}[{index}]: expected a string")
        return tuple(value)

    def mapping(self, name: str) -> dict[str, object]:
        """A sub-table taken whole, as plain values (its reader checks the keys)."""
        value = self._data.pop(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{self.key(name)}: expected a table")
        return dict(value)

    def table(self, name: str) -> _Table:
        return _Table(self._data.pop(name, {}), self.key(name))

    def tables(self, name: str) -> list[_Table]:
        value = self._data.pop(name, [])
        if not isinstance(value, list):
            raise ConfigError(f"{self.key(name)}: expected an array of tables")
        return [_Table(item, f"{self.key(name)}[{i}]") for i, item in enumerate(value)]

    def stage_tables(self) -> list[tuple[str, list[_Table]]]:
        """Every remaining key, as a table or an array of tables, by name."""
        found: list[tuple[str, list[_Table]]] = []
        for name in list(self._data):
            if isinstance(self._data[name], list):
                found.append((name, self.tables(name)))
            else:
                found.append((name, [self.table(name)]))
        return found

    def remaining_tables(self) -> list[tuple[str, _Table]]:
        names = list(self._data)
        return [(n, _Table(self._data.pop(n), self.key(n))) for n in names]

    def secret(self, name: str, environ: dict[str, str]) -> str | None:
        """``name``, ``name_env`` or ``name_file`` (at most one)."""
        given = [k for k in (name, f"{name}_env", f"{name}_file") if k in self._data]
        if len(given) > 1:
            raise ConfigError(f"{self.key(name)}: give only one of {', '.join(given)}")
        if not given:
            return None
        chosen = given[0]
        value = self.string(chosen, None)
        assert value is not None
        if chosen.endswith("_env"):
            if value not in environ:
                raise ConfigError(f"{self.key(chosen)}: environment variable {value} is not set")
            return environ[value]
        if chosen.endswith("_file"):
            try:
                return Path(value).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"{self.key(chosen)}: {exc}") from None
        return value

    def done(self) -> None:
        if self._data:
            unknown = ", ".join(self.key(k) for k in self._data)
            raise ConfigError(f"unknown key(s): {unknown}")


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
    top = _Table(data, "")
    model = top.string("model", "sim-model") or "sim-model"
    auth_token = top.secret("auth_token", env) or ""
    server = _server(top.table("server"), env)
    deadlines = read_settings(top.table("deadlines"), Deadlines)
    actors = read_settings(top.table("actors"), ActorLimits)
    retries = read_settings(top.table("retries"), RetryPolicy)
    health = read_settings(top.table("health"), HealthPolicy)
    admission = read_settings(top.table("admission"), AdmissionLimits)
    native = read_settings(top.table("native"), NativeSettings)
    openai_http_table = top.table("openai_http")
    api_key = openai_http_table.secret("api_key", env)
    openai_http = read_settings(openai_http_table, OpenAIHttpSettings, api_key=api_key)
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


def _discovery(table: _Table, router: RouterConfig) -> DiscoverySettings | None:
    """``[discovery]``: its ``kind`` names a registered kind, which reads the rest."""
    from ..discovery import discovery_kind

    kind = table.string("kind", None)
    if kind is None:
        table.done()
        return None
    return discovery_kind(kind, key=table.key("kind")).parse(table, router)


def _server(table: _Table, env: dict[str, str]) -> ServerConfig:
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
    fields = _field_policy(table)
    media = _media(table.table("media"))
    http = read_settings(
        table.table("http"),
        HttpSettings,
        api_keys=api_keys,
        admin_keys=() if admin_key is None else (admin_key,),
        access_log=access_log,
        media=media,
        fields=fields,
    )
    ws = read_settings(table.table("ws"), WsSettings, api_keys=api_keys, media=media, fields=fields)
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
    )


def _field_policy(table: _Table) -> FieldPolicy:
    choice = table.string("unknown_fields", "reject")
    if choice not in UNKNOWN_FIELD_CHOICES:
        raise ConfigError(
            f"{table.key('unknown_fields')}: must be one of {', '.join(UNKNOWN_FIELD_CHOICES)}, "
            f"got {choice!r}"
        )
    return FieldPolicy(unknown=choice)  # type: ignore[arg-type]


def _media(table: _Table) -> MediaLimits:
    prefixes = table.strings("allowed_url_prefixes")
    local_dirs = table.strings("allowed_local_dirs")
    try:
        policy = MediaPolicy(url_prefixes=prefixes, local_dirs=local_dirs)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{table.key('allowed_url_prefixes')}: {exc}") from None
    return read_settings(table, MediaLimits, policy=policy)


_T = TypeVar("_T")


def read_settings(table: _Table, cls: type[_T], **fixed: object) -> _T:
    """Build the settings dataclass ``cls`` from ``table``, one key per field.

    Fields given in ``fixed`` come from elsewhere and are not read; every
    other field of type int, float, bool, str or tuple of str may appear under
    its own name, defaulting to the dataclass default.  Leftover keys are
    errors.

    Raises:
        ConfigError: a wrong type, a negative number, an unknown key, or a
            value the settings class itself refuses (named by its table).
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = dict(fixed)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in fixed or not table.has(f.name):
            continue
        kind = hints[f.name]
        if kind is bool:
            values[f.name] = table.boolean(f.name, False)
        elif kind is int:
            values[f.name] = table.integer(f.name, 0)
        elif kind is float:
            values[f.name] = table.number(f.name, 0.0)
        elif kind is str:
            values[f.name] = table.string(f.name, "")
        elif kind == tuple[str, ...]:
            values[f.name] = table.strings(f.name)
        else:
            raise ConfigError(f"{table.key(f.name)}: cannot be set in a configuration file")
    table.done()
    try:
        return cls(**values)
    except (ConfigError, ValueError, TypeError) as exc:
        raise ConfigError(f"{table.path or 'config'}: {exc}") from None


def _pools(top: _Table) -> tuple[PoolConfig, ...]:
    """``[pools.STAGE]`` (one pool) or ``[[pools.STAGE]]`` (one per model) for each stage."""
    pools: list[PoolConfig] = []
    for stage, table in top.table("pools").stage_tables():
        pools += [_pool(stage, entry) for entry in table]
    return tuple(pools)


def _model(table: _Table) -> ModelConfig:
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


def _pool(stage: str, table: _Table) -> PoolConfig:
    workers = []
    for worker in table.tables("workers"):
        worker_id = worker.string("id", None)
        address = worker.string("address", None)
        if not worker_id:
            raise ConfigError(f"{worker.key('id')}: required")
        if not address:
            raise ConfigError(f"{worker.key('address')}: required")
        backend = worker.string("backend", "native") or "native"
        worker.done()
        workers.append(WorkerEndpoint(worker_id, address, backend))
    config = PoolConfig(
        stage=stage,
        workers=tuple(workers),
        policy=table.string("policy", None),
        max_in_flight_per_worker=table.integer("max_in_flight_per_worker", 256, minimum=1),
        policy_options=table.mapping("policy_options"),
        model=table.string("model", None),
        lora_loading=table.boolean("lora_loading", False),
        encoder_reuse=_encoder_reuse(table),
    )
    table.done()
    return config


def _encoder_reuse(table: _Table) -> EncoderReuse:
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
