"""Writing to a byte stream without waiting: what the kernel takes right now.

Theory of operation
-------------------
A token's chunk is a few hundred bytes and the kernel's send buffer almost
always has room for it, so the hot path writes it with one ``write`` syscall
from whichever task holds it, and only the rest (a full buffer, a slow client)
goes the awaited way (``send_all``).  :func:`send_some_nowait` is that one
write; :class:`NowaitWriter` is a stream's writer that does both, with the
guard Trio's own streams keep: two tasks never write to one stream at once
(``trio.BusyResourceError``), the non-blocking write included.

Which streams: a ``trio.SocketStream`` (the write goes to its file
descriptor), and a :class:`NowaitSendStream` -- :class:`MemoryNowaitStream`,
the in-memory twin of a socket with a bounded send buffer, for tests that run
the production path.  Any other stream takes nothing without waiting, so
everything goes the awaited way.

Cancellation and backpressure: :func:`send_some_nowait` and
:meth:`NowaitWriter.send_some_nowait` never block (not checkpoints);
:meth:`NowaitWriter.send_all` waits for room like the stream's own.
"""

from __future__ import annotations

import errno
import os
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from collections.abc import Callable


class NowaitSendStream(trio.abc.HalfCloseableStream):
    """A stream that can take bytes without waiting (besides a socket)."""

    __slots__ = ()

    @abstractmethod
    def send_some_nowait(self, data: bytes) -> int:
        """Take what fits of ``data`` now; how many bytes (see :func:`send_some_nowait`)."""


def send_some_nowait(stream: trio.abc.Stream, data: bytes) -> int:
    """Write what ``stream`` takes of ``data`` right now; return how many bytes that was.

    A ``trio.SocketStream`` or a :class:`NowaitSendStream` is written this way;
    any other stream, a socket that is closed or shut down for writing, or a
    full send buffer takes 0 bytes, and the caller sends the rest with an
    awaited ``send_all`` (which also reports a closed stream).  Not a
    checkpoint.  The caller must be the stream's only writer at that moment
    (:class:`NowaitWriter` checks it).

    Raises:
        trio.BrokenResourceError: the peer reset or closed the connection.
    """
    return _nowait_write(stream)(stream, data)


def _nowait_write(stream: trio.abc.Stream) -> Callable[[Any, bytes], int]:
    """How :func:`send_some_nowait` writes to ``stream`` (chosen once per stream by a writer)."""
    if isinstance(stream, trio.SocketStream):
        return _socket_write
    if isinstance(stream, NowaitSendStream):
        return _own_write
    return _takes_nothing


def _own_write(stream: NowaitSendStream, data: bytes) -> int:
    return stream.send_some_nowait(data)


def _takes_nothing(stream: trio.abc.Stream, data: bytes) -> int:
    return 0


def _socket_write(stream: trio.SocketStream, data: bytes) -> int:
    sock = stream.socket
    fd = sock.fileno()
    if fd == -1 or sock.did_shutdown_SHUT_WR:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno == errno.EBADF:
            return 0
        raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc


