"""Cross-origin resource sharing (CORS) for the HTTP front end: sans-IO header rules.

Browsers call an API on another origin only when its answers say they may
(the Fetch standard's CORS protocol).  :class:`CorsPolicy` holds the allowed
origins (``[server] allowed_origins``, ``serve --allowed-origins``; empty:
no CORS headers at all, so browsers on other origins are refused, as without
this module) and computes the headers:

* a *preflight* (``OPTIONS`` with ``Origin`` and
  ``Access-Control-Request-Method``) from an allowed origin is answered 204
  with ``Access-Control-Allow-Origin``, ``-Allow-Methods`` (the route's),
  ``-Allow-Headers`` (those the browser asked for), ``-Max-Age``;
* every other answer to an allowed origin carries ``Access-Control-Allow-Origin``
  and ``-Expose-Headers`` (``x-request-id``, ``x-epd-timings``), so scripts
  can read them.

Answers that depend on ``Origin`` say ``Vary: Origin`` for caches.  With
``*`` every origin is allowed and ``*`` is what the answers say (credentials
are never allowed: API keys travel in ``Authorization``, which a preflight
lets through as a requested header).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final

from ..errors import ConfigError

Headers = tuple[tuple[str, str], ...]

EXPOSED: Final = "x-request-id, x-epd-timings"
MAX_AGE_S: Final = 600
_ORIGIN: Final = re.compile(r"^[a-z][a-z0-9+.\-]*://[^/?#\s]+$")
_TOKEN: Final = r"[A-Za-z0-9!#$%&'*+.^_`|~\-]+"
_TOKEN_LIST: Final = re.compile(rf"^{_TOKEN}(\s*,\s*{_TOKEN})*$")


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which origins may call the API from a browser.

    Attributes:
        origins: ``scheme://host[:port]`` origins, or ``*`` for any; empty: none.

    Raises:
        ConfigError: an origin that is not ``*`` or ``scheme://host[:port]``.
    """

    origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for origin in self.origins:
            if origin != "*" and not _ORIGIN.match(origin):
                raise ConfigError(
                    f"{origin!r} is not '*' or scheme://host[:port] (no path, no trailing slash)"
                )

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allowed(self, origin: str) -> str | None:
        """What ``Access-Control-Allow-Origin`` says to ``origin``; None: not allowed."""
        if not origin or not self.origins:
            return None
        if "*" in self.origins:
            return "*"
        # Origins compare case-insensitively in scheme and host (RFC 6454 4).
        return origin if origin.lower() in {o.lower() for o in self.origins} else None

    def _vary(self) -> Headers:
        """``Vary: Origin`` unless every origin gets the same answer (``*``)."""
        return () if "*" in self.origins else (("vary", "origin"),)

    def response_headers(self, origin: str) -> Headers:
        """Headers for an ordinary answer to a request from ``origin``."""
        if not self.origins:
            return ()
        allowed = self.allowed(origin)
        vary = self._vary()
        if allowed is None:
            return vary
        return (
            ("access-control-allow-origin", allowed),
            ("access-control-expose-headers", EXPOSED),
            *vary,
        )

    def preflight_headers(self, origin: str, methods: str, requested_headers: str) -> Headers:
        """Headers of the 204 to a preflight from ``origin`` for a route allowing ``methods``.

        The requested headers are echoed when they are a well-formed list of
        header names, else none are allowed (the browser then refuses).
        """
        if not self.origins:
            return ()
        allowed = self.allowed(origin)
        vary = self._vary()
        if allowed is None:
            return vary
        headers: Headers = (
            ("access-control-allow-origin", allowed),
            ("access-control-allow-methods", methods),
            ("access-control-max-age", str(MAX_AGE_S)),
        )
        requested = requested_headers.strip()
        if requested and _TOKEN_LIST.match(requested):
            headers += (("access-control-allow-headers", requested),)
        return (*headers, *vary)


def parse_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: a comma-separated list, or a JSON list as vLLM takes."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except ValueError as exc:
            raise ConfigError(f"--allowed-origins: not a JSON list: {exc}") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ConfigError("--allowed-origins: a JSON list must hold strings")
        origins = tuple(values)
    else:
        origins = tuple(item.strip() for item in stripped.split(",") if item.strip())
    try:
        CorsPolicy(origins)
    except ConfigError as exc:
        raise ConfigError(f"--allowed-origins: {exc}") from None
    return origins
