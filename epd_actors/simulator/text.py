"""The simulator's deterministic text: prompt digests and lengths, output tokens, stop strings.

Pure functions of the request, shared by every role, so the same request gives
the same text through E+P+D and through PD.
"""

from __future__ import annotations

import hashlib
from typing import Final

from ..errors import EngineError
from ..protocol import ErrorCode, MediaItem, Prompt, SamplingParams, TokenLogprob

VOCAB_SIZE: Final = 32_000
"""Token ids are in ``range(VOCAB_SIZE)``."""

_WORDS: Final = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
    "a", "small", "cat", "sees", "bright", "red", "ball", "near",
    "river", "stone", "tree", "under", "blue", "sky", "and", "green",
    "field", "with", "old", "house", "on", "hill", "where", "wind",
    "sings", "soft", "song", "of", "rain", "light", "falls", "in",
    "quiet", "night", "while", "stars", "glow", "above", "calm", "sea",
    "ship", "sails", "far", "away", "to", "golden", "shore", "at",
    "dawn", "birds", "wake", "people", "walk", "slowly", "home", "again",
)  # fmt: skip

MAX_ALTERNATIVES: Final = len(_WORDS)
"""The most distinct candidates a token can have (one per word)."""

_MASK64: Final = (1 << 64) - 1
_GAMMA: Final = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """The splitmix64 finalizer: a cheap, stable 64-bit hash (unlike the salted ``hash()``)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_digest(prompt: Prompt, media: tuple[MediaItem, ...]) -> str:
    """A stable hex digest of the prompt and its media (what a KV cache depends on).

    Raises:
        EngineError: ``invalid_request`` when a chat part names a missing media item.
    """
    h = hashlib.blake2b(digest_size=16)

    def feed(tag: str, value: str) -> None:
        h.update(f"{tag}{len(value)}:{value}".encode())

    if prompt.text is not None:
        feed("t", prompt.text)
    elif prompt.token_ids is not None:
        feed("i", ",".join(map(str, prompt.token_ids)))
    for message in prompt.messages or ():
        feed("r", message.role)
        for part in message.parts:
            if isinstance(part, str):
                feed("s", part)
            elif 0 <= part < len(media):
                feed("m", str(part))
            else:
                raise EngineError(ErrorCode.INVALID_REQUEST, f"chat part names media #{part}")
    for item in media:
        feed("h", item.content_hash)
    return h.hexdigest()


def count_prompt_tokens(prompt: Prompt, media: tuple[MediaItem, ...], per_item: int) -> int:
    """Whitespace words of the text (or the token ids) plus ``per_item`` per media item."""
    if prompt.text is not None:
        words = len(prompt.text.split())
    elif prompt.token_ids is not None:
        words = len(prompt.token_ids)
    else:
        words = sum(
            len(part.split())
            for message in prompt.messages or ()
            for part in message.parts
            if isinstance(part, str)
        )
    return words + per_item * len(media)


class _TokenSource:
    """Token ``i`` of a request: a pure function of (prompt digest, seed, ``i``)."""

    def __init__(self, digest: str, sampling: SamplingParams) -> None:
        seed = "greedy" if sampling.temperature == 0 else f"seed:{sampling.seed or 0}"
        raw = hashlib.blake2b(f"{digest}|{seed}".encode(), digest_size=8).digest()
        self._base = int.from_bytes(raw, "big")

    def token(self, position: int) -> tuple[int, float, str]:
        """(token id, logprob, text) of the token at ``position`` (0-based)."""
        z = _mix64((self._base + position * _GAMMA) & _MASK64)
        token_id = z % VOCAB_SIZE
        logprob = -((z >> 48) % 4096 + 1) / 1024
        word = _WORDS[token_id % len(_WORDS)]
        return token_id, logprob, word if position == 0 else f" {word}"

    def alternatives(self, position: int, count: int) -> tuple[TokenLogprob, ...]:
        """``count`` candidates for the token at ``position``, the sampled one first.

        The others are the words that follow the sampled one in the word list,
        each a quarter of a nat less likely than the one before; ``count`` is
        at most ``MAX_ALTERNATIVES``, so they are all different.
        """
        token_id, logprob, piece = self.token(position)
        space = "" if position == 0 else " "
        first = token_id % len(_WORDS)
        others = (
            TokenLogprob(space + _WORDS[(first + rank) % len(_WORDS)], logprob - rank / 4)
            for rank in range(1, count)
        )
        return (TokenLogprob(piece, logprob), *others)


class _StopText:
    """Accumulates output text, finds stop strings, holds back a possible partial stop."""

    def __init__(self, stops: tuple[str, ...], *, keep_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._keep_stop = keep_stop  # include_stop_str_in_output
        self._text = ""
        self._sent = 0

    def push(self, piece: str, *, may_stop: bool) -> bool:
        """Append ``piece``; True (and the text cut before it) when a stop string completed."""
        window = max(0, len(self._text) - self._hold)
        self._text += piece
        if not may_stop:
            return False
        found = [(i, s) for s in self._stops if (i := self._text.find(s, window)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        self._text = self._text[: at + len(stop) if self._keep_stop else at]
        return True

    def take(self, *, final: bool) -> str:
        """The text not yet sent that can no longer turn out to be part of a stop string."""
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        out = self._text[self._sent : end]
        self._sent = end
        return out
