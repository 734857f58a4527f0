"""What ``check-config`` finds in a configuration: every error, the warnings, the secrets.

Theory of operation
-------------------
The reader of the configuration file stops at the first error, which suits a
start but not a check.  :func:`check_tables` works on a copy of the parsed
TOML:

1. *secrets*: every ``*_env`` key names an environment variable and every
   ``*_file`` key a file; those a real start would miss are listed
   (:attr:`ConfigReport.secrets`) and stood in for by a placeholder, so the
   structure is checked on a machine that does not hold the secrets;
2. *errors*: the file is read as a start reads it; each error names its key,
   that key is taken out of the copy and the file read again, until it reads
   (or an error names no key that can be taken out), so one run reports
   every independent error;
3. *warnings*, on what reads: a pool with no worker and no discovery to fill
   it, a listener on a non-loopback address without API keys, and a hint for
   a native worker whose address is ``http://`` (``backend = "openai_http"``).
"""

from __future__ import annotations

import copy
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ..errors import ConfigError
from .config_file import FileConfig, parse_config, parse_host_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

MAX_ERRORS: Final = 50
PLACEHOLDER: Final = "placeholder-for-check-config"
_KEY_PATH: Final = re.compile(r"^([A-Za-z0-9_\-]+(?:\[\d+\])?(?:\.[A-Za-z0-9_\-]+(?:\[\d+\])?)*)")
_UNKNOWN: Final = "unknown key(s): "


@dataclass(slots=True)
class ConfigReport:
    """The outcome of :func:`check_tables`.

    Attributes:
        config: the configuration as a start would read it (None: errors).
        errors: every error found, in the order found.
        warnings: legal but probably unintended settings.
        secrets: what a real start needs that this environment lacks.
    """

    config: FileConfig | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)


def check_tables(
    data: dict[str, object],
    *,
    environ: dict[str, str] | None = None,
    check: Callable[[FileConfig], None] | None = None,
) -> ConfigReport:
    """Check parsed TOML tables (see the module docstring); never raises ``ConfigError``.

    Args:
        data: the parsed TOML (not modified).
        environ: the environment a start would see (default: this process's).
        check: a further check of what reads (the topology check), whose
            ``ConfigError`` is reported too.
    """
    env = dict(os.environ if environ is None else environ)
    tables = copy.deepcopy(data)
    report = ConfigReport()
    report.secrets = _stand_in_for_secrets(tables, env)
    report.warnings += _http_address_hints(tables)
    named: set[str] = set()
    for _ in range(MAX_ERRORS):
        try:
            config = parse_config(tables, environ=env)
            if check is not None:
                check(config)
        except ConfigError as exc:
            message = str(exc)
            key = message if message.startswith(_UNKNOWN) else message.partition(":")[0]
            if key in named:
                break  # a consequence of taking that key out (now "required"): stop there
            named.add(key)
            report.errors.append(message)
            if not _remove_named_keys(tables, message):
                break
            continue
        if not report.errors:
            report.config = config
            report.warnings += _warnings(config)
        break
    return report


# ---------------------------------------------------------------- secrets


def _stand_in_for_secrets(tables: dict[str, object], env: dict[str, str]) -> list[str]:
    needed: list[str] = []
    for path, table in _tables(tables, ""):
        for key, value in list(table.items()):
            if not isinstance(value, str):
                continue
            full = f"{path}.{key}" if path else key
            if key.endswith("_env") and value not in env:
                needed.append(f"environment variable {value} ({full})")
                env[value] = PLACEHOLDER
            elif key.endswith("_file") and not os.access(value, os.R_OK):
                needed.append(f"file {value} ({full})")
                del table[key]
                table[key.removesuffix("_file")] = PLACEHOLDER
    return needed


def _tables(value: object, path: str) -> Iterator[tuple[str, dict[str, object]]]:
    """Every table under ``value`` with its dotted path (arrays of tables indexed)."""
    if isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            yield from _tables(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _tables(item, f"{path}[{index}]")


# ---------------------------------------------------------------- errors


def _remove_named_keys(tables: dict[str, object], message: str) -> bool:
    """Take the key(s) ``message`` names out of ``tables``; whether any was found."""
    if message.startswith(_UNKNOWN):
        names = [item.split(" (did you mean", 1)[0].strip() for item in _split_unknown(message)]
    else:
        match = _KEY_PATH.match(message)
        names = [match.group(1)] if match and ":" in message else []
    removed = [_remove(tables, name) for name in names]  # every one, not up to the first
    return any(removed)


def _split_unknown(message: str) -> list[str]:
    return [part for part in message[len(_UNKNOWN) :].split(", ") if part]


def _remove(tables: dict[str, object], dotted: str) -> bool:
    parts: list[str | int] = []
    for segment in dotted.split("."):
        name, _, index = segment.partition("[")
        parts.append(name)
        if index:
            parts.append(int(index.rstrip("]")))
    node: object = tables
    for part in parts[:-1]:
        if not _holds(node, part):
            return False
        node = node[part]  # type: ignore[index]
    if not _holds(node, parts[-1]):
        return False
    del node[parts[-1]]  # type: ignore[attr-defined]
    return True


def _holds(node: object, part: str | int) -> bool:
    if isinstance(node, dict):
        return isinstance(part, str) and part in node
    return isinstance(node, list) and isinstance(part, int) and part < len(node)


# ---------------------------------------------------------------- warnings


def _warnings(config: FileConfig) -> list[str]:
    warnings: list[str] = []
    router, server = config.router, config.server
    if config.discovery is None:
        for pool in router.pools:
            if not pool.workers:
                warnings.append(
                    f"pool {router.pool_name(pool)} has no workers and no [discovery] "
                    "fills it: every request that needs it fails"
                )
    if not server.http.api_keys:
        listens = [("server.http_listen", server.http_listen)]
        if server.ws_listen is not None:
            listens.append(("server.ws_listen", server.ws_listen))
        for key, listen in listens:
            host, _ = parse_host_port(listen, key=key)
            if not _loopback(host):
                warnings.append(
                    f"{key} = {listen!r} is reachable from other machines and no API key "
                    "is set (server.api_keys / api_keys_env): anyone who reaches it may use it"
                )
    return warnings


def _loopback(host: str | None) -> bool:
    if host is None:
        return False  # every interface
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to


def _http_address_hints(tables: dict[str, object]) -> list[str]:
    hints: list[str] = []
    for path, table in _tables(tables.get("pools", {}), "pools"):
        address = table.get("address")
        if (
            isinstance(address, str)
            and address.startswith(("http://", "https://"))
            and table.get("backend", "native") != "openai_http"
        ):
            hints.append(
                f"{path}.address = {address!r} is an HTTP server: a `vllm serve` instance "
                'is reached with backend = "openai_http" (the native backend speaks tcp://)'
            )
    return hints
