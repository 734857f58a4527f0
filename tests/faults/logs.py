"""Catching what the front ends log at error level: a client's fault must never show there."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

FRONT_END_LOGGER = "epd_actors.frontends"


class ErrorRecords(logging.Handler):
    """Collects records at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def front_end_errors() -> Iterator[ErrorRecords]:
    """The front ends' error records while the block runs."""
    handler = ErrorRecords()
    logger = logging.getLogger(FRONT_END_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
