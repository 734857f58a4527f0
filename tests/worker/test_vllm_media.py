"""Video and audio to vLLM's ``multi_modal_data``: the decoders, with fake decoding libraries.

The real libraries (librosa, soundfile, PyAV, OpenCV, numpy) are not
installed here; fakes in ``sys.modules`` speak the calls the decoders make.
What only the real-vLLM lane proves: that vLLM's processors take these shapes
(tests/real_vllm, the video and audio cases).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from epd_actors.errors import EngineError
from epd_actors.protocol import ChatMessage, ErrorCode, MediaItem, Prompt
from epd_actors.worker.engines.vllm_io import VLLM_OPTIONS, decode_media_item, render_prompt
from epd_actors.worker.engines.vllm_media import frame_indices

WAV = MediaItem.from_bytes(b"RIFF fake wav", "audio/wav")
MP4 = MediaItem.from_bytes(b"fake mp4", "video/mp4")


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def missing(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def fake_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_module(monkeypatch, "numpy", stack=lambda frames: ("stacked", list(frames)))


def test_audio_is_samples_and_the_files_own_rate_with_librosa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []

    def load(source: Any, **kwargs: Any) -> tuple[str, int]:
        calls.append(kwargs)
        assert source.read() == WAV.data
        return "samples", 22050

    fake_module(monkeypatch, "librosa", load=load)
    assert decode_media_item(WAV) == ("samples", 22050.0)
    assert calls == [{"sr": None, "mono": True}]  # as vLLM's AudioMediaIO: no resampling


def test_audio_falls_back_to_soundfile(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, "librosa")
    fake_module(monkeypatch, "soundfile", read=lambda source, **kw: ("pcm", 16000))
    assert decode_media_item(WAV) == ("pcm", 16000.0)


def test_audio_without_a_library_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, "librosa", "soundfile")
    with pytest.raises(EngineError, match="librosa or soundfile") as caught:
        decode_media_item(WAV)
    assert caught.value.code == ErrorCode.ENGINE_ERROR


def test_undecodable_audio_is_an_invalid_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(source: Any, **kwargs: Any) -> None:
        raise RuntimeError("not audio")

    fake_module(monkeypatch, "librosa", load=load)
    with pytest.raises(EngineError, match="cannot decode audio") as caught:
        decode_media_item(WAV)
    assert caught.value.code == ErrorCode.INVALID_REQUEST


class _Frame:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_ndarray(self, format: str) -> str:
        assert format == "rgb24"
        return f"frame{self.n}"


class _Container:
    def __init__(self, total: int) -> None:
        stream = types.SimpleNamespace(average_rate=10)
        self.streams = types.SimpleNamespace(video=[stream])
        self.total = total

    def __enter__(self) -> _Container:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def decode(self, stream: object) -> list[_Frame]:
        return [_Frame(n) for n in range(self.total)]


def test_video_is_32_evenly_sampled_frames_and_metadata_with_pyav(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_numpy(monkeypatch)
    fake_module(monkeypatch, "av", open=lambda source: _Container(100))
    frames, metadata = decode_media_item(MP4)  # type: ignore[misc]
    assert frames[0] == "stacked"
    assert len(frames[1]) == 32
    assert frames[1][0] == "frame0"
    assert frames[1][-1] == "frame99"
    assert metadata["total_num_frames"] == 100
    assert metadata["fps"] == 10.0
    assert metadata["duration"] == 10.0
    assert metadata["video_backend"] == "pyav"
    assert len(metadata["frames_indices"]) == 32


def test_video_without_a_library_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, "av", "cv2")
    with pytest.raises(EngineError, match="PyAV") as caught:
        decode_media_item(MP4)
    assert caught.value.code == ErrorCode.ENGINE_ERROR


def test_a_kind_vllm_takes_no_data_for_is_refused() -> None:
    item = MediaItem.from_bytes(b"%PDF", "application/pdf")
    with pytest.raises(EngineError) as caught:
        decode_media_item(item)
    assert caught.value.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("total", "wanted", "expected"),
    [(10, 32, list(range(10))), (5, 1, [0]), (9, 3, [0, 4, 8]), (0, 4, [])],
)
def test_frame_indices_spread_evenly(total: int, wanted: int, expected: list[int]) -> None:
    assert frame_indices(total, wanted) == expected


class _Tokenizer:
    chat_template = "t"

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
        kinds = [p["type"] for m in conversation for p in m["content"] if isinstance(p, dict)]
        return " ".join(kinds)


def test_video_and_audio_go_to_multi_modal_data_by_kind_with_processor_options() -> None:
    prompt = Prompt(messages=(ChatMessage("user", (0, 1, "what?")),))
    rendered = render_prompt(
        prompt,
        (MP4, WAV),
        tokenizer=_Tokenizer(),
        decode_media=lambda item: f"decoded {item.modality}",
        options={"mm_processor_kwargs": {"fps": 2}},
    )
    assert rendered.prompt["prompt"] == "video audio text"
    assert rendered.prompt["multi_modal_data"] == {
        "video": ["decoded video"],
        "audio": ["decoded audio"],
    }
    assert rendered.prompt["mm_processor_kwargs"] == {"fps": 2}
    assert "mm_processor_kwargs" in VLLM_OPTIONS
    assert "media_io_kwargs" not in VLLM_OPTIONS  # refused by name: the decoders take none
