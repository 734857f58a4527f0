"""The load generator's requests: the package's HTTP client and SSE decoder, cheap per event.

Theory of operation: :class:`Target` says where to send (host, port, path,
key); :func:`open_client` opens the package's keep-alive client
(:class:`~epd_actors.http.client.WorkerHttpClient`, one write per request,
idle connections reused newest first); :func:`send_request` sends one body
and fills a :class:`~.stats.RequestRecord`.

Per event the client does only string searches in C: the package's SSE
decoder (:class:`~epd_actors.http.sse.SseDecoder`) splits the body into
events, the scan counts the message events, takes the first one that
carries text as the first token, and parses JSON only for the one ``usage``
event at the end (the output-token count).  A response is
a success when it is 200 and, streamed, ends with ``data: [DONE]`` and has no
error event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import trio

from ..http.client import (
    ClientLimits,
    ConnectFailed,
    ConnectionLost,
    HttpClientError,
    WorkerHttpClient,
)
from ..http.sse import DONE_DATA, SseDecoder, SseError
from .stats import parse_timings

if TYPE_CHECKING:
    from .stats import RequestRecord

MAX_EVENT_BYTES: Final = 1 << 20
MAX_BODY_BYTES: Final = 16 << 20
_UNBOUNDED: Final = 1 << 20
# An event that is text-carrying has one of these keys and not its empty form.
_TEXT_KEYS: Final = ('"content":', '"content": ', '"text":', '"text": ')
_EMPTY_TEXT: Final = (
    '"content":""',
    '"content": ""',
    '"text":""',
    '"text": ""',
    '"content":null',
    '"content": null',
)
_USAGE_KEYS: Final = ('"usage":{', '"usage": {')
# The router's per-stage timings in a stream: an SSE comment just before [DONE]
# (the SSE decoder skips comments, so the raw bytes are searched for it).
_TIMINGS_COMMENT: Final = b"\n: timings "
_CARRY_BYTES: Final = 4096


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go.

    Attributes:
        host, port: the server.
        path: e.g. ``/v1/chat/completions``.
        api_key: sent as ``Authorization: Bearer``; empty: none.
    """

    host: str
    port: int
    path: str
    api_key: str = ""
    extra_headers: tuple[tuple[str, str], ...] = field(default=())

    @property
    def url(self) -> str:
        """The URL requests go to, as they are sent (for titles and reports)."""
        return f"http://{self.host}:{self.port}{self.path}"

    @classmethod
    def from_url(cls, url: str, path: str, *, api_key: str = "") -> Target:
        """``http://HOST:PORT[/prefix]``; a ``/v1`` suffix on the URL is accepted."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url must be http://HOST:PORT (got {url!r})")
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(parts.hostname, parts.port or 80, prefix + path, api_key)

    def headers(self) -> list[tuple[str, str]]:
        """Headers of every request beside those the client adds (host, content type and length)."""
        headers = [("Accept", "text/event-stream, application/json")]
        if self.api_key:
            headers.append(("Authorization", f"Bearer {self.api_key}"))
        headers.extend(self.extra_headers)
        return headers


@dataclass(frozen=True, slots=True)
class LoadClient:
    """Where requests go and the keep-alive client that sends them."""

    target: Target
    http: WorkerHttpClient

    @property
    def connections_opened(self) -> int:
        return self.http.connections_opened

    async def aclose(self) -> None:
        """Close the idle connections (shielded, bounded)."""
        await self.http.aclose()


def open_client(target: Target, *, timeout_s: float) -> LoadClient:
    """The package's keep-alive HTTP client for ``target``, bounded for a load generator.

    Connections are opened as requests need them and reused newest first; no
    limit on their number beyond the load's own concurrency.  ``timeout_s``
    bounds a connect and every wait for response bytes.
    """
    host = f"[{target.host}]" if ":" in target.host else target.host
    limits = ClientLimits(
        connect_timeout_s=timeout_s,
        read_timeout_s=timeout_s,
        write_timeout_s=timeout_s,
        pool_timeout_s=timeout_s,
        max_connections=_UNBOUNDED,
        max_keepalive_connections=_UNBOUNDED,
        keepalive_expiry_s=timeout_s,
    )
    return LoadClient(target, WorkerHttpClient(f"http://{host}:{target.port}", limits))


class _StreamScan:
    """Reads SSE bytes as they arrive; see the module docstring."""

    __slots__ = (
        "carry",
        "decoder",
        "done",
        "error",
        "events",
        "last_text",
        "record",
        "t0",
        "text_events",
    )

    def __init__(self, record: RequestRecord, t0: float) -> None:
        self.record = record
        self.t0 = t0
        self.decoder = SseDecoder(MAX_EVENT_BYTES)
        self.carry = b""  # the last bytes seen, for a comment split across reads
        self.events = 0
        self.text_events = 0
        self.last_text = 0.0
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        self._find_timings(data)
        try:
            events = self.decoder.feed(data)
        except SseError as exc:
            self.error = f"bad event stream: {exc}"
            return
        for event in events:
            payload = event.data
            if event.event == "error":
                self.error = "error event: " + payload[-200:]
                continue
            self.events += 1
            if any(key in payload for key in _TEXT_KEYS) and not any(
                empty in payload for empty in _EMPTY_TEXT
            ):
                self.text_events += 1
                elapsed = now - self.t0
                if self.record.ttft is None:
                    self.record.ttft = elapsed
                else:
                    self.record.gaps.append(elapsed - self.last_text)
                self.last_text = elapsed
            elif payload == DONE_DATA:
                self.done = True
            elif any(key in payload for key in _USAGE_KEYS):
                self.record.input_tokens, self.record.output_tokens = _usage(payload)
            elif payload.startswith('{"error"'):
                self.error = "error event: " + payload[-200:]

    def _find_timings(self, data: bytes) -> None:
        """Read a ``: timings ...`` comment line, even one split across reads."""
        window = self.carry + data
        start = window.rfind(_TIMINGS_COMMENT)
        if start >= 0:
            end = window.find(b"\n", start + len(_TIMINGS_COMMENT))
            if end >= 0:
                line = window[start + len(_TIMINGS_COMMENT) : end]
                self.record.stages = parse_timings(line.decode(errors="replace"))
        self.carry = window[-_CARRY_BYTES:]


def _usage(payload: str) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a body with ``usage`` (zeros if malformed)."""
    try:
        usage = json.loads(payload)["usage"]
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0, 0


