"""Server-sent events (the ``text/event-stream`` format), sans-IO: one encoder, one decoder.

Every producer and consumer of SSE in the package goes through this module:
the router's front end (:class:`~epd_actors.openai.format.SseFormatter`
templates its chunk JSON around :data:`DATA_PREFIX` and :data:`EVENT_END`,
and writes comments, errors and ``[DONE]`` with the functions here), the
simulator's ``vllm serve`` double, the ``openai_http`` backend's stream reader
and the load generator.

The format (WHATWG HTML, "Server-sent events"): an event is lines of
``field: value`` ended by a blank line; ``data`` lines join with ``\n``;
``event`` names the event (empty for a plain message); a line starting with
``:`` is a comment.  OpenAI-style streams end with ``data: [DONE]``.

It lives in the HTTP layer, below ``openai/``, because both the OpenAI
formatting (``openai/format.py``) and the stream rendering built on it
(``openai/sse.py``) use it, and neither may import the other in a circle.
"""

from __future__ import annotations

from typing import Final

from ..records import token_record

__all__ = [
    "DATA_PREFIX",
    "DONE_DATA",
    "DONE_EVENT",
    "EVENT_END",
    "SseDecoder",
    "SseError",
    "SseEvent",
    "encode_comment",
    "encode_event",
]

DATA_PREFIX: Final = "data: "
"""What a ``data`` line starts with."""
EVENT_END: Final = "\n\n"
"""What ends a one-line event: its line break and the blank line."""
DONE_DATA: Final = "[DONE]"
"""The ``data`` of the event that ends an OpenAI-style stream normally."""


def encode_event(data: str, event: str = "") -> str:
    """One event: ``event: NAME`` when named, one ``data:`` line per line of ``data``.

    Raises:
        ValueError: ``event`` has a line break (it would end the field early).
    """
    if "\n" in event or "\r" in event:
        raise ValueError(f"an SSE event name cannot hold a line break: {event!r}")
    head = f"event: {event}\n" if event else ""
    if "\n" not in data and "\r" not in data:
        return f"{head}{DATA_PREFIX}{data}{EVENT_END}"
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return head + "".join(f"{DATA_PREFIX}{line}\n" for line in lines) + "\n"


def encode_comment(text: str) -> str:
    """A comment line (clients ignore it); line breaks in ``text`` are flattened."""
    return ": " + text.replace("\r", " ").replace("\n", " ") + EVENT_END


DONE_EVENT: Final = encode_event(DONE_DATA)
"""``data: [DONE]`` and its blank line."""


class SseError(ValueError):
    """Bytes that are not a bounded, UTF-8 event stream."""


@token_record
class SseEvent:
    """One server-sent event: its ``event:`` name (empty for messages) and ``data``."""

    event: str
    data: str


class SseDecoder:
    """Splits a byte stream into server-sent events; bounded, resumable.

    Lines end in ``\\n`` or ``\\r\\n``; comment lines (``:``) and fields other
    than ``event`` and ``data`` are skipped; an event ends at a blank line.

    Args:
        max_event_bytes: the longest line and the largest event's data
            (bytes); a stream that exceeds it is broken, not slow.
    """

    __slots__ = ("_buffer", "_data", "_data_bytes", "_event", "max_event_bytes")

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._data: list[str] = []
        self._data_bytes = 0
        self._event = ""

    def single_data(self, chunk: bytes) -> str | None:
        """The data of ``chunk`` if it is exactly one ``data: ...`` event, else None.

        None also while part of an event is pending, so that :meth:`feed`
        must take the chunk.  Nothing is consumed either way: a caller that
        gets the data has the event, one that gets None feeds the chunk.

        Raises:
            SseError: the event is over the limit or not UTF-8.
        """
        if (
            chunk[:6] == b"data: "
            and chunk[-2:] == b"\n\n"
            and chunk.count(b"\n") == 2
            and chunk[-3:-2] != b"\r"
            and not self._buffer
            and not self._data
            and not self._event
        ):
            if len(chunk) - 8 > self.max_event_bytes:
                raise SseError(f"a server-sent event exceeds {self.max_event_bytes} bytes")
            try:
                return chunk[6:-2].decode("utf-8")
            except UnicodeDecodeError:
                raise SseError("a server-sent event is not UTF-8") from None
        return None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events completed by ``chunk``.

        A chunk that is exactly one ``data: ...`` event, with nothing pending
        before it (a paced stream's read: one token, one event), is taken
        whole (:meth:`single_data`); otherwise the complete lines are split in one call, and a
        ``data`` line, nearly every line of a stream, is handled inline.

        Raises:
            SseError: a line or an event over the limit, or bytes that are not UTF-8.
        """
        single = self.single_data(chunk)
        if single is not None:
            return [SseEvent("", single)]
        buffer = self._buffer
        buffer += chunk
        cut = buffer.rfind(b"\n") + 1
        lines = buffer[:cut].split(b"\n") if cut else []
        del buffer[:cut]
        if len(buffer) > self.max_event_bytes:
            raise SseError(f"a server-sent event line exceeds {self.max_event_bytes} bytes")
        if lines:
            lines.pop()  # what follows the last line break: nothing
        events: list[SseEvent] = []
        try:
            for line in lines:
                if line[-1:] == b"\r":
                    line = line.rstrip(b"\r")
                if line[:5] == b"data:":
                    value = line[6:] if line[5:6] == b" " else line[5:]
                    self._data_bytes += len(value)
                    if self._data_bytes > self.max_event_bytes:
                        raise SseError(f"a server-sent event exceeds {self.max_event_bytes} bytes")
                    self._data.append(value.decode("utf-8"))
                elif not line:
                    if self._data or self._event:
                        data = self._data
                        events.append(
                            SseEvent(self._event, data[0] if len(data) == 1 else "\n".join(data))
                        )
                        self._data, self._data_bytes, self._event = [], 0, ""
                elif line == b"data":  # a field without a colon has an empty value
                    self._data.append("")
                elif line[:1] != b":":
                    name, _, value = line.partition(b":")
                    if name == b"event":
                        self._event = (value[1:] if value[:1] == b" " else value).decode("utf-8")
        except UnicodeDecodeError:
            raise SseError("a server-sent event is not UTF-8") from None
        return events
