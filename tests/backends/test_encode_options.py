"""Processing options reach E: ``mm_processor_kwargs`` and ``media_io_kwargs`` on E requests.

On the native protocol they travel in ``EncodeRequest.options`` (left off the
wire without them); over ``openai_http`` they are in E's body; an engine that
cannot apply them refuses by name (the simulator), one that can gets them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack
import pytest
import trio

from epd_actors.backends.openai_http.contract import encode_call
from epd_actors.core.encoder_cache import EncoderCache
from epd_actors.core.supervisor import Supervisor
from epd_actors.errors import RemoteWorkerError
from epd_actors.protocol import EncodeRequest, ErrorCode, MediaItem
from epd_actors.protocol.codec import HEADER, decode_body, encode
from epd_actors.request import DoneEvent, ErrorEvent, GenerationRequest
from epd_actors.simulator.engine import SIM_OPTIONS, SimEngine
from epd_actors.testing import build_sim_fleet
from tests.core.test_encoder_reuse import EPD, TTL, image, turn

if TYPE_CHECKING:
    from epd_actors.protocol import StageResult
    from epd_actors.request import GenerationEvent

OPTIONS = {"mm_processor_kwargs": {"fps": 1}, "media_io_kwargs": {"video": {"num_frames": 4}}}


def with_options(request: GenerationRequest, options: dict[str, object]) -> GenerationRequest:
    return GenerationRequest(
        request.prompt,
        media=request.media,
        sampling=request.sampling,
        request_id=request.request_id,
        options=options,
    )


async def run_one(supervisor: Supervisor, request: GenerationRequest) -> list[GenerationEvent]:
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        async with supervisor.generate(request) as events:
            out = [event async for event in events]
        nursery.cancel_scope.cancel()
    return out


def test_encode_options_travel_and_are_left_off_the_wire_without_them() -> None:
    item = MediaItem.from_bytes(b"\x89PNG x", "image/png")
    with_them = EncodeRequest("r:0", (item,), options=dict(OPTIONS))
    assert decode_body(encode(with_them)[HEADER.size :]) == with_them
    plain = encode(EncodeRequest("r:0", (item,)))
    body = msgpack.unpackb(plain[HEADER.size :], raw=False)
    assert "options" not in str(body)  # what a worker predating the field reads, as before


def test_the_openai_http_encode_body_carries_the_processing_options() -> None:
    item = MediaItem.from_bytes(b"\x89PNG x", "image/png")
    call = encode_call(
        EncodeRequest("r:0", (item,), options=dict(OPTIONS)), 0, model="m", suffix="a"
    )
    assert call.body["mm_processor_kwargs"] == {"fps": 1}
    assert call.body["media_io_kwargs"] == {"video": {"num_frames": 4}}
    plain = encode_call(EncodeRequest("r:0", (item,)), 0, model="m", suffix="a")
    assert "mm_processor_kwargs" not in plain.body


async def test_the_simulators_encoder_refuses_processing_options_by_name() -> None:
    fleet = build_sim_fleet(EPD)
    supervisor = Supervisor(fleet.pools)
    events = await run_one(supervisor, with_options(turn(image("cat")), dict(OPTIONS)))
    last = events[-1]
    assert isinstance(last, ErrorEvent)
    assert isinstance(last.error, RemoteWorkerError)
    assert last.error.code == ErrorCode.INVALID_REQUEST
    assert last.error.stage == "encode"
    assert last.error.param == "mm_processor_kwargs"
    assert fleet.total("encode_requests") == 0  # refused before the engine ran


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "reuse"])
async def test_an_encoder_that_applies_them_gets_exactly_the_processing_options(
    monkeypatch: pytest.MonkeyPatch, reuse: bool
) -> None:
    seen: list[dict[str, object] | None] = []
    original = SimEngine.encode

    async def recording(self: SimEngine, request: EncodeRequest) -> StageResult:
        seen.append(request.options)
        return await original(self, request)

    accepted = SIM_OPTIONS | {"mm_processor_kwargs", "media_io_kwargs"}
    monkeypatch.setattr(SimEngine, "supported_options", accepted)
    monkeypatch.setattr(SimEngine, "encode", recording)
    fleet = build_sim_fleet(EPD)
    memory = {"encode": EncoderCache(TTL)} if reuse else None
    supervisor = Supervisor(fleet.pools, encoder_caches=memory)
    request = with_options(turn(image("cat")), {**OPTIONS, "ignore_eos": True})
    events = await run_one(supervisor, request)
    assert isinstance(events[-1], DoneEvent)
    assert seen == [OPTIONS]  # the sampling option stays with P and D
    plain = await run_one(Supervisor(fleet.pools), turn(image("dog")))
    assert isinstance(plain[-1], DoneEvent)
    assert seen[-1] is None
