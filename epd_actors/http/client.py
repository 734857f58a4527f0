"""A lean HTTP/1.1 client over Trio: the ``openai_http`` backend's connection pool.

Theory of operation
-------------------
The backend sends two kinds of requests to a vLLM server: small JSON POSTs
whose whole answer it reads (encode, prefill, release, ``/health``,
``/v1/models``), and streamed POSTs whose server-sent events it reads as they
arrive (decode).  Both are one request per keep-alive connection at a time.
A general-purpose client spends most of a request's CPU on things this needs
none of (URL and header models, redirects, auth flows, nested body
iterators), and writes a request's head and body in two ``send`` calls; on
loopback every ``send`` also runs the receiver's TCP work, so that doubles
the most expensive system call.  :class:`WorkerHttpClient` does only what the
backend needs:

* **one write per request**: head and body are joined and written at once,
  without waiting when the kernel takes them all (an awaited ``send_all``
  only for what it did not take);
* **keep-alive pool**: idle connections are reused newest first; one idle
  longer than ``keepalive_expiry_s``, or readable while idle (the server
  closed it, or sent bytes nobody asked for), is closed instead;
* **bounded**: at most ``max_connections`` requests hold a connection at once
  (``pool_timeout_s`` to get one), at most ``max_keepalive_connections`` stay
  idle, a response head is at most ``max_header_bytes``;
* **responses** are framed by ``Content-Length``, ``Transfer-Encoding:
  chunked`` or the connection's close, as RFC 9112 says; 1xx heads are
  skipped; :meth:`Response.next_chunk` returns every body byte already
  received in one piece (several chunks of a chunked body included), so a
  burst of events costs one call.

Timeouts: ``connect_timeout_s`` bounds a connect (and TLS handshake),
``write_timeout_s`` the request's write, ``read_timeout_s`` every wait for
response bytes.  Failures are the :class:`HttpClientError` subclasses below,
which the backend maps to the router's errors in one place.

Cancellation: a request cancelled before its response ended closes its
connection (the server sees the client leave); closing is shielded and
bounded by ``CLEANUP_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import trio

from ..limits import CLEANUP_TIMEOUT_S, RECEIVE_CHUNK_BYTES
from ..transport.nowait import send_some_nowait

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..transport.read_hub import ReadHub

__all__ = [
    "BadResponse",
    "ClientLimits",
    "ConnectFailed",
    "ConnectionLost",
    "HttpClientError",
    "RequestTimeout",
    "Response",
    "ResponseTooLarge",
    "WorkerHttpClient",
]

_MAX_CHUNK_LINE: Final = 4096
_NO_BODY_STATUSES: Final = frozenset({204, 304})
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\Z")
"""A chunk-size line (without its CRLF): hex digits, then optional extensions."""


class HttpClientError(Exception):
    """A request that got no usable answer."""


class ConnectFailed(HttpClientError):
    """No connection: refused, unreachable, unresolvable, or too slow to connect."""


class ConnectionLost(HttpClientError):
    """The connection broke, or the server closed it before the response ended."""


class BadResponse(HttpClientError):
    """The bytes are not an HTTP/1.x response (or exceed a limit)."""


class ResponseTooLarge(HttpClientError):
    """A body longer than the caller's limit (the connection itself is fine)."""


