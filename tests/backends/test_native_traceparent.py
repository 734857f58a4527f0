"""The native backend sends each traced attempt's ``traceparent`` to workers announcing it.

A worker of this package announces ``TRACEPARENT_CAPABILITY`` in its
``Welcome`` and hands the field to its engine; a worker that does not (one
that predates the field refuses unknown fields) never gets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from epd_actors.protocol import (
    TRACEPARENT_CAPABILITY,
    EncodeRequest,
    GenerateRequest,
    Message,
    PrefillRequest,
    Prompt,
    StageResult,
    Welcome,
)
from epd_actors.protocol.codec import FrameDecoder, encode
from epd_actors.trace_context import CURRENT_TRACEPARENT
from tests.backends.test_native_backend import (
    RawWorker,
    WorkerLink,
    harness,
    make_server,
    prefill,
)
from tests.fakes import ScriptedEngine

if TYPE_CHECKING:
    from epd_actors.worker.engine import DeltaSink

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class RecordingEngine(ScriptedEngine):
    """A scripted engine that keeps every stage request it was given."""

    requests: list[EncodeRequest | PrefillRequest | GenerateRequest] = field(default_factory=list)

    async def prefill(self, request: PrefillRequest) -> StageResult:
        self.requests.append(request)
        return await super().prefill(request)

    async def generate(self, request: GenerateRequest, emit: DeltaSink) -> None:
        self.requests.append(request)
        await super().generate(request, emit)


async def test_a_worker_of_this_package_announces_it_takes_the_traceparent(
    autojump_clock: object,
) -> None:
    async with harness(WorkerLink(make_server().handle_stream)) as backend:
        assert backend.welcome is not None
        assert TRACEPARENT_CAPABILITY in backend.welcome.capabilities


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "untraced"])
async def test_each_stage_request_carries_the_attempt_traceparent_to_the_engine(
    autojump_clock: object, traced: bool
) -> None:
    engine = RecordingEngine()
    async with harness(WorkerLink(make_server(engine).handle_stream)) as backend:
        token = CURRENT_TRACEPARENT.set(TRACEPARENT if traced else None)
        try:
            await backend.run_stage(prefill("p1"))
            async with backend.open_stream(GenerateRequest("g1", Prompt(text="hi"))) as stream:
                assert [delta async for delta in stream][-1].finish_reason is not None
        finally:
            CURRENT_TRACEPARENT.reset(token)
    expected = TRACEPARENT if traced else None
    assert [request.traceparent for request in engine.requests] == [expected, expected]


async def test_a_worker_that_does_not_announce_it_never_gets_the_field(
    autojump_clock: object,
) -> None:
    def script(message: Message) -> list[Message | bytes]:
        return [StageResult(message.request_id)]

    worker = RawWorker(script)  # its Welcome announces no capabilities
    link = WorkerLink(worker.serve)
    async with harness(link) as backend:
        token = CURRENT_TRACEPARENT.set(TRACEPARENT)
        try:
            await backend.run_stage(prefill("p1"))
        finally:
            CURRENT_TRACEPARENT.reset(token)
    (request,) = worker.received
    assert isinstance(request, PrefillRequest)
    assert request.traceparent is None
    sent = [m for writes in link.client_ends[0].writes for m in writes]
    assert all(getattr(m, "traceparent", None) is None for m in sent)


def test_the_field_is_left_off_the_wire_when_absent() -> None:
    untraced = encode(PrefillRequest("p1", Prompt(text="hi")))
    traced = encode(PrefillRequest("p1", Prompt(text="hi"), traceparent=TRACEPARENT))
    assert b"traceparent" not in untraced
    assert b"traceparent" in traced
    (decoded,) = FrameDecoder().feed_all(traced)
    assert isinstance(decoded, PrefillRequest)
    assert decoded.traceparent == TRACEPARENT
    assert Welcome(2, "w", "pd", "m").capabilities == ()
