"""The TOML configuration file: ``python -m epd_actors serve --config epd.toml``.

Theory of operation: :func:`load_config` reads TOML into plain tables and
:func:`parse_config` walks them with a small :class:`_Table` reader that pops
each known key (checking its type and range) and then refuses whatever is
left, so a misspelt key is an error that names it (``server.idel_timeout_s``)
instead of a silently ignored setting.  The result is a :class:`FileConfig`:
the :class:`~epd_actors.config.RouterConfig` plus the front-end settings.

Secrets (worker auth token, API keys, admin key) can be given inline, through
an environment variable (``*_env``), or a file (``*_file``); docs/configuration.md
lists every key with its default.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .config import (
    ActorLimits,
    AdmissionLimits,
    Deadlines,
    PoolConfig,
    RouterConfig,
    WorkerEndpoint,
)
from .errors import ConfigError
from .health import HealthPolicy
from .retry import RetryPolicy

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """Where media may come from besides ``data:`` URLs, and how big it may be.

    Attributes:
        allowed_url_prefixes: http(s) URL prefixes the router may fetch.
        allowed_local_dirs: directories whose files a request may name.
        max_item_bytes: largest media item, decoded.
        fetch_timeout_s: time limit of one fetch.
    """

    allowed_url_prefixes: tuple[str, ...] = ()
    allowed_local_dirs: tuple[str, ...] = ()
    max_item_bytes: int = 20 * MIB
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The front ends.

    Attributes:
        http_listen: ``HOST:PORT`` of the OpenAI-compatible HTTP server.
        ws_listen: ``HOST:PORT`` of the WebSocket server, or None for none.
        api_keys: client keys (``Authorization: Bearer``); empty = open.
        admin_key: key of the admin routes; None disables them.
        max_body_bytes: largest request body.
        max_header_bytes: largest request head.
        idle_timeout_s: keep-alive connection idle limit.
        read_timeout_s: time to receive one request body.
        access_log: log every request.
    """

    http_listen: str = "127.0.0.1:8000"
    ws_listen: str | None = None
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    max_body_bytes: int = 32 * MIB
    max_header_bytes: int = 64 * 1024
    idle_timeout_s: float = 75.0
    read_timeout_s: float = 60.0
    access_log: bool = False
    media: MediaConfig = field(default_factory=MediaConfig)


@dataclass(frozen=True, slots=True)
class FileConfig:
    """Everything a configuration file says."""

    router: RouterConfig
    server: ServerConfig


