"""The lane's media builders (tests/real_vllm/media.py), decoded by FFmpeg (PyAV) here.

The lane sends these bytes to real vLLM engines, whose video and audio loaders
(OpenCV, PyAV, soundfile) all sit on FFmpeg or libsndfile; these tests prove
the files are what the lane claims, pixel by pixel and sample by sample, on
every machine, where the lane itself may be skipped.
"""

from __future__ import annotations

import io
import math
import struct
import wave

import av
import pytest

from tests.real_vllm.cases import CASES, media_part
from tests.real_vllm.media import AUDIO_RATE, VIDEO_SIDE, raw_avi, tone_wav

COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (10, 20, 30)]


def decoded_frames(data: bytes) -> list[list[bytes]]:
    """Each frame's rows of RGB bytes (the decoder's row padding cut off)."""
    frames = []
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "rawvideo"
        for frame in container.decode(stream):
            plane = frame.to_rgb().planes[0]
            raw = bytes(plane)
            rows = [
                raw[y * plane.line_size : y * plane.line_size + frame.width * 3]
                for y in range(frame.height)
            ]
            frames.append(rows)
    return frames


def test_the_video_decodes_to_exactly_its_frames() -> None:
    data = raw_avi(COLORS)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        assert (stream.width, stream.height) == (VIDEO_SIDE, VIDEO_SIDE)
        assert stream.average_rate == 2
    frames = decoded_frames(data)
    assert len(frames) == len(COLORS)
    for rows, rgb in zip(frames, COLORS, strict=True):
        assert rows == [bytes(rgb) * VIDEO_SIDE] * VIDEO_SIDE


def test_a_width_whose_rows_need_padding_still_decodes() -> None:
    data = raw_avi([(1, 2, 3), (4, 5, 6)], width=30, height=14, fps=5)  # 90-byte rows, padded to 92
    frames = decoded_frames(data)
    assert [rows[0][:3] for rows in frames] == [b"\x01\x02\x03", b"\x04\x05\x06"]
    assert all(rows == [rows[0]] * 14 and len(rows[0]) == 90 for rows in frames)


def test_the_video_is_deterministic_and_each_colour_sequence_differs() -> None:
    assert raw_avi(COLORS) == raw_avi(COLORS)
    assert raw_avi(COLORS) != raw_avi(list(reversed(COLORS)))


@pytest.mark.parametrize(
    "bad", [{"colors": []}, {"colors": COLORS, "fps": 0}, {"colors": COLORS, "width": 0}]
)
def test_an_impossible_video_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="a video needs"):
        raw_avi(**bad)  # type: ignore[arg-type]


def test_the_tone_is_a_16_khz_mono_pcm_sine() -> None:
    data = tone_wav(440.0)
    with wave.open(io.BytesIO(data)) as read:
        assert (read.getnchannels(), read.getsampwidth(), read.getframerate()) == (1, 2, AUDIO_RATE)
        samples = struct.unpack(f"<{read.getnframes()}h", read.readframes(read.getnframes()))
    assert len(samples) == AUDIO_RATE
    peak = max(samples)
    assert 16000 < peak <= 16384
    # A quarter period in: the sine's first maximum.
    quarter = round(AUDIO_RATE / 440 / 4)
    assert math.isclose(samples[quarter], peak, rel_tol=0.01)
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate) == ("pcm_s16le", AUDIO_RATE)
        decoded = sum(frame.samples for frame in container.decode(stream))
    assert decoded == AUDIO_RATE


@pytest.mark.parametrize("frequency", [0.0, -1.0, AUDIO_RATE / 2])
def test_an_impossible_tone_is_refused(frequency: float) -> None:
    with pytest.raises(ValueError, match="no such tone"):
        tone_wav(frequency)


def test_every_case_media_part_is_an_openai_content_part_of_its_kind() -> None:
    kinds = {case.media for case in CASES.values() if case.media is not None}
    assert kinds == {"image", "video", "audio"}
    for case in CASES.values():
        parts = case.messages()[0]["content"]
        if case.media is None:
            assert isinstance(parts, str)
            continue
        part = parts[0]
        assert part == media_part(case)
        assert parts[1] == {"type": "text", "text": case.prompt}
    video = media_part(CASES["video-cyan"])
    assert video["type"] == "video_url"
    assert video["video_url"]["url"].startswith("data:video/x-msvideo;base64,")
    audio = media_part(CASES["audio-a4"])
    assert audio["type"] == "input_audio"
    assert audio["input_audio"]["format"] == "wav"
