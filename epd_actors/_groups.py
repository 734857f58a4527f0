"""Turning a nursery's single-exception group back into that exception, at API edges."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextmanager
def single_exception() -> Iterator[None]:
    """Re-raise the sole non-cancellation leaf of an exception group raised inside.

    Used where a context manager yields inside its own nursery (so the caller's
    exception would otherwise come back wrapped).  Groups with several leaves,
    or with a ``trio.Cancelled`` in them, propagate unchanged: cancellation must
    reach its scope, and several failures are not one.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1 and not isinstance(leaves[0], trio.Cancelled):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception in ``group`` that is not itself a group (for messages)."""
    return next(_leaves(group))
