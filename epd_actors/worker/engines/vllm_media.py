"""Media bytes -> what vLLM's ``multi_modal_data`` takes, per kind, as vLLM's server makes it.

vLLM's OpenAI server (``vllm/multimodal/media``: ``ImageMediaIO``,
``AudioMediaIO``, ``VideoMediaIO``) hands its engine:

* an image as a PIL image in RGB (Pillow: vLLM depends on it);
* audio as ``(samples, sampling_rate)``: a mono float32 array at the file's own
  rate (``librosa.load(..., sr=None)``; the model's processor resamples);
* a video as ``(frames, metadata)``: ``num_frames`` (32 by default) RGB frames
  sampled evenly over the clip as one ``uint8`` array of shape
  ``(frames, height, width, 3)``, and a dict of ``total_num_frames``, ``fps``,
  ``duration``, ``frames_indices`` and ``video_backend``.

The decoding libraries are optional and imported on first use: librosa or
soundfile for audio, PyAV or OpenCV for video; a kind whose libraries are all
missing is refused by name.  :data:`DECODERS` maps a modality to its decoder
(a registry: a new kind is one entry).  Synchronous and CPU-bound: the engine
runs it in a worker thread.
"""

from __future__ import annotations

import importlib
import io
import os
import tempfile
from collections.abc import Callable
from typing import Any, Final

from ...errors import EngineError
from ...protocol import ErrorCode, MediaItem

__all__ = [
    "AUDIO_LOADERS",
    "DECODERS",
    "VIDEO_LOADERS",
    "VIDEO_NUM_FRAMES",
    "decode_audio",
    "decode_image",
    "decode_video",
    "frame_indices",
]

VIDEO_NUM_FRAMES: Final = 32
"""Frames sampled from a video, as vLLM's ``VideoMediaIO`` defaults to."""

Loader = Callable[[bytes], Any]
"""Bytes -> decoded media, using one optional library (imported inside)."""


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorCode.INVALID_REQUEST, message)


def decode_image(item: MediaItem) -> object:
    """Decode an image with Pillow into RGB.

    Raises:
        EngineError: ``engine_error`` without Pillow; ``invalid_request`` for bad bytes.
    """
    try:
        image_module = _module("PIL.Image")
    except ImportError:
        raise EngineError(ErrorCode.ENGINE_ERROR, "Pillow is needed to decode images") from None
    try:
        with image_module.open(io.BytesIO(item.data)) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, ValueError, image_module.DecompressionBombError) as exc:
        raise _invalid(f"cannot decode image: {exc}") from None


# ---------------------------------------------------------------- audio


def _audio_librosa(data: bytes) -> tuple[Any, float]:
    librosa = _module("librosa")
    samples, rate = librosa.load(io.BytesIO(data), sr=None, mono=True)
    return samples, float(rate)


def _audio_soundfile(data: bytes) -> tuple[Any, float]:
    soundfile = _module("soundfile")
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    if getattr(samples, "ndim", 1) > 1:  # (samples, channels) -> mono, as librosa does
        samples = samples.mean(axis=1)
    return samples, float(rate)


AUDIO_LOADERS: dict[str, Loader] = {"librosa": _audio_librosa, "soundfile": _audio_soundfile}
"""Audio loaders by the library each needs, tried in this order."""


def decode_audio(item: MediaItem) -> tuple[Any, float]:
    """``(samples, sampling_rate)`` of an audio item (mono float32, the file's rate).

    Raises:
        EngineError: ``engine_error`` when no audio library is installed (named);
            ``invalid_request`` when the bytes do not decode.
    """
    result: tuple[Any, float] = _first_loader(item, AUDIO_LOADERS, "audio", "librosa or soundfile")
    return result


# ---------------------------------------------------------------- video


def frame_indices(total: int, wanted: int) -> list[int]:
    """``wanted`` frame numbers spread evenly over ``total`` frames (all when fewer)."""
    if total <= 0:
        return []
    if wanted <= 0 or wanted >= total:
        return list(range(total))
    if wanted == 1:
        return [0]
    step = (total - 1) / (wanted - 1)
    return [round(n * step) for n in range(wanted)]


def _video_pyav(data: bytes, num_frames: int = VIDEO_NUM_FRAMES) -> tuple[Any, dict[str, Any]]:
    av = _module("av")
    numpy = _module("numpy")
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        fps = float(stream.average_rate or 0.0)
    return _sampled(numpy, frames, fps, num_frames, "pyav")


def _video_opencv(data: bytes, num_frames: int = VIDEO_NUM_FRAMES) -> tuple[Any, dict[str, Any]]:
    cv2 = _module("cv2")
    numpy = _module("numpy")
    handle, path = tempfile.mkstemp(suffix=".video")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        capture = cv2.VideoCapture(path)
        try:
            fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
            frames = []
            while True:
                ok, frame = capture.read()
                if not ok:
                    break
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        finally:
            capture.release()
    finally:
        os.unlink(path)
    return _sampled(numpy, frames, fps, num_frames, "opencv")


def _sampled(
    numpy: Any, frames: list[Any], fps: float, num_frames: int, backend: str
) -> tuple[Any, dict[str, Any]]:
    if not frames:
        raise ValueError("no video frames")
    chosen = frame_indices(len(frames), num_frames)
    metadata = {
        "total_num_frames": len(frames),
        "fps": fps,
        "duration": len(frames) / fps if fps else 0.0,
        "frames_indices": chosen,
        "video_backend": backend,
    }
    return numpy.stack([frames[n] for n in chosen]), metadata


VIDEO_LOADERS: dict[str, Loader] = {"av": _video_pyav, "cv2": _video_opencv}
"""Video loaders by the module each needs, tried in this order."""


def decode_video(item: MediaItem) -> tuple[Any, dict[str, Any]]:
    """``(frames, metadata)`` of a video item (:data:`VIDEO_NUM_FRAMES` frames, RGB).

    Raises:
        EngineError: ``engine_error`` when no video library is installed (named);
            ``invalid_request`` when the bytes do not decode.
    """
    result: tuple[Any, dict[str, Any]] = _first_loader(
        item, VIDEO_LOADERS, "video", "PyAV (av) or OpenCV (opencv-python-headless)"
    )
    return result


def _first_loader(item: MediaItem, loaders: dict[str, Loader], kind: str, needs: str) -> Any:
    """Decode with the first loader whose library imports; refuse by name when none does."""
    for loader in loaders.values():
        try:
            return loader(item.data)
        except ImportError:
            continue
        except Exception as exc:  # each library raises its own decode errors
            raise _invalid(f"cannot decode {kind} ({item.mime_type}): {exc}") from None
    raise EngineError(ErrorCode.ENGINE_ERROR, f"decoding {kind} needs {needs}; none is installed")


DECODERS: dict[str, Callable[[MediaItem], object]] = {
    "image": decode_image,
    "audio": decode_audio,
    "video": decode_video,
}
"""Modality -> its decoder: what :func:`~.vllm_io.decode_media_item` dispatches on."""
