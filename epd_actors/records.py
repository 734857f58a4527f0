"""Value records built once per output token: read-only to the type checker, cheap to build.

A frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``, one more call per field; on CPython 3.11 a ten-field
frozen record costs about three times as much to build as the same class with
plain slots (``benchmarks/per_token_cost.py``'s ``record`` lines: 2.0 µs
against 0.6 µs for a ``Delta``).  The router builds a
few of them for every token it relays (the engine's delta, the caller's
event, the server-sent event it came in), so :func:`token_record` makes
such a class a slots dataclass whose fields the type checker treats as
frozen (``typing.dataclass_transform(frozen_default=True)``): ``mypy``
rejects an assignment to a field, as it does for ``frozen=True``, and an
instance hashes and compares by its fields, as a frozen one does.  What
the run time does not do is refuse the assignment; the package never
assigns to them, and ``mypy --strict`` over the package holds it to that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar, dataclass_transform

_Record = TypeVar("_Record", bound=type)


@dataclass_transform(frozen_default=True)
def token_record(cls: _Record) -> _Record:
    """``cls`` as a slots dataclass, frozen to the type checker (see the module docstring)."""
    make: Any = dataclass(slots=True, unsafe_hash=True)
    made: _Record = make(cls)
    return made
