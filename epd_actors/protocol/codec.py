"""Sans-IO framing: a 4-byte big-endian length prefix, then a msgpack map.

Theory of operation: :func:`encode` turns a message into one frame.
:class:`FrameDecoder` is fed whatever bytes arrive (``feed(b"")`` means EOF) and
hands back whole messages from :meth:`FrameDecoder.next_message`, or ``None``
when it needs more data.  The length in a header is checked against the limit
as soon as the four header bytes are present, before any body byte is kept; the
oversized body is then *skipped* as it streams in, so the decoder stays usable.
A frame whose body is not valid msgpack, or whose map is not a valid message,
is consumed whole before its error is raised, so the next frame decodes
normally.  A partial frame at EOF is an error.

Only ``RemoteProtocolError`` (and its subclass ``FrameTooLarge``) ever escapes
the decoder, whatever the bytes.  There is no I/O and no Trio import here.
"""

from __future__ import annotations

import struct
from typing import Final

import msgpack

from ..errors import FrameTooLarge, LocalProtocolError, RemoteProtocolError
from .messages import STRUCTS_BY_TAG, STRUCTS_BY_TYPE, Message

HEADER: Final = struct.Struct(">I")
HEADER_BYTES: Final = HEADER.size

# 64 MiB: a frame carries whole media items (compressed images, audio clips).
DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
# Containers inside one frame: far above any real message, far below what a
# hostile length field could make msgpack allocate.
MAX_ARRAY_LEN: Final = 1 << 20
MAX_MAP_LEN: Final = 1 << 12


def encode(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Serialize one message into a frame.

    Raises:
        LocalProtocolError: the message is not a wire message, or its frame
            would exceed ``max_frame_bytes``.
    """
    struct_ = STRUCTS_BY_TYPE.get(type(message))
    if struct_ is None:
        raise LocalProtocolError(f"not a wire message: {type(message).__name__}")
    try:
        body: bytes = msgpack.packb(struct_.emit(message), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        # A value msgpack cannot carry: an int outside 64 bits, a str with lone
        # surrogates, a set or other foreign object inside a transfer-params map.
        raise LocalProtocolError(f"{struct_.tag} message cannot be encoded: {exc}") from None
    if len(body) > max_frame_bytes:
        raise LocalProtocolError(
            f"{struct_.tag} frame of {len(body)} bytes exceeds the limit of {max_frame_bytes}"
        )
    return HEADER.pack(len(body)) + body


def _reject_ext(code: int, data: bytes) -> object:
    # max_ext_len=0 stops every ext with a payload; this stops the empty ones.
    raise RemoteProtocolError(f"invalid msgpack body: ext type {code} is not allowed")


def decode_body(body: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decode one frame body (without its header) into a message.

    Raises:
        RemoteProtocolError: invalid msgpack, not a map, unknown ``type``, or a
            field that is missing, unknown or of the wrong type.
    """
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_frame_bytes,
            max_bin_len=max_frame_bytes,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # msgpack's FormatError, StackError, ExtraData and BufferFull are all
        # ValueError subclasses; a disallowed key type is a ValueError too.
        raise RemoteProtocolError(f"invalid msgpack body: {exc}") from None
    except RecursionError:
        raise RemoteProtocolError("invalid msgpack body: nested too deeply") from None
    if type(obj) is not dict:
        raise RemoteProtocolError(f"frame body must be a map, got {type(obj).__name__}")
    tag = obj.get("type")
    if type(tag) is not str:
        raise RemoteProtocolError("frame body has no str 'type' field")
    struct_ = STRUCTS_BY_TAG.get(tag)
    if struct_ is None:
        raise RemoteProtocolError(f"unknown message type {tag!r}")
    return struct_.check(obj, tag)  # type: ignore[return-value]


class FrameDecoder:
    """Incremental, resumable frame decoder (no I/O).

    Args:
        max_frame_bytes: largest body accepted; larger frames raise
            :class:`FrameTooLarge` when their header arrives.

    Resource handling: at most ``max_frame_bytes + 4`` bytes plus one ``feed``
    worth of data are buffered; an oversized body is discarded as it arrives.
    """

    __slots__ = ("_buffer", "_eof", "_max_frame_bytes", "_skip")

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._eof = False
        self._max_frame_bytes = max_frame_bytes
        self._skip = 0

    @property
    def at_eof(self) -> bool:
        """True once EOF was fed and every complete frame has been taken."""
        return self._eof and not self._buffer and self._skip == 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes; ``b""`` marks EOF.

        Raises:
            RemoteProtocolError: data after EOF.
        """
        if self._eof:
            if data:
                raise RemoteProtocolError("data received after EOF")
            return
        if not data:
            self._eof = True
            return
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
        self._buffer += data

    def next_message(self) -> Message | None:
        """Return the next complete message, or ``None`` if more data is needed.

        Raises:
            FrameTooLarge: a header announced an oversized body (skipped; the
                decoder stays usable).
            RemoteProtocolError: the frame was malformed (consumed; the decoder
                stays usable), or EOF arrived in the middle of a frame.
        """
        buffer = self._buffer
        if len(buffer) < HEADER_BYTES:
            self._raise_if_truncated()
            return None
        (size,) = HEADER.unpack_from(buffer)
        if size > self._max_frame_bytes:
            available = len(buffer) - HEADER_BYTES
            dropped = min(size, available)
            del buffer[: HEADER_BYTES + dropped]
            self._skip = size - dropped
            raise FrameTooLarge(size, self._max_frame_bytes)
        end = HEADER_BYTES + size
        if len(buffer) < end:
            self._raise_if_truncated()
            return None
        body = bytes(buffer[HEADER_BYTES:end])
        del buffer[:end]
        return decode_body(body, max_frame_bytes=self._max_frame_bytes)

    def feed_all(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed ``data`` and return every message now complete.

        A malformed frame raises at its position; messages decoded before it in
        this call are lost to the caller, so I/O loops use :meth:`next_message`.
        """
        self.feed(data)
        out: list[Message] = []
        while (message := self.next_message()) is not None:
            out.append(message)
        return out

    def _raise_if_truncated(self) -> None:
        if self._eof and (self._buffer or self._skip):
            pending = len(self._buffer) + self._skip
            self._buffer.clear()
            self._skip = 0
            raise RemoteProtocolError(
                f"connection closed in the middle of a frame ({pending} bytes)"
            )
