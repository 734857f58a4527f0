"""Media items of OpenAI requests: inline data, the allow-list, and bounded fetching.

Theory of operation
-------------------
A chat content part names its media in one of three ways:

* ``data:<mime>;base64,<payload>`` (or ``input_audio``'s bare base64): decoded
  synchronously, while the request is parsed, after a size estimate taken from
  the encoded length (nothing over the limit is ever decoded).
* ``http://`` / ``https://`` URLs and local files (``file://`` URLs or absolute
  paths): refused unless :class:`MediaPolicy` allows them -- the default policy
  allows nothing.  An allowed reference is *not* fetched while parsing (parsing
  is pure); the parser leaves a :class:`PendingMedia` in its slot, and the front
  end loads it (:func:`epd_actors.frontends.media_fetch.resolve_media`) before
  it hands the request to the router.

The policy is checked twice for local files: lexically at parse time (no ``..``
segment, under an allowed directory) and again after resolving symlinks, just
before the read, so a symlink cannot lead out of an allowed directory.  URLs
are compared by scheme, host and port, and by path prefix on ``/`` boundaries,
never as raw string prefixes (``https://cdn.example`` must not allow
``https://cdn.example.evil``); redirects are not followed, since a redirect
could leave the allow-list.

Every item becomes a :class:`~epd_actors.protocol.MediaItem`: the original
bytes, a ``type/subtype`` mime type whose top-level type is the part's
modality, and the SHA-256 hex digest of the bytes (the encoder-cache key).
Every failure is an :class:`~epd_actors.errors.InvalidRequest` naming the
field (``messages[0].content[1].image_url``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError, InvalidRequest
from ..protocol import MediaItem

if TYPE_CHECKING:
    from collections.abc import Sequence


MIB: Final = 1024 * 1024

_MIME: Final = re.compile(r"^([a-z]+)/[a-z0-9][a-z0-9.+\-]{0,99}$")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Which media references beyond inline ``data:`` URLs a request may use.

    The default allows none: remote fetching and local file access are opt-in.

    Attributes:
        url_prefixes: allowed ``http(s)://host[:port]/path/`` prefixes; a URL is
            allowed when scheme, host and port are equal and its path is under
            the prefix's path (on a ``/`` boundary).
        local_dirs: allowed absolute directories; a path is allowed when it lies
            under one of them after ``..`` and symlinks are resolved.
    """

    url_prefixes: tuple[str, ...] = ()
    local_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for index, prefix in enumerate(self.url_prefixes):
            if _url_key(prefix) is None:
                raise ConfigError(
                    f"media.url_prefixes[{index}]: {prefix!r} is not an http(s) URL with a host"
                )
        for index, directory in enumerate(self.local_dirs):
            if not directory.startswith("/") or ".." in directory.split("/"):
                raise ConfigError(
                    f"media.local_dirs[{index}]: {directory!r} must be an absolute path"
                )

    def allows_url(self, url: str) -> bool:
        """Whether ``url`` (http or https) lies under an allowed prefix."""
        key = _url_key(url)
        if key is None:
            return False
        for prefix in self.url_prefixes:
            allowed = _url_key(prefix)
            if allowed is not None and allowed[:3] == key[:3] and is_under(key[3], allowed[3]):
                return True
        return False

    def allowed_path(self, path: str) -> str | None:
        """The normalised path if ``path`` lies lexically under an allowed directory."""
        if not path.startswith("/") or ".." in path.split("/") or "\x00" in path:
            return None
        normal = posixpath.normpath(path)
        for directory in self.local_dirs:
            if is_under(normal, posixpath.normpath(directory)):
                return normal
        return None


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What media one request may carry: how many items, how big, from where.

    Attributes:
        max_items: media items per request.
        max_item_bytes: decoded bytes of one item.
        max_total_bytes: decoded bytes of all of a request's items together.
        fetch_timeout_s: seconds one remote or local fetch may take.
        policy: which URLs and local directories may be used (default: none).
    """

    max_items: int = 16
    max_item_bytes: int = 16 * MIB
    max_total_bytes: int = 32 * MIB
    fetch_timeout_s: float = 10.0
    policy: MediaPolicy = MediaPolicy()


@dataclass(frozen=True, slots=True)
class PendingMedia:
    """An allowed remote URL or local file, still to be loaded by the front end.

    Attributes:
        source: the URL, or the normalised absolute path of a local file.
        local: True for a local file.
        modality: ``image``, ``audio`` or ``video``.
        param: the request field that named it (for error messages).
    """

    source: str
    local: bool
    modality: str
    param: str


MediaSlot = MediaItem | PendingMedia


class MediaBudget:
    """Counts a request's media items and bytes against its :class:`MediaLimits`."""

    __slots__ = ("_bytes", "_items", "limits")

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self._items = 0
        self._bytes = 0

    def take_item(self, param: str) -> None:
        """Count one more item.

        Raises:
            InvalidRequest: more than ``max_items`` items.
        """
        self._items += 1
        if self._items > self.limits.max_items:
            raise InvalidRequest(
                f"too many media items (at most {self.limits.max_items} per request)", param=param
            )

    def take_bytes(self, size: int, param: str) -> None:
        """Count ``size`` decoded bytes of one item.

        Raises:
            InvalidRequest: the item or the request's total is over its limit.
        """
        if size > self.limits.max_item_bytes:
            raise InvalidRequest(
                f"media item of {size} bytes exceeds the limit of "
                f"{self.limits.max_item_bytes} bytes",
                param=param,
            )
        self._bytes += size
        if self._bytes > self.limits.max_total_bytes:
            raise InvalidRequest(
                f"the request's media exceed {self.limits.max_total_bytes} bytes in total",
                param=param,
            )


