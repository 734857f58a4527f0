"""Trio adapter for the native protocol: one framed, lock-serialized message stream.

Theory of operation: a :class:`FramedStream` wraps any ``trio.abc.Stream``
(TCP, Unix socket, or a ``trio.testing`` memory stream).  Exactly one task reads
(:meth:`FramedStream.receive`); any number of tasks write.  A writer encodes its
frame synchronously, then sends it under a ``trio.StrictFIFOLock`` so frames from
different tasks never interleave and are written in the order the writers
arrived.  Transport failures are mapped once, here, into ``ConnectionLost``.

A frame is first offered to the socket without waiting
(:func:`~.nowait.send_some_nowait`): when the lock is free and the kernel takes the
whole frame -- the common case -- the send costs one syscall and no
scheduling round; the rest of a frame the kernel did not take is sent the
awaited way, still under the lock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..errors import ConnectionLost
from ..limits import RECEIVE_CHUNK_BYTES
from ..protocol import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, Message, encode
from .nowait import send_some_nowait

if TYPE_CHECKING:
    from collections.abc import Iterable

logger = logging.getLogger(__name__)


class FramedStream:
    """Messages over a byte stream.

    Args:
        stream: the byte stream; this object owns it and closes it in :meth:`aclose`.
        max_frame_bytes: limit applied to both directions.
        peer: a short description for logs and ``repr``.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        peer: str = "?",
    ) -> None:
        self._stream = stream
        self._decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
        self._send_lock = trio.StrictFIFOLock()
        self._max_frame_bytes = max_frame_bytes
        self.peer = peer
        self.frames_sent = 0
        self.frames_received = 0

    def __repr__(self) -> str:
        sent, received = self.frames_sent, self.frames_received
        return f"<FramedStream peer={self.peer} sent={sent} recv={received}>"

    async def send(self, message: Message) -> None:
        """Encode and write one message.

        Raises:
            ConnectionLost: the stream is broken or closed.
            LocalProtocolError: the message is invalid or too large.

        Cancellation: cancelling a send may leave a partial frame on the stream;
        the stream is then unusable and the caller must close it.
        Backpressure: waits while the peer is not reading.
        """
        data = encode(message, max_frame_bytes=self._max_frame_bytes)
        await self._send_bytes(data)
        self.frames_sent += 1

    async def send_many(self, messages: Iterable[Message]) -> None:
        """Write several messages as one ``send_all`` (same rules as :meth:`send`)."""
        frames = [encode(m, max_frame_bytes=self._max_frame_bytes) for m in messages]
        await self._send_bytes(b"".join(frames))
        self.frames_sent += len(frames)

    async def send_encoded(self, data: bytes, frames: int) -> None:
        """Write ``frames`` already encoded frames, joined in ``data``, as one ``send_all``.

        Same rules as :meth:`send`; the caller encoded each frame with
        :func:`~epd_actors.protocol.encode` under this stream's frame limit.
        """
        await self._send_bytes(data)
        self.frames_sent += frames

    async def _send_bytes(self, data: bytes) -> None:
        lock = self._send_lock
        try:
            if lock.locked():
                async with lock:
                    await self._stream.send_all(data)
                return
            # Free lock: nobody is writing or waiting to, so the frame may go out now.
            lock.acquire_nowait()
            try:
                written = send_some_nowait(self._stream, data)
                if written < len(data):
                    await self._stream.send_all(data[written:])
            finally:
                lock.release()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectionLost(f"connection to {self.peer} lost while sending: {exc}") from exc

    async def receive(self) -> Message | None:
        """Return the next message, or ``None`` at a clean end of stream.

        Raises:
            RemoteProtocolError: the peer sent a bad frame (the decoder stays
                usable for ``FrameTooLarge`` and malformed bodies), or the
                stream ended in the middle of a frame.
            ConnectionLost: the stream broke.

        Cancellation: safe; bytes already received stay buffered.
        """
        decoder = self._decoder
        while True:
            message = decoder.next_message()
            if message is not None:
                self.frames_received += 1
                return message
            if decoder.at_eof:
                return None
            try:
                data = await self._stream.receive_some(RECEIVE_CHUNK_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ConnectionLost(f"connection to {self.peer} lost: {exc}") from exc
            decoder.feed(data)

    def receive_nowait(self) -> Message:
        """The next message if a whole one is already buffered; no I/O, not a checkpoint.

        Lets a reader handle every frame of one read in one go.

        Raises:
            trio.WouldBlock: no whole message is buffered (at the end of the
                stream too: :meth:`receive` then reports it).
            RemoteProtocolError: as :meth:`receive`.
        """
        message = self._decoder.next_message()
        if message is None:
            raise trio.WouldBlock
        self.frames_received += 1
        return message

    async def aclose(self) -> None:
        """Close the underlying stream (forcefully if cancelled)."""
        await trio.aclose_forcefully(self._stream)
