"""Loading the media items a request names by reference: allowed URLs and local files.

The parser (:mod:`epd_actors.openai.media`, pure) leaves a
:class:`~epd_actors.openai.media.PendingMedia` in the slot of every allowed
URL or local file; the front end calls :func:`resolve_media` before it hands
the request to the router.  This module does that I/O: an httpx client that
follows no redirect, bounded reads of local files in a thread (after the
policy is checked again on the resolved path), and one deadline per item.
"""

from __future__ import annotations

import mimetypes
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import trio

from ..errors import InvalidRequest
from ..openai.media import (
    MediaBudget,
    MediaLimits,
    MediaSlot,
    PendingMedia,
    check_mime,
    is_under,
    media_item,
)
from ..protocol import MediaItem

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import httpx

    from ..openai.schema import ParsedRequest


@dataclass(frozen=True, slots=True)
class FetchedMedia:
    """Bytes fetched from a URL and the content type the server declared."""

    data: bytes
    content_type: str | None


class MediaFetcher(Protocol):
    """Fetches allowed remote media (see :func:`open_media_fetcher`)."""

    async def fetch_url(self, url: str, *, max_bytes: int) -> FetchedMedia:
        """GET ``url``; at most ``max_bytes`` bytes.

        Raises:
            InvalidRequest: the fetch failed, was refused, or was too large.
        """
        ...


class HttpxMediaFetcher:
    """A :class:`MediaFetcher` over one shared ``httpx.AsyncClient`` (redirects refused)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def fetch_url(self, url: str, *, max_bytes: int) -> FetchedMedia:
        """GET ``url``, reading the body only while it stays within ``max_bytes``.

        Raises:
            InvalidRequest: a non-200 answer, a transport error, or too many bytes.

        Cancellation: safe; the response is closed when the block exits.
        Backpressure: reads the body chunk by chunk and stops at the limit.
        """
        import httpx

        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequest(f"fetching {url} answered HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise InvalidRequest(f"{url} is larger than {max_bytes} bytes")
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidRequest(f"{url} is larger than {max_bytes} bytes")
                    chunks.append(chunk)
                return FetchedMedia(b"".join(chunks), response.headers.get("content-type"))
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"could not fetch {url}: {type(exc).__name__}") from None


@asynccontextmanager
async def open_media_fetcher(
    limits: MediaLimits, *, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[HttpxMediaFetcher]:
    """An httpx-backed fetcher for the life of the block.

    Args:
        limits: ``fetch_timeout_s`` bounds connect, read and pool waits.
        transport: an httpx transport (tests pass ``httpx.MockTransport``).

    Cancellation: leaving the block closes the client's connections.
    Backpressure: none here; each fetch bounds its own bytes and time.
    """
    import httpx

    timeout = httpx.Timeout(limits.fetch_timeout_s)
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=False, transport=transport
    ) as client:
        yield HttpxMediaFetcher(client)


@asynccontextmanager
async def open_allowed_fetcher(limits: MediaLimits) -> AsyncIterator[MediaFetcher | None]:
    """A fetcher when the policy allows media URLs, else ``None`` (no client at all).

    Cancellation and resource handling: as :func:`open_media_fetcher`.
    """
    if not limits.policy.url_prefixes:
        yield None
        return
    async with open_media_fetcher(limits) as fetcher:
        yield fetcher


async def resolve_media(
    parsed: ParsedRequest, *, limits: MediaLimits, fetcher: MediaFetcher | None
) -> ParsedRequest:
    """Load every :class:`PendingMedia` of ``parsed``; return it ready to run.

    Items load concurrently, each under ``limits.fetch_timeout_s``; the first
    failure cancels the others.

    Raises:
        InvalidRequest: a fetch failed, timed out, was too large or of the wrong
            type; a local file escaped its directory through a symlink; no
            fetcher is configured for a URL.

    Cancellation: safe at any point; nothing is kept.
    Backpressure: at most ``limits.max_items`` loads run at once.
    """
    if not parsed.pending:
        return parsed
    slots: list[MediaSlot] = list(parsed.media)
    failures: list[InvalidRequest] = []

    async def load(index: int, pending: PendingMedia) -> None:
        try:
            with trio.move_on_after(limits.fetch_timeout_s) as scope:
                slots[index] = await _load(pending, limits, fetcher)
            if scope.cancelled_caught:
                raise InvalidRequest(
                    f"loading {pending.source} took longer than {limits.fetch_timeout_s:g}s",
                    param=pending.param,
                )
        except InvalidRequest as exc:
            if exc.param is None:
                exc.param = pending.param
            failures.append(exc)
            nursery.cancel_scope.cancel(reason="a media item could not be loaded")

    async with trio.open_nursery() as nursery:
        for index, slot in enumerate(parsed.media):
            if isinstance(slot, PendingMedia):
                nursery.start_soon(load, index, slot, name=f"media:{slot.param}")
    if failures:
        raise failures[0]
    items = [slot for slot in slots if isinstance(slot, MediaItem)]
    budget = MediaBudget(limits)
    for item, slot in zip(items, parsed.media, strict=True):
        param = slot.param if isinstance(slot, PendingMedia) else "messages"
        budget.take_bytes(len(item.data), param)
    return parsed.with_media(tuple(items))


async def _load(
    pending: PendingMedia, limits: MediaLimits, fetcher: MediaFetcher | None
) -> MediaItem:
    if pending.local:
        return await _read_local(pending, limits)
    if fetcher is None:
        raise InvalidRequest("this server does not fetch media URLs", param=pending.param)
    fetched = await fetcher.fetch_url(pending.source, max_bytes=limits.max_item_bytes)
    declared = (fetched.content_type or "").split(";")[0].strip().lower()
    return _as_item(fetched.data, declared, pending)


async def _read_local(pending: PendingMedia, limits: MediaLimits) -> MediaItem:
    real = str(await trio.Path(pending.source).resolve())
    dirs = [str(await trio.Path(d).resolve()) for d in limits.policy.local_dirs]
    if not any(is_under(real, directory) for directory in dirs):
        raise InvalidRequest("the media path leads outside the allowed directories")
    try:
        data = await trio.to_thread.run_sync(_read_bounded, real, limits.max_item_bytes)
    except OSError as exc:
        raise InvalidRequest(f"cannot read media file: {exc.strerror}") from None
    return _as_item(data, "", pending)


def _read_bounded(path: str, max_bytes: int) -> bytes:
    with open(path, "rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidRequest(f"media file is larger than {max_bytes} bytes")
    return data


def _as_item(data: bytes, declared: str, pending: PendingMedia) -> MediaItem:
    if not data:
        raise InvalidRequest("media is empty", param=pending.param)
    if not declared.startswith(pending.modality + "/"):
        declared = (mimetypes.guess_type(urlsplit(pending.source).path)[0] or "").lower()
    if not declared.startswith(pending.modality + "/"):
        raise InvalidRequest(
            f"cannot tell the {pending.modality} type of {pending.source}", param=pending.param
        )
    return media_item(data, check_mime(declared, pending.modality, pending.param))


# ---------------------------------------------------------------- helpers
