"""Output text that remembers the JSON string the engine wrote it as.

Theory of operation
-------------------
A streamed token from ``vllm serve`` arrives as a JSON string inside an SSE
chunk, and leaves the router as a JSON string inside the router's own chunk.
When the HTTP backend reads a chunk of the common shape (text only, see
:mod:`epd_actors.backends.openai_http.relay`), it keeps the engine's string
literal beside the decoded text: an :class:`EngineText` is a ``str`` (every
consumer -- the WebSocket front end, a non-streamed answer, the token counts --
reads it as the text it is) whose :attr:`EngineText.json` is that literal, so
:class:`~epd_actors.openai.format.SseFormatter` writes it between its own
prefix and suffix instead of encoding the text again.  Only the literal is
reused: the router's ``id``, ``object``, ``created`` and ``model`` (a model
alias included) are its own, rendered once per request, as before.

Anything that builds a new string (joining the deltas of a batch, slicing)
gets a plain ``str`` back, which is encoded as always: the literal can never
describe text other than its own.
"""

from __future__ import annotations

from typing import Final

_QUOTE: Final = '"'


class EngineText(str):
    """``str`` plus :attr:`json`, the JSON string literal (quotes included) it was decoded from.

    Built as ``EngineText(text)`` with ``json`` set at once (str's own
    constructor: no Python call on the hot path).  The caller
    guarantees that ``json`` is a valid JSON string literal whose
    value is ``text`` and that holds no raw control character (so it fits in
    one SSE ``data:`` line).
    """

    json: str


def joined_literal(literals: list[str]) -> str:
    """One JSON string literal for the concatenation of ``literals`` (each with its quotes).

    A JSON string's escapes never span its closing quote, so dropping the
    quotes between two literals joins their values.  (The parser keeps a
    single literal as it is and calls this only for two or more.)
    """
    return _QUOTE + "".join([literal[1:-1] for literal in literals]) + _QUOTE