def media_item(data: bytes, mime_type: str) -> MediaItem:
    """A :class:`MediaItem` of ``data`` with its SHA-256 content hash."""
    return MediaItem(mime_type, data, hashlib.sha256(data).hexdigest())


def decode_base64(payload: str, mime_type: str, *, budget: MediaBudget, param: str) -> MediaItem:
    """Decode standard base64 ``payload`` into an item, refusing oversize input unread.

    Raises:
        InvalidRequest: too large, or not valid base64.
    """
    budget.take_bytes(len(payload) * 3 // 4 - payload[-2:].count("="), param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"invalid base64 data: {exc}", param=param) from None
    if not data:
        raise InvalidRequest("media data is empty", param=param)
    return media_item(data, mime_type)


def media_from_data_url(url: str, modality: str, *, budget: MediaBudget, param: str) -> MediaItem:
    """Decode a ``data:<mime>;base64,<payload>`` URL whose mime type is of ``modality``.

    Raises:
        InvalidRequest: malformed URL, wrong or unknown mime type, not base64, too large.
    """
    header, comma, payload = url[len("data:") :].partition(",")
    fields = header.split(";")
    if not comma or fields[-1].lower() != "base64":
        raise InvalidRequest("a data: URL must be data:<mime>;base64,<payload>", param=param)
    mime = fields[0].strip().lower()
    return decode_base64(payload, check_mime(mime, modality, param), budget=budget, param=param)


def check_mime(mime: str, modality: str, param: str) -> str:
    """Return ``mime`` if it is a well-formed ``type/subtype`` of ``modality``.

    Raises:
        InvalidRequest: otherwise.
    """
    match = _MIME.match(mime)
    if match is None or match.group(1) != modality:
        raise InvalidRequest(f"expected a {modality}/* media type, got {mime!r}", param=param)
    return mime


def classify_reference(
    url: str, modality: str, *, budget: MediaBudget, param: str
) -> MediaItem | PendingMedia:
    """Turn a media URL of a content part into an item (``data:``) or a pending fetch.

    Raises:
        InvalidRequest: a malformed ``data:`` URL, or a reference the policy refuses.
    """
    budget.take_item(param)
    if url[:5].lower() == "data:":
        return media_from_data_url(url, modality, budget=budget, param=param)
    policy = budget.limits.policy
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("http", "https"):
        if not policy.allows_url(url):
            raise InvalidRequest(
                "media URLs are not allowed from this source (only data: URLs unless "
                "the server's media.url_prefixes allow it)",
                param=param,
            )
        return PendingMedia(url, False, modality, param)
    if scheme == "file" or url.startswith("/"):
        path = _file_url_path(url) if scheme == "file" else url
        normal = None if path is None else policy.allowed_path(path)
        if normal is None:
            raise InvalidRequest(
                "local media paths are not allowed (only under the server's media.local_dirs, "
                "without '..')",
                param=param,
            )
        return PendingMedia(normal, True, modality, param)
    raise InvalidRequest("unsupported media URL: use a data: URL", param=param)


# ---------------------------------------------------------------- resolving


def _url_key(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, decoded path) of an http(s) URL without credentials or dot segments."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    path = unquote(parts.path) or "/"
    if "\\" in path or any(segment in (".", "..") for segment in path.split("/")):
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme], path


def is_under(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies below it (``/`` boundaries)."""
    directory = directory.rstrip("/")
    return path == directory or path.startswith(directory + "/")


def _file_url_path(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        return None
    return unquote(parts.path)


def pending_items(media: Sequence[MediaSlot]) -> tuple[PendingMedia, ...]:
    """The slots of ``media`` still waiting to be loaded."""
    return tuple(slot for slot in media if isinstance(slot, PendingMedia))