class _Table:
    """Reads one TOML table; each getter pops its key; ``done()`` refuses leftovers."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'config'}: expected a table")
        self._data = dict(data)
        self._path = path

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

    def table(self, name: str) -> _Table:
        return _Table(self._data.pop(name, {}), self.key(name))

    def tables(self, name: str) -> list[_Table]:
        value = self._data.pop(name, [])
        if not isinstance(value, list):
            raise ConfigError(f"{self.key(name)}: expected an array of tables")
        return [_Table(item, f"{self.key(name)}[{i}]") for i, item in enumerate(value)]

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
    deadlines = _deadlines(top.table("deadlines"))
    actors = _actors(top.table("actors"))
    retries = _retries(top.table("retries"))
    health = _health(top.table("health"))
    admission_table = top.table("admission")
    defaults = AdmissionLimits()
    admission = AdmissionLimits(
        max_requests_in_flight=admission_table.integer(
            "max_requests_in_flight", defaults.max_requests_in_flight, minimum=1
        ),
        retry_after_s=admission_table.number(
            "retry_after_s", defaults.retry_after_s, minimum=0.001
        ),
    )
    admission_table.done()
    pools_table = top.table("pools")
    pools = tuple(_pool(stage, table) for stage, table in pools_table.remaining_tables())
    top.done()
    router = RouterConfig(
        pools,
        auth_token=auth_token,
        model=model,
        deadlines=deadlines,
        actors=actors,
        retries=retries,
        health=health,
        admission=admission,
    )
    return FileConfig(router, server)


def _server(table: _Table, env: dict[str, str]) -> ServerConfig:
    defaults = ServerConfig()
    api_keys = table.strings("api_keys")
    if table.has("api_keys_env"):
        name = table.string("api_keys_env", None)
        assert name is not None
        raw = env.get(name)
        if raw is None:
            raise ConfigError(
                f"{table.key('api_keys_env')}: environment variable {name} is not set"
            )
        api_keys += tuple(k.strip() for k in raw.split(",") if k.strip())
    http_listen = table.string("http_listen", defaults.http_listen) or defaults.http_listen
    ws_listen = table.string("ws_listen", None)
    for key, value in (("http_listen", http_listen), ("ws_listen", ws_listen)):
        if value is not None:
            parse_host_port(value, key=table.key(key))
    config = ServerConfig(
        http_listen=http_listen,
        ws_listen=ws_listen,
        api_keys=api_keys,
        admin_key=table.secret("admin_key", env),
        max_body_bytes=table.integer("max_body_bytes", defaults.max_body_bytes, minimum=1024),
        max_header_bytes=table.integer("max_header_bytes", defaults.max_header_bytes, minimum=1024),
        idle_timeout_s=table.number("idle_timeout_s", defaults.idle_timeout_s, minimum=0.001),
        read_timeout_s=table.number("read_timeout_s", defaults.read_timeout_s, minimum=0.001),
        access_log=table.boolean("access_log", defaults.access_log),
        media=_media(table.table("media")),
    )
    table.done()
    return config


def _media(table: _Table) -> MediaConfig:
    defaults = MediaConfig()
    prefixes = table.strings("allowed_url_prefixes")
    for index, prefix in enumerate(prefixes):
        if not prefix.startswith(("http://", "https://")) or prefix.count("/") < 3:
            raise ConfigError(
                f"{table.key('allowed_url_prefixes')}[{index}]: {prefix!r} must be an "
                "http(s) URL with a path (e.g. https://images.example/public/)"
            )
    config = MediaConfig(
        allowed_url_prefixes=prefixes,
        allowed_local_dirs=table.strings("allowed_local_dirs"),
        max_item_bytes=table.integer("max_item_bytes", defaults.max_item_bytes, minimum=1),
        fetch_timeout_s=table.number("fetch_timeout_s", defaults.fetch_timeout_s, minimum=0.001),
    )
    table.done()
    return config


def _deadlines(table: _Table) -> Deadlines:
    d = Deadlines()
    config = Deadlines(
        request_timeout_s=table.number("request_timeout_s", d.request_timeout_s, minimum=0.001),
        first_token_timeout_s=table.number(
            "first_token_timeout_s", d.first_token_timeout_s, minimum=0.001
        ),
        inter_token_timeout_s=table.number(
            "inter_token_timeout_s", d.inter_token_timeout_s, minimum=0.001
        ),
        cleanup_timeout_s=table.number("cleanup_timeout_s", d.cleanup_timeout_s, minimum=0.001),
    )
    table.done()
    return config


def _actors(table: _Table) -> ActorLimits:
    a = ActorLimits()
    config = ActorLimits(
        inbox_capacity=table.integer("inbox_capacity", a.inbox_capacity),
        max_jobs=table.integer("max_jobs", a.max_jobs, minimum=1),
        restart_backoff_start_s=table.number(
            "restart_backoff_start_s", a.restart_backoff_start_s, minimum=0.001
        ),
        restart_backoff_max_s=table.number(
            "restart_backoff_max_s", a.restart_backoff_max_s, minimum=0.001
        ),
    )
    table.done()
    return config


def _retries(table: _Table) -> RetryPolicy:
    r = RetryPolicy()
    config = RetryPolicy(
        max_attempts=table.integer("max_attempts", r.max_attempts, minimum=1),
        backoff_start_s=table.number("backoff_start_s", r.backoff_start_s),
        backoff_max_s=table.number("backoff_max_s", r.backoff_max_s),
        jitter=table.number("jitter", r.jitter),
    )
    table.done()
    return config


def _health(table: _Table) -> HealthPolicy:
    h = HealthPolicy()
    config = HealthPolicy(
        failure_threshold=table.integer("failure_threshold", h.failure_threshold, minimum=1),
        success_threshold=table.integer("success_threshold", h.success_threshold, minimum=1),
        open_cooldown_s=table.number("open_cooldown_s", h.open_cooldown_s, minimum=0.001),
    )
    table.done()
    return config


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
    )
    table.done()
    return config


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
