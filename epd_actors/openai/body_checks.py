"""Checks both front ends make on a request body decoded from JSON (sans-IO).

Lone surrogates
---------------
JSON lets a string hold ``"\\ud800"``: half of a UTF-16 surrogate pair with no
other half.  ``json.loads`` turns it into a ``str`` that is not valid Unicode;
nothing complains until something encodes it (the native msgpack encoder, a
UTF-8 write), far from the request, where it would be a 500.  It is the
client's error, so the front ends refuse it at the door with a 400 naming the
field (:func:`reject_lone_surrogates`).

Most bodies cannot hold one, and that is cheap to know from the raw text: a
lone surrogate in a decoded string comes from a ``\\uD800``-``\\uDFFF`` escape
(hex digits in either case), and, for bytes, also from a UTF-8-encoded
surrogate (``json.loads`` decodes bytes with ``surrogatepass``) or from a body
in UTF-16 or UTF-32.  Only a body where one of those shows is walked to find
the field; a valid pair (``"\\ud83d\\ude00"``, an emoji) is found by the scan
and then passes the walk.

Unknown models
--------------
:func:`unknown_model` is the one 404 both front ends give for a model the
router does not serve.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final

from ..errors import InvalidRequest
from .errors import HttpError

PathPart = str | int
"""An object key or an array index on the way from the body to a value."""

_Step = tuple[PathPart, "_Step | None"]
"""The last part of a path, and the step before it (None at the top)."""

_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_OR_BYTES: Final = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONE_SURROGATE: Final = re.compile(r"[\ud800-\udfff]")  # pairs were joined by the decoder
_UTF8: Final = ("utf-8", "utf-8-sig")
_NOT_UNICODE: Final = (
    "is not valid Unicode: it holds a lone surrogate (a \\ud800-\\udfff escape without its pair)"
)


@dataclass(frozen=True, slots=True)
class LoneSurrogate:
    """Where a lone surrogate is: the path to the string, or to the object whose key holds it."""

    path: tuple[PathPart, ...]
    in_key: bool = False


def may_hold_lone_surrogate(raw: str | bytes) -> bool:
    """Whether the JSON text ``raw`` can decode to a string holding a lone surrogate.

    False is certain; True means "walk the decoded value to be sure".
    """
    if isinstance(raw, str):
        return _SURROGATE_ESCAPE.search(raw) is not None
    if json.detect_encoding(raw) not in _UTF8:
        return True
    return _SURROGATE_ESCAPE_OR_BYTES.search(raw) is not None


def find_lone_surrogate(value: object) -> LoneSurrogate | None:
    """The first lone surrogate in ``value`` (a decoded JSON value), in document order.

    Iterative, and linear in the size of ``value`` at any depth: each pending
    item links to its parent's step, and a path is only spelled out when found.
    """
    pending: list[tuple[object, _Step | None]] = [(value, None)]
    while pending:
        item, step = pending.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return LoneSurrogate(_path_of(step))
        elif isinstance(item, dict):
            if any(_has_lone_surrogate(key) for key in item):
                return LoneSurrogate(_path_of(step), in_key=True)
            children = [(child, (key, step)) for key, child in item.items()]
            pending.extend(entry for entry in reversed(children) if _worth_a_look(entry[0]))
        elif isinstance(item, list):
            pending.extend(
                (item[index], (index, step))
                for index in reversed(range(len(item)))
                if _worth_a_look(item[index])
            )
    return None


def reject_lone_surrogates(raw: str | bytes, value: object) -> None:
    """Refuse ``value`` (decoded from ``raw``) if any string in it holds a lone surrogate.

    Raises:
        InvalidRequest: ``param`` names the field as a dotted path
            (``messages[0].content[1].text``); for a key, the object holding it.
    """
    if not may_hold_lone_surrogate(raw):
        return
    found = find_lone_surrogate(value)
    if found is not None:
        raise lone_surrogate_error(found)


def lone_surrogate_error(found: LoneSurrogate, *, within: int = 0) -> InvalidRequest:
    """The 400 for ``found``, naming the path after its first ``within`` parts.

    The message never quotes the string: the answer must itself be valid Unicode.
    """
    param = dotted_path(found.path[within:]) or None
    if found.in_key:
        where = f"an object key in {param}" if param else "an object key"
        return InvalidRequest(f"{where} {_NOT_UNICODE}", param=param)
    return InvalidRequest(f"{param or 'the body'} {_NOT_UNICODE}", param=param)


def dotted_path(path: tuple[PathPart, ...]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content`` (as the parser names fields)."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def unknown_model(model: str) -> HttpError:
    """The 404 for a model the router does not serve (``model_not_found``)."""
    return HttpError(
        404,
        f"the model {model!r} does not exist",
        type="not_found_error",
        code="model_not_found",
        param="model",
    )


def _path_of(step: _Step | None) -> tuple[PathPart, ...]:
    parts: list[PathPart] = []
    while step is not None:
        part, step = step
        parts.append(part)
    return tuple(reversed(parts))


def _has_lone_surrogate(text: str) -> bool:
    return not text.isascii() and _LONE_SURROGATE.search(text) is not None


def _worth_a_look(value: object) -> bool:
    return isinstance(value, str | dict | list)