class NowaitWriter:
    """The one writer of a stream: writes without waiting when it can, awaited otherwise.

    Like Trio's streams, it refuses a second writer (``trio.BusyResourceError``)
    while an awaited write is in progress -- the non-blocking write too, which
    on its own would slip between the pieces of that write.
    """

    __slots__ = ("_busy", "_write", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._busy = False
        self._write = _nowait_write(stream)

    @property
    def busy(self) -> bool:
        """An awaited write is in progress."""
        return self._busy

    def send_some_nowait(self, data: bytes) -> int:
        """:func:`send_some_nowait` on the stream.

        Raises:
            trio.BusyResourceError: an awaited write is in progress.
            trio.BrokenResourceError: the peer reset or closed the connection.
        """
        if self._busy:
            raise trio.BusyResourceError("another task is writing to this stream")
        return self._write(self.stream, data)

    async def send_all(self, data: bytes) -> None:
        """The stream's ``send_all``, marked busy meanwhile.

        Raises:
            trio.BusyResourceError: another awaited write is in progress.
            what the stream's ``send_all`` raises.

        Cancellation: as the stream's (a cancelled write may have sent part).
        Backpressure: waits for the peer to read.
        """
        if self._busy:
            raise trio.BusyResourceError("another task is writing to this stream")
        self._busy = True
        try:
            await self.stream.send_all(data)
        finally:
            self._busy = False

    async def write(self, data: bytes) -> int:
        """All of ``data``: at once what the stream takes, the rest awaited; bytes taken at once.

        Not a checkpoint when the stream took it all.  Raises and cancellation:
        as :meth:`send_some_nowait` and :meth:`send_all`.
        """
        written = self.send_some_nowait(data)
        if written < len(data):
            await self.send_all(data[written:])
        return written


class MemoryNowaitStream(NowaitSendStream):
    """One end of an in-memory connection whose send buffer holds ``room`` bytes.

    The twin of a connected socket for tests: :meth:`send_some_nowait` takes
    what fits in the peer's unread bytes (``room`` at most), as the kernel does,
    and :meth:`send_all` waits for the peer to read the rest.  Made in pairs by
    :func:`memory_nowait_pair`.
    """

    __slots__ = (
        "_closed",
        "_eof",
        "_incoming",
        "_readable",
        "_space",
        "_wrote_eof",
        "peer",
        "room",
    )

    def __init__(self, room: int) -> None:
        self.room = room
        self.peer: MemoryNowaitStream = self
        self._incoming = bytearray()  # what the peer sent, unread here
        self._readable = trio.lowlevel.ParkingLot()  # readers of ``_incoming``
        self._space = trio.lowlevel.ParkingLot()  # the peer's writers, waiting for room
        self._eof = False  # the peer will send nothing more
        self._wrote_eof = False
        self._closed = False

    def unread(self) -> bytes:
        """What the peer sent that was not received yet (a test looks without waiting)."""
        return bytes(self._incoming)

    def set_room(self, room: int) -> None:
        """Change the send buffer's size (a client that reads faster or slower)."""
        self.room = room
        self.peer._space.unpark_all()

    def send_some_nowait(self, data: bytes) -> int:
        if self._closed or self._wrote_eof:
            return 0
        peer = self.peer
        if peer._closed:
            raise trio.BrokenResourceError("the peer closed its end")
        taken = max(0, min(len(data), self.room - len(peer._incoming)))
        if taken:
            peer._incoming += data[:taken]
            peer._readable.unpark_all()
        return taken

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this end is closed")
        if self._wrote_eof:
            raise trio.ClosedResourceError("this end sent its end of file")
        view = memoryview(data)
        await trio.lowlevel.checkpoint_if_cancelled()
        while view:
            taken = self.send_some_nowait(bytes(view))
            view = view[taken:]
            if view:
                await self._space_parked()
                if self._closed:
                    raise trio.ClosedResourceError("this end is closed")
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def _space_parked(self) -> None:
        await self.peer._space.park()

    async def wait_send_all_might_not_block(self) -> None:
        while not (self._closed or self.peer._closed) and len(self.peer._incoming) >= self.room:
            await self._space_parked()
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        self._wrote_eof = True
        self.peer._eof = True
        self.peer._readable.unpark_all()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("this end is closed")
        while not self._incoming and not self._eof and not self.peer._closed:
            await self._readable.park()
            if self._closed:
                raise trio.ClosedResourceError("this end is closed")
        count = len(self._incoming) if max_bytes is None else min(max_bytes, len(self._incoming))
        data = bytes(self._incoming[:count])
        del self._incoming[:count]
        self._space.unpark_all()
        if not data:
            await trio.lowlevel.checkpoint()
        return data

    async def aclose(self) -> None:
        self._closed = True
        self._readable.unpark_all()
        self._space.unpark_all()
        peer = self.peer
        peer._eof = True
        peer._readable.unpark_all()
        peer._space.unpark_all()
        await trio.lowlevel.checkpoint()


def memory_nowait_pair(room: int = 65536) -> tuple[MemoryNowaitStream, MemoryNowaitStream]:
    """Two connected :class:`MemoryNowaitStream` ends, each send buffer ``room`` bytes."""
    left, right = MemoryNowaitStream(room), MemoryNowaitStream(room)
    left.peer, right.peer = right, left
    return left, right
