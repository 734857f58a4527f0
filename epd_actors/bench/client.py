"""A lean HTTP/1.1 client for the load generator: h11 over Trio, keep-alive, cheap SSE scanning.

Theory of operation: :class:`Target` says where to send (host, port, path,
key) and pre-renders the request head; :class:`ConnectionPool` keeps idle
keep-alive connections; :func:`send_request` sends one body on one
connection and fills a :class:`~.stats.RequestRecord`.

Per event the client does only byte searches in C: it splits the body on
the blank line that ends an SSE event, counts ``data:`` events, takes the
first one that carries text as the first token, and parses JSON only for
the one ``usage`` event at the end (the output-token count).  A response is
a success when it is 200 and, streamed, ends with ``data: [DONE]`` and has no
error event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import h11
import trio

from .stats import parse_timings

if TYPE_CHECKING:
    from .stats import RequestRecord

RECEIVE_BYTES: Final = 65536
# An event that is text-carrying has one of these keys and not its empty form.
_TEXT_KEYS: Final = (b'"content":', b'"content": ', b'"text":', b'"text": ')
_EMPTY_TEXT: Final = (
    b'"content":""',
    b'"content": ""',
    b'"text":""',
    b'"text": ""',
    b'"content":null',
    b'"content": null',
)
_USAGE_KEYS: Final = (b'"usage":{', b'"usage": {')
# The router's per-stage timings in a stream: an SSE comment just before [DONE].
_TIMINGS_COMMENT: Final = b": timings "


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

    def headers(self, body_length: int) -> list[tuple[str, str]]:
        headers = [
            ("Host", f"{self.host}:{self.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(body_length)),
            ("Accept", "text/event-stream, application/json"),
        ]
        if self.api_key:
            headers.append(("Authorization", f"Bearer {self.api_key}"))
        headers.extend(self.extra_headers)
        return headers


class Connection:
    """One keep-alive connection (not shared between concurrent requests)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT)

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class ConnectionPool:
    """Idle connections to one target, reused in LIFO order."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._idle: list[Connection] = []
        self.opened = 0

    async def acquire(self) -> Connection:
        if self._idle:
            return self._idle.pop()
        stream = await trio.open_tcp_stream(self.target.host, self.target.port)
        self.opened += 1
        return Connection(stream)

    async def release(self, connection: Connection) -> None:
        if connection.reusable:
            connection.h11.start_next_cycle()
            self._idle.append(connection)
        else:
            await connection.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.aclose()


class _StreamScan:
    """Scans SSE bytes as they arrive; see the module docstring."""

    __slots__ = ("done", "error", "events", "last_text", "pending", "record", "t0", "text_events")

    def __init__(self, record: RequestRecord, t0: float) -> None:
        self.record = record
        self.t0 = t0
        self.pending = b""
        self.events = 0
        self.text_events = 0
        self.last_text = 0.0
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        if self.pending:
            data = self.pending + data
        chunks = data.split(b"\n\n")
        self.pending = chunks.pop()
        for event in chunks:
            if not event.startswith(b"data:"):
                if event.startswith(_TIMINGS_COMMENT):
                    timings = event[len(_TIMINGS_COMMENT) :].split(b"\n", 1)[0]
                    self.record.stages = parse_timings(timings.decode(errors="replace"))
                elif event.startswith(b"event: error"):
                    self.error = "error event: " + event[-200:].decode(errors="replace")
                continue
            self.events += 1
            if any(key in event for key in _TEXT_KEYS) and not any(
                empty in event for empty in _EMPTY_TEXT
            ):
                self.text_events += 1
                elapsed = now - self.t0
                if self.record.ttft is None:
                    self.record.ttft = elapsed
                else:
                    self.record.gaps.append(elapsed - self.last_text)
                self.last_text = elapsed
            elif event.startswith(b"data: [DONE]"):
                self.done = True
            elif any(key in event for key in _USAGE_KEYS):
                self.record.input_tokens, self.record.output_tokens = _usage(event[5:])
            elif event.startswith((b'data: {"error"', b'data:{"error"')):
                self.error = "error event: " + event[-200:].decode(errors="replace")


def _usage(payload: bytes) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a body with ``usage`` (zeros if malformed)."""
    try:
        usage = json.loads(payload)["usage"]
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0, 0


async def send_request(
    connection: Connection,
    target: Target,
    body: bytes,
    record: RequestRecord,
    *,
    stream: bool,
) -> None:
    """Send ``body``, read the whole response, fill ``record`` (``error`` on failure).

    Raises only on cancellation; I/O and protocol failures become
    ``record.error`` and leave the connection not reusable.
    """
    conn = connection.h11
    t0 = trio.current_time()
    request = h11.Request(method="POST", target=target.path, headers=target.headers(len(body)))
    scan = _StreamScan(record, t0)
    body_parts: list[bytes] = []
    try:
        head = conn.send(request) or b""
        payload = conn.send(h11.Data(data=body)) or b""
        tail = conn.send(h11.EndOfMessage()) or b""
        await connection.stream.send_all(head + payload + tail)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await connection.stream.receive_some(RECEIVE_BYTES)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                record.status = event.status_code
                for name, value in event.headers:
                    if name == b"x-epd-timings":
                        record.stages = parse_timings(value.decode(errors="replace"))
            elif isinstance(event, h11.Data):
                if stream and record.status == 200:
                    scan.feed(bytes(event.data), trio.current_time())
                else:
                    body_parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                record.error = "connection closed by the server"
                break
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except h11.ProtocolError as exc:
        record.error = f"HTTP protocol error: {exc}"
    record.e2e = trio.current_time() - t0
    if record.error is not None:
        return
    if record.status != 200:
        text = b"".join(body_parts)[:200].decode(errors="replace")
        record.error = f"HTTP {record.status}: {text}"
        return
    if stream:
        _finish_stream(scan, record)
    else:
        _finish_plain(b"".join(body_parts), record)


def _finish_stream(scan: _StreamScan, record: RequestRecord) -> None:
    if scan.pending.strip():
        scan.feed(b"\n\n", trio.current_time())
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
