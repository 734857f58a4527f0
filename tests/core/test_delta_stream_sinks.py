"""A delta stream's sink: deltas handed over in the producer's task, the rest on ``receive``."""

from __future__ import annotations

import trio
import trio.testing

from epd_actors.backends.inprocess import InProcessBackend
from epd_actors.protocol import Delta, GenerateRequest, Prompt, Role, SamplingParams
from epd_actors.simulator.config import SimConfig
from epd_actors.simulator.engine import SimEngine
from epd_actors.simulator.store import create_sim_stores


def backend() -> InProcessBackend:
    stores = create_sim_stores()
    engine = SimEngine(
        Role("pd"), worker_id="pd-0", config=SimConfig(), ec_store=stores.ec, kv_store=stores.kv
    )
    return InProcessBackend("pd-0", engine, stage="pd")


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, Prompt(text="hello"), sampling=SamplingParams(max_tokens=8))


async def tokens_without_a_sink() -> list[int]:
    tokens: list[int] = []
    async with backend().open_stream(request("plain")) as stream:
        while True:
            try:
                delta = await stream.receive()
            except trio.EndOfChannel:
                return tokens
            tokens.extend(delta.token_ids)


async def test_an_in_process_stream_hands_deltas_to_its_sink_while_its_reader_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expected = await tokens_without_a_sink()
    taken: list[Delta] = []
    received: list[Delta] = []
    async with backend().open_stream(request("sunk")) as stream:
        stream.set_sink(lambda delta: taken.append(delta) is None)
        while True:
            try:
                received.append(await stream.receive())
            except trio.EndOfChannel:
                break
    assert taken  # handed over in the engine's task, the reader never woke for them
    assert all(delta.finish_reason is None for delta in taken)
    assert received[-1].finish_reason is not None  # the end always comes on receive
    tokens = [t for delta in [*taken, *received] for t in delta.token_ids]
    assert tokens == expected


async def test_a_refusing_sink_leaves_every_delta_to_the_reader_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expected = await tokens_without_a_sink()
    offered: list[Delta] = []
    received: list[Delta] = []
    async with backend().open_stream(request("refused")) as stream:
        stream.set_sink(lambda delta: offered.append(delta) is not None)  # always False
        while True:
            try:
                received.append(await stream.receive())
            except trio.EndOfChannel:
                break
    assert offered
    assert [t for delta in received for t in delta.token_ids] == expected
