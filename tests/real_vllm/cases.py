"""The lane's requests, and the golden answers a plain single vLLM instance gives them.

A case is a chat request at temperature 0 with logprobs, with at most one
media item: a solid-colour PNG, a tiny uncompressed video or a WAV tone
(``media.py``).  ``golden.json`` holds what a plain ``vllm serve`` of the same
tiny model (no connectors, no router) answered to each golden case, recorded
by ``record_golden.py``; the video, audio and reuse cases are compared with a
plain instance started by the lane itself (``golden=False``), so they need no
recording.  The tiny models are built deterministically, so a disaggregated
run through the router must give the same tokens and the same logprobs, within
``LOGPROB_TOLERANCE`` (float32 kernels may round differently on another CPU).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .media import raw_avi, tone_wav

if TYPE_CHECKING:
    from collections.abc import Callable

GOLDEN_PATH = Path(__file__).with_name("golden.json")
LOGPROB_TOLERANCE = 2e-3
IMAGE_SIDE = 56
IMAGE_PROMPT = "Describe this image in one sentence. " * 12
VIDEO_PROMPT = "Describe this video in one sentence. " * 12
AUDIO_PROMPT = "Describe this sound in one sentence. " * 12
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


def video_frames(rgb: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """Four frames (two of Qwen2-VL's temporal patches): the colour, then its channels
    rotated, twice, so that the frames' order matters."""
    r, g, b = rgb
    return [rgb, (g, b, r)] * 2


@dataclass(frozen=True)
class Case:
    """One request: a model kind, an optional media item, a prompt.

    Attributes:
        color: the image's or the video's colour (None: no image, no video).
        kind: the media part's kind, a key of :data:`MEDIA_PARTS`.
        tone_hz: the audio case's tone.
        golden: compared with ``golden.json`` (else with a plain instance's answer).
    """

    name: str
    model_kind: str  # llama, qwen2vl or qwen2audio
    color: tuple[int, int, int] | None
    prompt: str
    kind: str = "image"
    tone_hz: float = 0.0
    golden: bool = True

    @property
    def media(self) -> str | None:
        """The media item's kind; None for a text-only case."""
        return None if self.color is None and not self.tone_hz else self.kind

    def messages(self) -> list[dict[str, Any]]:
        if self.media is None:
            return [{"role": "user", "content": self.prompt}]
        return [
            {
                "role": "user",
                "content": [media_part(self), {"type": "text", "text": self.prompt}],
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


def _image_part(case: Case) -> dict[str, Any]:
    assert case.color is not None
    return {"type": "image_url", "image_url": {"url": image_url(case.color)}}


def _video_part(case: Case) -> dict[str, Any]:
    assert case.color is not None
    video = base64.b64encode(raw_avi(video_frames(case.color))).decode()
    return {"type": "video_url", "video_url": {"url": f"data:video/x-msvideo;base64,{video}"}}


def _audio_part(case: Case) -> dict[str, Any]:
    audio = base64.b64encode(tone_wav(case.tone_hz)).decode()
    return {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}


MEDIA_PARTS: dict[str, Callable[[Case], dict[str, Any]]] = {
    "image": _image_part,
    "video": _video_part,
    "audio": _audio_part,
}
"""The OpenAI content part of each media kind."""


def media_part(case: Case) -> dict[str, Any]:
    """The case's media item as an OpenAI chat content part."""
    assert case.media is not None, case
    return MEDIA_PARTS[case.media](case)


CASES = {
    case.name: case
    for case in (
        Case("green", "qwen2vl", (0, 255, 0), IMAGE_PROMPT),
        Case("blue", "qwen2vl", (0, 0, 255), IMAGE_PROMPT),
        Case("red", "qwen2vl", (255, 0, 0), IMAGE_PROMPT),
        Case("magenta", "qwen2vl", (255, 0, 255), IMAGE_PROMPT),
        Case("qwen-text", "qwen2vl", None, TEXT_PROMPT),
        Case("llama-text", "llama", None, TEXT_PROMPT),
        # Compared with a plain instance of their model (the lane's ``plain`` fixture).
        Case("video-cyan", "qwen2vl", (0, 255, 255), VIDEO_PROMPT, kind="video", golden=False),
        Case("video-orange", "qwen2vl", (255, 128, 0), VIDEO_PROMPT, kind="video", golden=False),
        Case("reuse-yellow", "qwen2vl", (255, 255, 0), IMAGE_PROMPT, golden=False),
        Case(
            "audio-a4", "qwen2audio", None, AUDIO_PROMPT, kind="audio", tone_hz=440.0, golden=False
        ),
    )
}
"""Each case is used by one test only, so that each test's encoder-cache entry is new."""

PLAIN_KINDS = ("qwen2vl", "qwen2audio")
"""The models the lane starts a plain instance of for the non-golden cases."""


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
    assert_matches(case, answer, load_golden()[case.name])


def assert_matches(case: Case, answer: Answer, expected: dict[str, Any]) -> None:
    """``answer`` equals ``expected`` (an :meth:`Answer.to_json`), logprobs within tolerance."""
    assert answer.completion_tokens == expected["completion_tokens"], answer
    assert answer.prompt_tokens == expected["prompt_tokens"], answer
    assert answer.text == expected["text"], (answer.text, expected["text"])
    assert len(answer.logprobs) == len(expected["logprobs"]), answer
    differences = [abs(a - b) for a, b in zip(answer.logprobs, expected["logprobs"], strict=True)]
    assert max(differences) <= LOGPROB_TOLERANCE, (case.name, answer.logprobs, expected)
