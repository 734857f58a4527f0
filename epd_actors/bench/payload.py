"""Request bodies for the load generator: text prompts and synthetic PNG images.

Bodies are built before the run starts (:class:`BodyMaker` keeps a small
pool of distinct encoded bodies and hands them out in turn), so the load
generator spends no CPU on JSON or base64 while it measures.
"""

from __future__ import annotations

import base64
import json
import math
import random
import struct
import zlib
from dataclasses import dataclass

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


def synthetic_png(size_bytes: int, *, seed: int = 0) -> bytes:
    """A valid RGB PNG of about ``size_bytes`` bytes (random pixels, stored uncompressed)."""
    pixels = max(1, size_bytes // 3)
    side = max(1, math.isqrt(pixels))
    rng = random.Random(seed)
    row = 1 + side * 3
    raw = bytearray(rng.randbytes(row * side))
    raw[::row] = bytes(side)  # filter byte 0 at the start of each row
    idat = zlib.compress(bytes(raw), 0)
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def prompt_text(words: int, *, seed: int) -> str:
    """``words`` words, different for each seed (so prompts are distinct)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, words)))


@dataclass(frozen=True, slots=True)
class Workload:
    """What each request asks for.

    Attributes:
        model: the ``model`` field.
        endpoint: ``chat`` (``/v1/chat/completions``) or ``completions``.
        max_tokens: output tokens asked for (``ignore_eos`` is set too, as
            vLLM's benchmarks do, so every request produces them all).
        prompt_words: prompt length in words.
        images: images per multimodal request (chat only).
        image_bytes: size of each synthetic PNG.
        mm_fraction: share of requests that carry images (0..1).
        stream: ask for a streamed response (with ``include_usage``).
        distinct: how many distinct bodies of each kind to cycle through.
    """

    model: str = "sim-model"
    endpoint: str = "chat"
    max_tokens: int = 64
    prompt_words: int = 32
    images: int = 0
    image_bytes: int = 64 * 1024
    mm_fraction: float = 1.0
    stream: bool = True
    distinct: int = 16

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def build_body(workload: Workload, index: int, *, with_images: bool) -> bytes:
    """The JSON body of request ``index`` (images when ``with_images``)."""
    text = prompt_text(workload.prompt_words, seed=index)
    body: dict[str, object] = {"model": workload.model, "max_tokens": workload.max_tokens}
    if workload.endpoint == "chat":
        if with_images and workload.images > 0:
            parts: list[dict[str, object]] = [{"type": "text", "text": text}]
            for image in range(workload.images):
                png = synthetic_png(workload.image_bytes, seed=index * 1000 + image)
                url = "data:image/png;base64," + base64.b64encode(png).decode()
                parts.append({"type": "image_url", "image_url": {"url": url}})
            body["messages"] = [{"role": "user", "content": parts}]
        else:
            body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body["ignore_eos"] = True
    if workload.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


class BodyMaker:
    """Pre-built bodies, handed out in turn; the multimodal share follows ``mm_fraction``."""

    def __init__(self, workload: Workload, *, seed: int = 0) -> None:
        count = max(1, workload.distinct)
        self._text = [build_body(workload, seed + i, with_images=False) for i in range(count)]
        self._mm: list[bytes] = []
        if workload.images > 0 and workload.mm_fraction > 0 and workload.endpoint == "chat":
            self._mm = [build_body(workload, seed + i, with_images=True) for i in range(count)]
        self._fraction = workload.mm_fraction
        self._rng = random.Random(seed)
        self._next = 0

    def next_body(self) -> bytes:
        index = self._next
        self._next += 1
        if self._mm and (self._fraction >= 1.0 or self._rng.random() < self._fraction):
            return self._mm[index % len(self._mm)]
        return self._text[index % len(self._text)]
