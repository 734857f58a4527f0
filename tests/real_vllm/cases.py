"""The lane's requests, and the golden answers a plain single vLLM instance gives them.

A case is a chat request at temperature 0 with logprobs.  ``golden.json``
holds what a plain ``vllm serve`` of the same tiny model (no connectors, no
router) answered to each case, recorded by ``record_golden.py``; the tiny
models are built deterministically, so a disaggregated run through the router
must give the same tokens and the same logprobs, within ``LOGPROB_TOLERANCE``
(float32 kernels may round differently on another CPU).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOLDEN_PATH = Path(__file__).with_name("golden.json")
LOGPROB_TOLERANCE = 2e-3
IMAGE_SIDE = 56
IMAGE_PROMPT = "Describe this image in one sentence. " * 12
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
GOLDEN_TOKENS = 4


def solid_png(rgb: tuple[int, int, int], side: int = IMAGE_SIDE) -> bytes:
    """A ``side`` x ``side`` PNG of one colour."""
    row = b"\x00" + bytes(rgb) * side
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * side))
        + chunk(b"IEND", b"")
    )


def image_url(rgb: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(solid_png(rgb)).decode()


@dataclass(frozen=True)
class Case:
    """One golden request: a model kind, an optional image colour, a prompt."""

    name: str
    model_kind: str  # llama or qwen2vl
    color: tuple[int, int, int] | None
    prompt: str

    def messages(self) -> list[dict[str, Any]]:
        if self.color is None:
            return [{"role": "user", "content": self.prompt}]
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url(self.color)}},
                    {"type": "text", "text": self.prompt},
                ],
            }
        ]

    def body(self, model: str, max_tokens: int = GOLDEN_TOKENS) -> dict[str, Any]:
        return {
            "model": model,
            "messages": self.messages(),
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
        }


CASES = {
    case.name: case
    for case in (
        Case("green", "qwen2vl", (0, 255, 0), IMAGE_PROMPT),
        Case("blue", "qwen2vl", (0, 0, 255), IMAGE_PROMPT),
        Case("red", "qwen2vl", (255, 0, 0), IMAGE_PROMPT),
        Case("magenta", "qwen2vl", (255, 0, 255), IMAGE_PROMPT),
        Case("qwen-text", "qwen2vl", None, TEXT_PROMPT),
        Case("llama-text", "llama", None, TEXT_PROMPT),
    )
}


@dataclass(frozen=True)
class Answer:
    """What matters of a chat answer: tokens' logprobs, text, usage, finish reason."""

    text: str
    logprobs: list[float]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "logprobs": self.logprobs,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
        }


def answer_of(body: dict[str, Any]) -> Answer:
    """Read a non-streamed chat completion (a JSON body)."""
    choice = body["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return Answer(
        text=choice["message"]["content"] or "",
        logprobs=[entry["logprob"] for entry in content],
        prompt_tokens=body["usage"]["prompt_tokens"],
        completion_tokens=body["usage"]["completion_tokens"],
        finish_reason=choice.get("finish_reason"),
    )


def load_golden() -> dict[str, dict[str, Any]]:
    golden: dict[str, dict[str, Any]] = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
    return golden


def assert_matches_golden(case: Case, answer: Answer) -> None:
    expected = load_golden()[case.name]
    assert answer.completion_tokens == expected["completion_tokens"], answer
    assert answer.prompt_tokens == expected["prompt_tokens"], answer
    assert answer.text == expected["text"], (answer.text, expected["text"])
    assert len(answer.logprobs) == len(expected["logprobs"]), answer
    differences = [abs(a - b) for a, b in zip(answer.logprobs, expected["logprobs"], strict=True)]
    assert max(differences) <= LOGPROB_TOLERANCE, (case.name, answer.logprobs, expected)
