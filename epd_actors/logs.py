"""Logging set-up of the program: the level, text or JSON lines, and the access log.

Every module logs to its own named logger; this module only decides where the
records go.  ``--log-level`` sets the root level.  The access log is the logger
:data:`ACCESS_LOGGER`; switching it on (``[server] access_log``,
``--access-log``) makes it emit at INFO whatever the root level, so an
operator gets one line per request without also getting every INFO record.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

ACCESS_LOGGER: Final = "epd_actors.access"
"""One INFO record per answered HTTP request, when the access log is on."""

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, and ``exception`` when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


FORMATTERS: Final[dict[str, Callable[[], logging.Formatter]]] = {
    "text": lambda: logging.Formatter(TEXT_FORMAT),
    "json": lambda: JsonFormatter(),
}
"""``--log-format`` name -> the formatter of every record."""

LOG_FORMATS: Final = tuple(FORMATTERS)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Send every record at ``level`` or above to stderr, as text or JSON lines.

    Raises:
        ValueError: an unknown ``log_format``.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def enable_access_log() -> logging.Logger:
    """The access logger, set to emit its INFO records whatever the root level."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    return logger