async def send_request(
    client: LoadClient,
    body: bytes,
    record: RequestRecord,
    *,
    stream: bool,
) -> None:
    """Send ``body``, read the whole response, fill ``record`` (``error`` on failure).

    Raises only on cancellation (the client then closes the connection); I/O
    and protocol failures become ``record.error``.
    """
    t0 = trio.current_time()
    scan = _StreamScan(record, t0)
    answer = b""
    try:
        target = client.target
        response = await client.http.request("POST", target.path, body, headers=target.headers())
        try:
            record.status = response.status
            for name, value in response.headers:
                if name == "x-epd-timings":
                    record.stages = parse_timings(value)
            if stream and response.status == 200:
                while (chunk := await response.next_chunk()) is not None:
                    scan.feed(chunk, trio.current_time())
            else:
                answer = await response.read_all(MAX_BODY_BYTES)
        finally:
            await response.aclose()
    except ConnectFailed as exc:
        record.error = f"cannot connect: {exc}"
    except ConnectionLost as exc:
        record.error = f"connection lost: {exc}"
    except HttpClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e = trio.current_time() - t0
    if record.error is not None:
        return
    if record.status != 200:
        text = answer[:200].decode(errors="replace")
        record.error = f"HTTP {record.status}: {text}"
        return
    if stream:
        _finish_stream(scan, record)
    else:
        _finish_plain(answer, record)


def _finish_stream(scan: _StreamScan, record: RequestRecord) -> None:
    scan.feed(b"\n\n", trio.current_time())  # ends an event the stream left open
    record.events = scan.events
    if scan.error is not None:
        record.error = scan.error
    elif not scan.done:
        record.error = "stream ended without data: [DONE]"
    elif record.output_tokens == 0:
        record.output_tokens = scan.text_events


def _finish_plain(body: bytes, record: RequestRecord) -> None:
    record.events = 1
    record.ttft = record.e2e
    try:
        usage = json.loads(body).get("usage") or {}
        record.input_tokens = int(usage.get("prompt_tokens") or 0)
        record.output_tokens = int(usage.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        record.error = "response body is not JSON"
