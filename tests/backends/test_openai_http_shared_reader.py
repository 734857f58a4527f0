"""The HTTP backend's shared stream reader, against simulated ``vllm serve`` servers (loopback).

With a sink set, the backend's read hub reads a stream while its reader
waits: the reader resumes only for what the sink cannot take (a refusal, the
terminal delta, a failure), the deltas keep their order, and every failure a
stream can meet while the hub reads it -- a stalled server, one whose engine
fails mid-stream, one that goes away, a worker the probes take down -- still
ends the stream with the router's error, as it does without the hub.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.backends.openai_http.backend import OpenAIHttpBackendFactory
from epd_actors.backends.openai_http.settings import OpenAIHttpSettings
from epd_actors.errors import RemoteWorkerError, WorkerDisconnected
from epd_actors.protocol import Delta, GenerateRequest, Prompt, SamplingParams
from epd_actors.simulator.engine import SimConfig
from epd_actors.transport.read_hub import ReadHub
from tests.backends.test_openai_http_backend import (
    FAST,
    QUICK,
    SimHttpFleet,
    read_to_the_end,
    running_backend,
    sim_http_fleet,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from epd_actors.backends.openai_http.backend import OpenAIHttpBackend, OpenAIHttpDeltaStream

pytestmark = pytest.mark.skipif(not ReadHub.available, reason="the read hub needs epoll")

PACED = replace(QUICK, output_token_s=0.002)  # one token per delta, each its own read
GUARD_S = 5.0


def generate(request_id: str, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id, Prompt(text="tell me"), sampling=SamplingParams(max_tokens=max_tokens)
    )


async def read_all(stream: OpenAIHttpDeltaStream) -> list[Delta]:
    deltas = []
    while True:
        try:
            deltas.append(await stream.receive())
        except trio.EndOfChannel:
            return deltas


def text(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


async def stream_with_sink(
    backend: OpenAIHttpBackend, sink_takes: int | None, max_tokens: int = 8
) -> list[tuple[str, Delta]]:
    """Each delta in order, and who got it ("sink" or "receive").

    The sink refuses every delta after its first ``sink_takes``.
    """
    seen: list[tuple[str, Delta]] = []

    def sink(delta: Delta) -> bool:
        if sink_takes is not None and sum(who == "sink" for who, _ in seen) >= sink_takes:
            return False
        seen.append(("sink", delta))
        return True

    with trio.fail_after(GUARD_S):
        async with backend.open_stream(generate("r1", max_tokens)) as stream:
            stream.set_sink(sink)
            while True:
                try:
                    seen.append(("receive", await stream.receive()))
                except trio.EndOfChannel:
                    return seen


@asynccontextmanager
async def pd_backend(
    settings: OpenAIHttpSettings, configs: dict[str, SimConfig]
) -> AsyncIterator[tuple[SimHttpFleet, OpenAIHttpBackend]]:
    """One simulated ``vllm serve`` PD server and a running backend of it."""
    async with sim_http_fleet({"pd": 1}, configs=configs) as fleet:
        factory = OpenAIHttpBackendFactory(settings)
        async with running_backend(fleet, "pd-0", factory) as backend:
            yield fleet, backend


async def stream_into(backend: OpenAIHttpBackend, sink: Callable[[Delta], bool]) -> None:
    """A 50-token stream with ``sink`` set, read to the end."""
    with trio.fail_after(GUARD_S):
        async with backend.open_stream(generate("r1", 50)) as stream:
            stream.set_sink(sink)
            await read_to_the_end(stream)


def by(seen: list[tuple[str, Delta]], who: str) -> list[Delta]:
    return [delta for name, delta in seen if name == who]


async def test_the_hub_hands_every_non_final_delta_to_the_sink_in_order() -> None:
    async with pd_backend(FAST, {"pd": PACED}) as (_fleet, backend):
        assert backend.read_hub.running
        seen = await stream_with_sink(backend, None)
        passes = backend.read_hub.passes
        async with backend.open_stream(generate("r1")) as stream:  # no sink: read here
            plain = await read_all(stream)
        assert backend.read_hub.passes == passes
    taken, returned = by(seen, "sink"), by(seen, "receive")
    # The reader resumes for the end, and at most for the bytes that came with the head.
    assert len(returned) <= 2
    assert returned[-1].finish_reason == "length"
    assert len(taken) >= 6
    assert all(d.finish_reason is None for d in taken)
    assert passes >= len(taken)
    in_order = [delta for _, delta in seen]
    assert text(in_order) == text(plain)
    assert [t for d in in_order for t in d.token_ids] == [t for d in plain for t in d.token_ids]


async def test_a_refused_delta_resumes_the_reader_and_the_order_holds() -> None:
    async with pd_backend(FAST, {"pd": PACED}) as (_fleet, backend):
        seen = await stream_with_sink(backend, 2)
        async with backend.open_stream(generate("r1")) as stream:
            plain = await read_all(stream)
        assert backend.statistics().in_flight == 0
    assert len(by(seen, "sink")) == 2
    who = [name for name, _ in seen]
    assert who[-2:] == ["receive", "receive"]  # the refused delta onwards came through receive
    assert text([delta for _, delta in seen]) == text(plain)


async def test_the_read_timeout_applies_between_reads_not_to_the_whole_stream() -> None:
    """Tokens every 40 ms keep a 150 ms read timeout from firing over a 0.4 s stream."""
    settings = replace(FAST, read_timeout_s=0.15)
    configs = {"pd": replace(QUICK, output_token_s=0.04)}
    async with pd_backend(settings, configs) as (_fleet, backend):
        seen = await stream_with_sink(backend, None, max_tokens=10)
    assert sum(len(delta.token_ids) for _, delta in seen) == 10
    assert seen[-1][1].finish_reason == "length"


async def test_a_stalled_stream_times_out_while_the_hub_reads_it() -> None:
    settings = replace(FAST, read_timeout_s=0.15)
    configs = {"pd": replace(PACED, stall_after_tokens=2)}
    async with pd_backend(settings, configs) as (_fleet, backend):
        with pytest.raises(RemoteWorkerError, match="timed out") as caught:
            await stream_with_sink(backend, None)
        assert backend.read_hub.watching == 0
    assert caught.value.code == "timeout"
    assert caught.value.retryable


async def test_an_engine_error_in_the_stream_reaches_the_reader() -> None:
    configs = {"pd": replace(PACED, crash_after_tokens=3)}
    async with pd_backend(FAST, configs) as (_fleet, backend):
        with pytest.raises((RemoteWorkerError, WorkerDisconnected)):
            await stream_with_sink(backend, None)
        assert backend.read_hub.watching == 0


async def test_a_server_that_goes_away_mid_stream_disconnects_the_reader() -> None:
    configs = {"pd": replace(QUICK, output_token_s=0.05)}
    async with pd_backend(FAST, configs) as (fleet, backend):
        taken: list[Delta] = []

        def sink(delta: Delta) -> bool:
            taken.append(delta)
            if len(taken) == 2:
                fleet.stop("pd-0")
            return True

        with pytest.raises(WorkerDisconnected):
            await stream_into(backend, sink)
        assert backend.read_hub.watching == 0


async def test_a_worker_the_probes_take_down_ends_a_stream_the_hub_reads() -> None:
    """Without the hub's release on close, the reader would wait for its read timeout (60 s)."""
    settings = OpenAIHttpSettings(health_interval_s=0.02, failures_to_down=2, read_timeout_s=60)
    configs = {"pd": SimConfig(stall_after_tokens=2, output_token_s=0.001)}
    async with pd_backend(settings, configs) as (fleet, backend):
        taken: list[Delta] = []

        def sink(delta: Delta) -> bool:
            taken.append(delta)
            fleet.engine("pd-0").wedge()  # the stream stalls after its second token
            return True

        with pytest.raises(WorkerDisconnected, match="went down"):
            await stream_into(backend, sink)
        assert backend.read_hub.watching == 0


async def test_with_the_setting_off_the_reader_reads_its_own_socket() -> None:
    settings = replace(FAST, shared_stream_reader=False)
    async with pd_backend(settings, {"pd": PACED}) as (_fleet, backend):
        assert not backend.read_hub.running
        seen = await stream_with_sink(backend, None)
    assert by(seen, "sink") == []
    assert seen[-1][1].finish_reason == "length"
    assert len(seen) >= 8
