"""Field-level validation and conversion between wire maps and message dataclasses.

Theory of operation: every wire message and every nested structure is a frozen,
slotted dataclass.  At import time :func:`compile_struct` reads a class's type
hints once and builds, per field, a *checker* (wire value -> Python value, raising
``RemoteProtocolError`` with the dotted path of the bad field) and an *emitter*
(Python value -> msgpack-native value).  Decoding a map therefore costs one
dictionary walk with precompiled checks; there is no reflection per message.

The set of supported annotations is deliberately small: ``str``, ``int``,
``float``, ``bool``, ``bytes``, ``X | None``, ``str | int``, ``tuple[X, ...]``,
``dict[str, float]``, ``dict[str, object]`` (opaque msgpack-native maps, used for
vLLM's transfer parameters) and nested structs.  Anything else is a programming
error reported at import time.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import LocalProtocolError, RemoteProtocolError

Checker = Callable[[object, str], object]
Emitter = Callable[[Any], object]

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def _type_name(value: object) -> str:
    return type(value).__name__


def _fail(path: str, expected: str, value: object) -> typing.NoReturn:
    raise RemoteProtocolError(f"{path}: expected {expected}, got {_type_name(value)}")


def _check_str(value: object, path: str) -> object:
    if type(value) is not str:
        _fail(path, "str", value)
    return value


def _check_int(value: object, path: str) -> object:
    if type(value) is not int:
        _fail(path, "int", value)
    return value


def _check_float(value: object, path: str) -> object:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        return float(value)  # type: ignore[arg-type]
    _fail(path, "float", value)


def _check_bool(value: object, path: str) -> object:
    if type(value) is not bool:
        _fail(path, "bool", value)
    return value


def _check_bytes(value: object, path: str) -> object:
    if type(value) is not bytes:
        _fail(path, "bytes", value)
    return value


def _check_keys(value: dict[object, object], path: str) -> None:
    for key in value:
        if type(key) is not str:
            raise RemoteProtocolError(f"{path}: map keys must be str, got {_type_name(key)}")


def _check_opaque_map(value: object, path: str) -> object:
    if type(value) is not dict:
        _fail(path, "map", value)
    # Map keys must be str at every depth (msgpack's strict_map_key lets bin keys
    # through).  Iterative: nesting may be as deep as msgpack's own limit.
    pending: list[tuple[object, str]] = [(value, path)]
    while pending:
        container, where = pending.pop()
        children: typing.Iterable[tuple[str, object]]
        if type(container) is dict:
            _check_keys(container, where)
            children = ((f"{where}.{k}", v) for k, v in container.items())
        else:
            items = typing.cast("list[object]", container)
            children = ((f"{where}[{i}]", v) for i, v in enumerate(items))
        for child_path, child in children:
            if type(child) is dict or type(child) is list:
                pending.append((child, child_path))
    return value


def _check_float_map(value: object, path: str) -> object:
    if type(value) is not dict:
        _fail(path, "map", value)
    _check_keys(value, path)
    return {key: _check_float(item, f"{path}.{key}") for key, item in value.items()}


_EXACT_TYPES = (int, str, bool, bytes)
"""Scalars whose check is an exact type test: a value of that very type is valid as it is."""

_SCALARS: dict[object, tuple[Checker, str]] = {
    str: (_check_str, "str"),
    int: (_check_int, "int"),
    float: (_check_float, "float"),
    bool: (_check_bool, "bool"),
    bytes: (_check_bytes, "bytes"),
}


def _identity(value: Any) -> object:
    return value


def _compile(annotation: object) -> tuple[Checker, Emitter]:
    """Build the checker and emitter for one annotation."""
    if annotation in _SCALARS:
        return _SCALARS[annotation][0], _identity
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        return _compile_union(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _compile_tuple(args[0])
    if origin is dict and args == (str, float):
        return _check_float_map, _identity
    if origin is dict and args == (str, object):
        return _check_opaque_map, _identity
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        struct = compile_struct(annotation)
        return struct.check, struct.emit
    raise TypeError(f"unsupported wire annotation: {annotation!r}")


def _compile_union(args: tuple[object, ...]) -> tuple[Checker, Emitter]:
    members = [a for a in args if a is not type(None)]
    optional = len(members) != len(args)
    if len(members) == 1:
        inner_check, inner_emit = _compile(members[0])
    elif all(m in _SCALARS for m in members):
        exact = tuple(typing.cast("type", m) for m in members)
        expected = " | ".join(_SCALARS[m][1] for m in members)

        def inner_check(value: object, path: str) -> object:
            if type(value) not in exact:
                _fail(path, expected, value)
            return value

        inner_emit = _identity
    else:
        raise TypeError(f"unsupported union on the wire: {args!r}")
    if not optional:
        return inner_check, inner_emit

    def check_optional(value: object, path: str) -> object:
        return None if value is None else inner_check(value, path)

    def emit_optional(value: Any) -> object:
        return None if value is None else inner_emit(value)

    return check_optional, emit_optional


def _compile_tuple(item: object) -> tuple[Checker, Emitter]:
    item_check, item_emit = _compile(item)
    # Items whose check is an exact type test (token ids, strings) are checked
    # in one pass without building a path per item; the item-by-item pass,
    # which names the bad item, runs only when that finds a mismatch.
    exact = item if item in _EXACT_TYPES else None

    def check(value: Any, path: str) -> object:  # Any: no cast call per array
        if type(value) not in (tuple, list):
            _fail(path, "array", value)
        if exact is not None:
            for v in value:  # a plain loop: no generator to set up for a short array
                if type(v) is not exact:
                    break
            else:
                return tuple(value)
        return tuple(item_check(v, f"{path}[{i}]") for i, v in enumerate(value))

    if item_emit is _identity:
        return check, _identity

    def emit(value: Any) -> object:
        return [item_emit(v) for v in value]

    return check, emit


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    check: Checker
    emit: Emitter
    required: bool
    nullable: bool  # ``None`` is valid as it is: no call to ``check`` for it
    exact: type | None  # one of ``_EXACT_TYPES``: a value of exactly that type is valid as it is
    omit_none: bool  # the default is ``None``: a ``None`` value is left off the wire


class Struct:
    """The compiled wire form of one dataclass: check (map -> instance) and emit.

    Decoding walks the keys the map has (not every field the class has), and
    takes a value whose type is exactly the field's scalar type without a
    call; encoding leaves off a field whose value is ``None`` when that is
    its default, which a receiver reads back as the same value.
    """

    __slots__ = ("allowed", "cls", "fields", "names", "required", "specs", "tag")

    def __init__(self, cls: type, fields: tuple[_Field, ...], tag: str | None) -> None:
        self.cls = cls
        self.fields = fields
        self.names = frozenset(f.name for f in fields)
        # Only a tagged (top-level) struct carries the ``type`` key.
        self.allowed = self.names if tag is None else self.names | {"type"}
        self.required = frozenset(f.name for f in fields if f.required)
        self.tag = tag
        # Per field, what the check loop needs, with the field's path in a
        # top-level message (whose path is its tag) built once, not per frame.
        self.specs = {f.name: (f.exact, f.nullable, f.check, f"{tag}.{f.name}") for f in fields}

    def check(self, data: Any, path: str) -> object:
        """Validate a decoded map and build the dataclass instance."""
        if type(data) is not dict:
            _fail(path, "map", data)
        if not self.allowed.issuperset(data):
            unknown = next(key for key in data if key not in self.allowed)
            raise RemoteProtocolError(f"{path}: unknown field {unknown!r}")
        tagged = path == self.tag
        specs = self.specs
        kwargs: dict[str, object] = {}
        for name, item in data.items():
            spec = specs.get(name)
            if spec is None:
                continue  # the ``type`` tag
            exact, nullable, check, tagged_path = spec
            if type(item) is exact or (item is None and nullable):
                kwargs[name] = item
            else:
                kwargs[name] = check(item, tagged_path if tagged else f"{path}.{name}")
        if not self.required.issubset(data):
            missing = next(f.name for f in self.fields if f.required and f.name not in data)
            raise RemoteProtocolError(f"{path}: missing field {missing!r}")
        try:
            return self.cls(**kwargs)
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"{path}: {exc}") from None

    def emit(self, value: Any) -> dict[str, object]:
        """Turn an instance into a msgpack-native map (with its ``type`` tag, if any)."""
        out: dict[str, object] = {} if self.tag is None else {"type": self.tag}
        for field in self.fields:
            item = getattr(value, field.name)
            if item is None and field.omit_none:
                continue
            out[field.name] = field.emit(item)
        return out


_STRUCTS: dict[type, Struct] = {}


def compile_struct(cls: type, tag: str | None = None) -> Struct:
    """Compile (once) and return the wire form of dataclass ``cls``."""
    cached = _STRUCTS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        check, emit = _compile(annotation)
        required = f.default is _MISSING and f.default_factory is _MISSING
        members = typing.get_args(annotation)
        nullable = type(None) in members
        scalar = annotation
        if nullable and len(members) == 2:
            scalar = next(m for m in members if m is not type(None))
        exact = scalar if scalar in _EXACT_TYPES else None
        omit_none = nullable and f.default is None
        fields.append(_Field(f.name, check, emit, required, nullable, exact, omit_none))
    struct = Struct(cls, tuple(fields), tag)
    _STRUCTS[cls] = struct
    return struct


def require(condition: bool, message: str) -> None:
    """Raise ``LocalProtocolError`` unless ``condition``; used by ``__post_init__`` checks."""
    if not condition:
        raise LocalProtocolError(message)