class RequestTimeout(HttpClientError):
    """No free connection, write or response bytes in time; ``phase`` says which."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(f"{phase} timed out after {seconds:g} s")
        self.phase = phase


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Timeouts (seconds) and sizes of one :class:`WorkerHttpClient`."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 10.0
    max_connections: int = 512
    max_keepalive_connections: int = 512
    keepalive_expiry_s: float = 4.0
    max_header_bytes: int = 64 * 1024


class _Connection:
    """One socket (or TLS stream) and the bytes received beyond what was consumed.

    ``failure``: a read error that a read without waiting met (in a
    :class:`~epd_actors.transport.read_hub.ReadHub`'s task); the next awaited
    read raises it.
    """

    __slots__ = ("buffer", "failure", "idle_since", "plain", "socket", "stream")

    def __init__(self, stream: trio.abc.Stream, socket: trio.socket.SocketType) -> None:
        self.stream = stream
        self.socket = socket
        self.plain = type(stream) is trio.SocketStream  # no TLS: the socket is the stream
        self.buffer = bytearray()
        self.idle_since = 0.0
        self.failure: OSError | None = None


class WorkerHttpClient:
    """A keep-alive HTTP/1.1 connection pool to one server (see the module docstring).

    Args:
        base_url: ``http(s)://HOST[:PORT][/prefix]``; request paths are appended to the prefix.
        limits: timeouts and sizes.
        headers: sent with every request (e.g. ``authorization``).
        tls_context: builds the TLS context for ``https`` (called once, on the first connect).

    Raises:
        ValueError: ``base_url`` is not an http(s) URL with a host.
    """

    def __init__(
        self,
        base_url: str,
        limits: ClientLimits,
        *,
        headers: Sequence[tuple[str, str]] = (),
        tls_context: Callable[[], ssl.SSLContext] = ssl.create_default_context,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.limits = limits
        self._tls_context = tls_context
        host = f"[{self.host}]" if ":" in self.host else self.host
        default_port = self.port == (443 if self.tls else 80)
        authority = host if default_port else f"{host}:{self.port}"
        fixed = [("host", authority), *headers]
        for name, value in fixed:
            _check_header(name, value)
        self._fixed_head = "".join(f"{name}: {value}\r\n" for name, value in fixed)
        self._idle: list[_Connection] = []
        self._slots = trio.Semaphore(limits.max_connections)
        self._closed = False
        self.connections_opened = 0

    def __repr__(self) -> str:
        scheme = "https" if self.tls else "http"
        where = f"{scheme}://{self.host}:{self.port}{self.prefix}"
        return f"<WorkerHttpClient {where} idle={len(self._idle)}>"

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> Response:
        """Send one request; return once the response's head arrived.

        The caller must :meth:`Response.aclose` the response (its connection
        goes back to the pool, or is closed).

        Raises:
            ConnectFailed, ConnectionLost, BadResponse, RequestTimeout: see above.
            ValueError: a header value with a line break.

        Cancellation: the connection is closed; no response is returned.
        Backpressure: waits up to ``pool_timeout_s`` for one of ``max_connections``.
        """
        if self._closed:
            raise ConnectionLost("the client is closed")
        head = [f"{method} {self.prefix}{path} HTTP/1.1\r\n", self._fixed_head]
        for name, value in headers:
            _check_header(name, value)
            head.append(f"{name}: {value}\r\n")
        if body is not None:
            head.append(f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1")
        if body:
            data += body
        await self._take_slot()
        conn: _Connection | None = None
        try:
            conn = self._reusable() or await self._connect()
            await self._send(conn, data)
            response = Response(self, conn)
            await response._read_head(head_only=method == "HEAD")
        except BaseException:
            if conn is not None:
                await _close(conn)
            self._slots.release()
            raise
        return response

    async def aclose(self) -> None:
        """Close the idle connections; requests still open close theirs when they end.

        Cancellation: shielded, bounded by ``CLEANUP_TIMEOUT_S``.
        """
        self._closed = True
        idle, self._idle = self._idle, []
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            for conn in idle:
                await _close(conn)

    # ------------------------------------------------------------ the pool

    async def _take_slot(self) -> None:
        # No checkpoint on the fast path: the write that follows is one.
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            seconds = self.limits.pool_timeout_s
            with trio.move_on_after(seconds):
                await self._slots.acquire()
                return
            raise RequestTimeout("waiting for a free connection", seconds) from None

    def _reusable(self) -> _Connection | None:
        """The newest idle connection still fit for a request, if any (stale ones closed)."""
        idle = self._idle
        now = trio.current_time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.limits.keepalive_expiry_s and not _readable(conn):
                return conn
            _close_now(conn)
        return None

    async def _connect(self) -> _Connection:
        seconds = self.limits.connect_timeout_s
        with trio.move_on_after(seconds):
            try:
                socket_stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
            stream: trio.abc.Stream = socket_stream
            if self.tls:
                tls = trio.SSLStream(
                    socket_stream,
                    self._tls_context(),
                    server_hostname=self.host,
                    https_compatible=True,
                )
                try:
                    await tls.do_handshake()
                except (trio.BrokenResourceError, OSError) as exc:
                    await trio.aclose_forcefully(socket_stream)
                    raise ConnectFailed(f"TLS handshake with {self.host} failed: {exc}") from exc
                stream = tls
            self.connections_opened += 1
            return _Connection(stream, socket_stream.socket)
        raise ConnectFailed(f"connecting to {self.host}:{self.port} timed out after {seconds:g} s")

    async def _send(self, conn: _Connection, data: bytes) -> None:
        """Write ``data``: what the kernel takes now without waiting, the rest awaited.

        A request almost always fits the socket's send buffer, so the common
        case costs neither a cancel scope nor a trip through the scheduler;
        the request stays a checkpoint through the read of its answer.
        """
        try:
            sent = send_some_nowait(conn.stream, data)
        except trio.BrokenResourceError as exc:
            raise ConnectionLost(f"the connection broke while sending: {exc!r}") from exc
        if sent == len(data):
            return
        seconds = self.limits.write_timeout_s
        with trio.move_on_after(seconds):
            try:
                await conn.stream.send_all(memoryview(data)[sent:])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectionLost(f"the connection broke while sending: {exc!r}") from exc
            return
        raise RequestTimeout("sending the request", seconds)

    async def _receive(self, conn: _Connection) -> bytes:
        """More bytes from ``conn`` (``b""`` at EOF).

        On a plain TCP connection the socket is read directly: what it holds
        now costs one ``read`` and no timeout scope (not a checkpoint then);
        otherwise one wait for it to become readable, under ``read_timeout_s``,
        and one more ``read`` -- the system calls Trio's stream would make,
        without its layers.
        """
        if conn.failure is not None:
            raise _read_broke(conn.failure)
        if conn.plain:
            return await self._receive_plain(conn)
        seconds = self.limits.read_timeout_s
        with trio.move_on_after(seconds):
            try:
                return bytes(await conn.stream.receive_some(RECEIVE_CHUNK_BYTES))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _read_broke(exc) from exc
        raise RequestTimeout("reading the response", seconds)

    async def _receive_plain(self, conn: _Connection) -> bytes:
        sock = conn.socket
        try:
            return os.read(sock.fileno(), RECEIVE_CHUNK_BYTES)
        except BlockingIOError:
            pass
        except OSError as exc:  # a closed socket's descriptor is -1: EBADF
            raise _read_broke(exc) from exc
        seconds = self.limits.read_timeout_s
        with trio.move_on_after(seconds):
            try:
                await trio.lowlevel.wait_readable(sock)
                return os.read(sock.fileno(), RECEIVE_CHUNK_BYTES)
            except (trio.ClosedResourceError, OSError) as exc:
                raise _read_broke(exc) from exc
        raise RequestTimeout("reading the response", seconds)

    def _give_back(self, conn: _Connection | None) -> None:
        """End a request: keep ``conn`` for reuse (None: it was closed) and free its slot."""
        self._slots.release()
        if conn is None:
            return
        if self._closed or len(self._idle) >= self.limits.max_keepalive_connections:
            _close_now(conn)
            return
        conn.idle_since = trio.current_time()
        self._idle.append(conn)


class Response:
    """One response: status and headers at once, the body read on demand.

    Attributes:
        status: the status code.
        headers: ``(name, value)`` pairs, names lower-cased, in the order received.
        complete: the whole body has been read (``next_chunk`` returned None).
    """

    __slots__ = (
        "_chunk_left",
        "_client",
        "_conn",
        "_framing",
        "_hub",
        "_keep_alive",
        "_left",
        "_now",
        "_read_at",
        "complete",
        "headers",
        "status",
    )

    def __init__(self, client: WorkerHttpClient, conn: _Connection) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.complete = False
        self._framing = "close"  # "length", "chunked", "close" or "none"
        self._left = 0  # bytes of a Content-Length body still to come
        self._chunk_left = -1  # chunked: data bytes left in the current chunk; -1: a size line
        self._keep_alive = False
        self._hub: ReadHub | None = None  # serving the body now (serve_body)
        self._read_at = 0.0  # when serve_body's reads last got bytes
        self._now = trio.lowlevel.current_clock().current_time  # per read: the cheapest clock

    def __repr__(self) -> str:
        return f"<Response {self.status} {self._framing} complete={self.complete}>"

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower case), if any."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def close_now(self) -> None:
        """Close the connection at once; callable from any task, never waits.

        A read waiting for the body (in another task) is woken and, like every
        later read, raises ``ConnectionLost``.  :meth:`aclose` is still due.
        """
        conn = self._conn
        if conn is not None:
            if self._hub is not None:
                self._hub.release(conn.socket)
            _close_now(conn)

    async def read_all(self, limit: int) -> bytes:
        """The rest of the body.

        Raises:
            ResponseTooLarge: more than ``limit`` bytes.
            ConnectionLost, BadResponse, RequestTimeout: as for :meth:`next_chunk`.
        """
        parts: list[bytes] = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(f"the response body exceeds {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def next_chunk(self) -> bytes | None:
        """Every body byte available now (waiting for some if none is); None at the end.

        Raises:
            ConnectionLost: the connection broke or closed before the body ended.
            BadResponse: broken chunked framing.
            RequestTimeout: no bytes within ``read_timeout_s``.

        Cancellation: safe; the caller's ``aclose`` then closes the connection.
        """
        conn = self._conn
        if self.complete or conn is None:
            return None
        while True:
            data = self._buffered_body(conn)
            if data is None:
                return None
            if data:
                return data
            more = await self._client._receive(conn)
            if not more:
                if self._framing == "close":
                    self.complete = True
                    return None
                raise ConnectionLost("the server closed the connection before the body ended")
            conn.buffer += more

    def body_nowait(self) -> bytes | None:
        """The body bytes already received, without waiting: ``b""`` if none; None at the end.

        Raises:
            BadResponse: broken chunked framing.
        """
        conn = self._conn
        if self.complete or conn is None:
            return None
        return self._buffered_body(conn)

    def _buffered_body(self, conn: _Connection) -> bytes | None:
        """Consume the body bytes in ``conn``'s buffer: them, ``b""`` if none, None at the end."""
        framing = self._framing
        if framing == "chunked":
            data = self._take_chunked(conn)
            if data:
                return data
            return None if self.complete else b""
        if framing == "length":
            if self._left == 0:
                self.complete = True
                return None
            if not conn.buffer:
                return b""
            data = bytes(conn.buffer[: self._left])
            del conn.buffer[: len(data)]
            self._left -= len(data)
            return data
        if framing == "none":
            self.complete = True
            return None
        # "close": the body runs to EOF
        data = bytes(conn.buffer)
        conn.buffer.clear()
        return data

    def receive_nowait(self) -> bool:
        """Read what the socket has now into the buffer, without waiting: whether bytes came.

        For a reader in a :class:`~epd_actors.transport.read_hub.ReadHub`'s
        handler.  False at the end of the stream or on a read error, which the
        next awaited read (:meth:`next_chunk`) then reports; neither blocks
        nor raises otherwise.

        Raises:
            trio.WouldBlock: the socket has nothing now.
        """
        conn = self._conn
        if conn is None or conn.failure is not None:
            return False
        try:
            more = os.read(conn.socket.fileno(), RECEIVE_CHUNK_BYTES)
        except BlockingIOError:
            raise trio.WouldBlock from None
        except OSError as exc:
            conn.failure = exc
            return False
        if not more:
            return False
        conn.buffer += more
        self._read_at = self._now()
        return True

    async def serve_body(self, hub: ReadHub, handle: Callable[[], bool]) -> bool:
        """Let ``hub`` call ``handle`` whenever the body's socket is readable (``ReadHub.serve``).

        ``handle`` reads with :meth:`receive_nowait` and :meth:`body_nowait`.
        ``read_timeout_s`` bounds each wait for bytes, as for :meth:`next_chunk`,
        without a timeout scope per read: the one deadline is moved on only
        when it passes after bytes came.

        Returns:
            True when ``handle`` gave the body back (or the connection was
            closed with :meth:`close_now`); False when the hub cannot serve it
            (not running, or a TLS connection): the caller reads with
            :meth:`next_chunk`.

        Raises:
            RequestTimeout: no bytes within ``read_timeout_s``.
            what ``handle`` raised.

        Cancellation: safe; the socket leaves the hub before the caller resumes.
        """
        conn = self._conn
        if conn is None or not hub.running or not conn.plain:
            return False
        seconds = self._client.limits.read_timeout_s
        self._read_at = self._now()
        self._hub = hub
        try:
            while True:
                with trio.move_on_at(self._read_at + seconds):
                    return await hub.serve(conn.socket, handle)
                if self._now() - self._read_at >= seconds:
                    raise RequestTimeout("reading the response", seconds)
        finally:
            self._hub = None

    async def aclose(self, *, drain_s: float = 0.0) -> None:
        """End the response: the connection returns to the pool if the body was read in full.

        ``drain_s`` > 0: a body not yet read to its end is read for at most
        that long first (bounded by the read limits), so that a connection
        whose answer is complete except for its last bytes can be kept.
        Otherwise (or if the drain does not finish) the connection is closed.

        Cancellation: shielded, bounded by ``CLEANUP_TIMEOUT_S``.
        """
        conn = self._conn
        if conn is None:
            return
        if self.complete and self._keep_alive and not conn.buffer:
            # The common case: nothing to wait for, so no cancel scope either.
            self._conn = None
            self._client._give_back(conn)
            return
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            if not self.complete and drain_s > 0:
                with trio.move_on_after(drain_s), contextlib.suppress(HttpClientError):
                    await self.read_all(RECEIVE_CHUNK_BYTES)
            self._conn = None
            if self.complete and self._keep_alive and not conn.buffer:
                self._client._give_back(conn)
                return
            self._client._give_back(None)
            await _close(conn)

    # ------------------------------------------------------------ parsing

    async def _read_head(self, *, head_only: bool) -> None:
        conn = self._conn
        assert conn is not None
        limit = self._client.limits.max_header_bytes
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.buffer) > limit:
                    raise BadResponse(f"the response head exceeds {limit} bytes")
                more = await self._client._receive(conn)
                if not more:
                    raise ConnectionLost("the server closed the connection without answering")
                conn.buffer += more
                continue
            if end > limit:
                raise BadResponse(f"the response head exceeds {limit} bytes")
            head = bytes(conn.buffer[:end])
            del conn.buffer[: end + 4]
            if self._parse_head(head, head_only=head_only):
                return

    def _parse_head(self, head: bytes, *, head_only: bool) -> bool:
        """Parse one head; False for an informational (1xx) one, which is skipped."""
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise BadResponse("the server switched protocols")
            return False
        headers: list[tuple[str, str]] = []
        length: int | None = None
        chunked = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise BadResponse(f"a malformed header line: {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers.append((key, text))
            if key == "content-length":
                if not text.isdigit() or (length is not None and int(text) != length):
                    raise BadResponse(f"a bad content-length: {text[:40]!r}")
                length = int(text)
            elif key == "transfer-encoding":
                codings = [c.strip().lower() for c in text.split(",")]
                chunked = codings[-1] == "chunked"
                if not chunked:
                    keep_alive = False  # framed by the close
            elif key == "connection":
                tokens = {t.strip().lower() for t in text.split(",")}
                if "close" in tokens:
                    keep_alive = False
        self.status = status
        self.headers = headers
        if head_only or status in _NO_BODY_STATUSES:
            self._framing = "none"
        elif chunked:
            self._framing = "chunked"
        elif length is not None:
            self._framing, self._left = "length", length
        else:
            self._framing, keep_alive = "close", False
        self._keep_alive = keep_alive
        return True

    def _take_chunked(self, conn: _Connection) -> bytes:
        """Consume every whole piece of chunked framing in the buffer; the data found.

        ``_chunk_left`` is the state: > 0 data bytes of the current chunk still
        to come, -1 a chunk-size line, -2 the CRLF after a chunk's data, -3
        the trailer section (lines up to a blank one).  A buffer that is
        exactly one whole chunk (a paced stream's read: one event in one
        chunk) is taken without the loop.
        """
        buffer = conn.buffer
        if not buffer:
            return b""
        data = bytes(buffer)  # one copy; slicing and searching bytes is cheapest
        size = len(data)
        left = self._chunk_left
        if left == -1 and data[-2:] == b"\r\n":
            end = data.find(b"\r\n")
            match = _CHUNK_SIZE.match(data, 0, end)
            if match is not None and end + 4 + int(match.group(1), 16) == size > end + 4:
                buffer.clear()
                return data[end + 2 : -2]
        out: list[bytes] = []
        pos = 0
        while pos < size:
            if left > 0:
                end = min(size, pos + left)
                out.append(data[pos:end])
                left -= end - pos
                pos = end
                if left == 0:
                    left = -2
            elif left == -2:
                if size - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise BadResponse("a chunk's data is not followed by CRLF")
                pos += 2
                left = -1
            else:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > _MAX_CHUNK_LINE:
                        raise BadResponse("a chunk-size or trailer line is too long")
                    break
                if left == -3:
                    blank = end == pos
                    pos = end + 2
                    if blank:
                        self.complete = True
                        break
                    continue
                match = _CHUNK_SIZE.match(data, pos, end)
                if match is None:
                    raise BadResponse(f"a bad chunk-size line: {data[pos:end][:20]!r}")
                pos = end + 2
                left = int(match.group(1), 16) or -3
        self._chunk_left = left
        del buffer[:pos]
        return out[0] if len(out) == 1 else b"".join(out)


def _check_header(name: str, value: str) -> None:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"header {name!r} cannot be sent: it has a line break or colon")


def _read_broke(exc: BaseException) -> ConnectionLost:
    """The error of a read that failed with ``exc`` (or met a failure recorded earlier)."""
    return ConnectionLost(f"the connection broke while reading: {exc!r}")


def _readable(conn: _Connection) -> bool:
    """Whether an idle connection has bytes or EOF pending (it must not be reused)."""
    if conn.buffer:
        return True
    try:
        return conn.socket.is_readable()
    except OSError:
        return True


def _close_now(conn: _Connection) -> None:
    """Close an idle connection without waiting (nothing is in flight on it)."""
    conn.socket.close()


async def _close(conn: _Connection) -> None:
    with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
        await trio.aclose_forcefully(conn.stream)
