"""The lane's media, made in plain Python: a tiny uncompressed AVI video and a WAV tone.

Each is deterministic (the same bytes on every machine), lossless (a decoder
returns exactly the pixels and samples written) and small, so a request's
encoder-cache entry depends only on the case, and the answers of a plain
engine and of the router can be compared token by token.

* :func:`raw_avi`: an AVI (RIFF) file of ``rgb24`` frames, stored the way the
  format keeps uncompressed video (``BI_RGB``: rows of BGR pixels, each row
  padded to four bytes), with the ``idx1`` index; FFmpeg (which both OpenCV and
  PyAV use) reads it as ``rawvideo``.  The rows are stored top-down (a negative
  height in the stream format): OpenCV 5.1, which ``vllm serve`` decodes video
  with, corrupts its heap on bottom-up ``BI_RGB`` frames ("malloc_consolidate():
  invalid chunk size", or SIGSEGV in ``sws_scale_frame``).
* :func:`tone_wav`: a mono 16-bit PCM WAV (the standard library's ``wave``) of
  one sine tone, at 16 kHz, the rate Whisper-style feature extractors expect,
  so no engine resamples it.

No I/O beyond building bytes; nothing here imports vLLM.
"""

from __future__ import annotations

import io
import math
import struct
import wave
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

RGB = tuple[int, int, int]

VIDEO_SIDE = 56
"""Frame width and height: one 2x2 block of Qwen2-VL's 28x28 merged patches."""
VIDEO_FPS = 2
AUDIO_RATE = 16000
AUDIO_SECONDS = 1.0
AUDIO_AMPLITUDE = 0.5


def _chunk(fourcc: bytes, data: bytes) -> bytes:
    """A RIFF chunk: id, little-endian size, data, padded to an even length."""
    return fourcc + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) % 2 else b"")


def _list(kind: bytes, *chunks: bytes) -> bytes:
    return _chunk(b"LIST", kind + b"".join(chunks))


def _row_stride(width: int) -> int:
    return (width * 3 + 3) // 4 * 4


def frame_bytes(rgb: RGB, width: int, height: int) -> bytes:
    """One ``BI_RGB`` frame of a single colour: ``height`` rows of BGR pixels, padded."""
    row = bytes((rgb[2], rgb[1], rgb[0])) * width
    return (row + b"\x00" * (_row_stride(width) - len(row))) * height


def raw_avi(
    colors: Sequence[RGB],
    *,
    width: int = VIDEO_SIDE,
    height: int = VIDEO_SIDE,
    fps: int = VIDEO_FPS,
) -> bytes:
    """An uncompressed AVI with one solid-colour frame per entry of ``colors``.

    Raises:
        ValueError: no frames, or a size or rate that is not positive.
    """
    if not colors or width <= 0 or height <= 0 or fps <= 0:
        raise ValueError(f"a video needs frames and a positive size and rate: {len(colors)} frames")
    frames = [frame_bytes(rgb, width, height) for rgb in colors]
    size = len(frames[0])
    avih = struct.pack(
        "<14I",
        1_000_000 // fps,  # microseconds per frame
        size * fps,  # max bytes per second
        0,  # padding granularity
        0x10,  # AVIF_HASINDEX
        len(frames),
        0,  # initial frames
        1,  # streams
        size,  # suggested buffer size
        width,
        height,
        0,
        0,
        0,
        0,
    )
    strh = struct.pack(
        "<4s4sIHHIIIIIIIIhhhh",
        b"vids",
        b"\x00\x00\x00\x00",  # handler: none (uncompressed)
        0,  # flags
        0,  # priority
        0,  # language
        0,  # initial frames
        1,  # scale
        fps,  # rate: fps = rate / scale
        0,  # start
        len(frames),  # length in frames
        size,  # suggested buffer size
        0xFFFFFFFF,  # quality: default
        0,  # sample size: varies per chunk
        0,
        0,
        width,
        height,
    )
    # BITMAPINFOHEADER; the negative height says the rows run top-down (see the module doc).
    strf = struct.pack("<IiiHHIIiiII", 40, width, -height, 1, 24, 0, size, 0, 0, 0, 0)
    header = _list(
        b"hdrl", _chunk(b"avih", avih), _list(b"strl", _chunk(b"strh", strh), _chunk(b"strf", strf))
    )
    movi = _list(b"movi", *(_chunk(b"00db", frame) for frame in frames))
    index = b""
    offset = 4  # from the 'movi' fourcc to each chunk's id
    for frame in frames:
        index += struct.pack("<4sIII", b"00db", 0x10, offset, len(frame))  # AVIIF_KEYFRAME
        offset += 8 + len(frame) + len(frame) % 2
    body = b"AVI " + header + movi + _chunk(b"idx1", index)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def tone_wav(
    frequency_hz: float, *, seconds: float = AUDIO_SECONDS, rate: int = AUDIO_RATE
) -> bytes:
    """A mono 16-bit PCM WAV of one sine tone.

    Raises:
        ValueError: a frequency, length or rate that is not positive, or a tone at or
            above the Nyquist frequency (it would alias).
    """
    if frequency_hz <= 0 or seconds <= 0 or rate <= 0 or frequency_hz >= rate / 2:
        raise ValueError(f"no such tone: {frequency_hz} Hz for {seconds} s at {rate} Hz")
    count = round(seconds * rate)
    peak = round(AUDIO_AMPLITUDE * 32767)
    samples = [round(peak * math.sin(2 * math.pi * frequency_hz * n / rate)) for n in range(count)]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(struct.pack(f"<{count}h", *samples))
    return buffer.getvalue()
