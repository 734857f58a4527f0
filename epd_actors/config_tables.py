"""Typed reading of one TOML table: each getter pops its key, and leftovers are refused.

Every error is a ``ConfigError`` naming the full key (``pools.decode.policy``);
the configuration file (:mod:`epd_actors.program.config_file`) and the
components that read their own tables (discovery kinds, for instance) share
this reader.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import TypeVar

from .errors import ConfigError


class _AskedDict(dict[str, object]):
    """A dict that remembers every key it was asked about (for "did you mean")."""

    def __init__(self, data: dict[str, object]) -> None:
        super().__init__(data)
        self.asked: set[str] = set()

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return super().__contains__(key)

    def pop(self, key: str, *default: object) -> object:
        self.asked.add(key)
        return super().pop(key, *default)


class ConfigTable:
    """Reads one TOML table; each getter pops its key; ``done()`` refuses leftovers.

    ``done()`` names each leftover key, with the closest key the reader asked
    for when one is close (``difflib``): ``did you mean server.http_listen?``.
    """

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'config'}: expected a table")
        self._data = _AskedDict(data)
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

    def table(self, name: str) -> ConfigTable:
        return ConfigTable(self._data.pop(name, {}), self.key(name))

    def tables(self, name: str) -> list[ConfigTable]:
        value = self._data.pop(name, [])
        if not isinstance(value, list):
            raise ConfigError(f"{self.key(name)}: expected an array of tables")
        return [ConfigTable(item, f"{self.key(name)}[{i}]") for i, item in enumerate(value)]

    def stage_tables(self) -> list[tuple[str, list[ConfigTable]]]:
        """Every remaining key, as a table or an array of tables, by name."""
        found: list[tuple[str, list[ConfigTable]]] = []
        for name in list(self._data):
            if isinstance(self._data[name], list):
                found.append((name, self.tables(name)))
            else:
                found.append((name, [self.table(name)]))
        return found

    def remaining_tables(self) -> list[tuple[str, ConfigTable]]:
        names = list(self._data)
        return [(n, ConfigTable(self._data.pop(n), self.key(n))) for n in names]

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
            known = sorted(self._data.asked - set(self._data))
            unknown = ", ".join(self.key(k) + _suggestion(k, known, self) for k in self._data)
            raise ConfigError(f"unknown key(s): {unknown}")


def _suggestion(name: str, known: list[str], table: ConfigTable) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f" (did you mean {table.key(close[0])}?)" if close else ""


_T = TypeVar("_T")


def read_settings(table: ConfigTable, cls: type[_T], **fixed: object) -> _T:
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
