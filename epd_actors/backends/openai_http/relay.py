"""The common vLLM stream chunk, recognised by one regular expression instead of a JSON parse.

Theory of operation
-------------------
Nearly every event of a streamed vLLM answer is one token of text::

    {"id":"chatcmpl-..","object":"chat.completion.chunk","created":1764547200,
     "model":"m","choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,
     "finish_reason":null,"token_ids":[1234]}]}

(``"text":" tok"`` in place of the ``delta`` for ``/v1/completions``).  All the
router must learn from such a chunk is its text and its token ids: it carries
no finish reason, no usage, no error, no log-probabilities, no tool calls and
no second choice.  :meth:`ChunkScanner.scan` matches exactly that shape and
returns the ``content``/``text`` member's text, its JSON string literal and
the token ids as written.  The stream's prefix (``id`` to ``model``) is matched
once and then compared; the choice is one expression over vLLM's member order
(``logprobs`` before the text and the token ids before the finish reason are
taken too, as the simulator writes them), with ``stop_reason``, ``token_ids``
(an array or null), ``prompt_token_ids`` and ``usage`` optional and null.
Every other event (the chat role chunk, the finish and usage chunks, an error,
logprobs, ``tool_calls``, ``n > 1``, anything unexpected) does not match and
takes the full parse (:class:`~.contract.DeltaParser`), so what the router
learns from a stream is the same either way; only the cost differs.

The literal is reused as the router's own chunk's text
(:class:`~epd_actors.openai.engine_text.EngineText`), so it must be a valid JSON
string that fits in one SSE line: the expression refuses raw control
characters (a ``data:`` line split over two lines joins with a newline), and
an escape is decoded with the standard decoder, which refuses bad ones (the
chunk then takes the full parse, which reports it).

Nothing here does I/O; a scanner keeps only its stream's chunk prefix.
"""

from __future__ import annotations

import json.decoder
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

_STRING: Final = r'"[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*"'
"""A JSON string literal without raw control characters (escapes checked on decoding)."""
_PLAIN_STRING: Final = r'"[^"\\\x00-\x1f]*"'
_IDS: Final = r'(?:,"token_ids":(?:\[([0-9]+(?:,[0-9]+)*)?\]|null))?'
"""The optional token ids (null when vLLM was not asked for them)."""
_TAIL: Final = r'(?:,"usage":null)?(?:,"prompt_token_ids":null)?\}'


def _head(obj: str) -> re.Pattern[str]:
    return re.compile(
        rf'\{{"id":{_PLAIN_STRING},"object":"{obj}","created":[0-9]+,'
        rf'"model":{_PLAIN_STRING},"choices":\['
    )


def _choice(opener: str, closer: str) -> re.Pattern[str]:
    """The one choice in vLLM's member order, or the text and ``logprobs`` swapped, or the
    token ids before the finish reason (the simulator's order)."""
    text = rf"{opener}({_STRING}){closer}"
    return re.compile(
        rf'\{{"index":0,(?:{text},"logprobs":null|"logprobs":null,{text}){_IDS}'
        rf',"finish_reason":null(?:,"stop_reason":null)?{_IDS}'
        rf'(?:,"prompt_token_ids":null)?\}}\]{_TAIL}'
    )


_CHAT_CHOICE: Final = _choice(r'"delta":\{"content":', r"\}")
_COMPLETION_CHOICE: Final = _choice(r'"text":', "")
# The standard decoder's string scanner (C); typeshed does not declare it.
_decode_string: Final[Callable[[str, int], tuple[str, int]]] = json.decoder.scanstring  # type: ignore[attr-defined]

_CHAT_HEAD: Final = _head(r"chat\.completion\.chunk")
_COMPLETION_HEAD: Final = _head("text_completion")


class ChunkScanner:
    """:meth:`scan` for the events of one stream (chat or completion chunks).

    The part of a chunk before its choices (``id``, ``object``, ``created``,
    ``model``) is the same in every chunk of a vLLM stream: it is matched
    once and then compared as a prefix.

    Args:
        chat: chat chunks (``delta.content``) rather than completion chunks (``text``).
    """

    __slots__ = ("_choice", "_head", "_prefix")

    def __init__(self, *, chat: bool) -> None:
        self._head = _CHAT_HEAD if chat else _COMPLETION_HEAD
        self._choice = _CHAT_CHOICE if chat else _COMPLETION_CHOICE
        self._prefix: str | None = None

    def scan(self, data: str) -> tuple[str, str, str | None] | None:
        """``(text, literal, token ids)`` of a text-only chunk, or None for any other event.

        ``literal`` is the text's JSON string literal, quotes included; the
        token ids are the array's inside as written (``"12,34"``), None when
        the chunk has no ``token_ids`` or an empty array.  None also when the
        literal holds an escape the standard decoder refuses.
        """
        prefix = self._prefix
        if prefix is None or not data.startswith(prefix):
            head = self._head.match(data)
            if head is None:
                return None
            prefix = self._prefix = head.group()
        match = self._choice.fullmatch(data, len(prefix))
        if match is None:
            return None
        first, second, ids, later_ids = match.group(1, 2, 3, 4)
        literal = second if first is None else first
        if "\\" not in literal:
            return literal[1:-1], literal, (later_ids if ids is None else ids)
        try:
            text, end = _decode_string(literal, 1)
        except ValueError:
            return None
        if end != len(literal):
            return None
        return text, literal, (later_ids if ids is None else ids)
