"""The output relay: deltas to the caller's event channel, progress, deadlines, closing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from epd_actors.core.output_relay import OutputRelay
from epd_actors.handoff import HandoffReceiver, open_handoff
from epd_actors.protocol import Delta, TokenLogprob
from epd_actors.request import DeltaEvent, GenerationEvent

INTER_TOKEN_S = 2.0


@dataclass
class Progress:
    first_token_at: float | None = None
    completion_tokens: int = 0


def relay_with(
    capacity: int,
) -> tuple[OutputRelay, Progress, HandoffReceiver[GenerationEvent]]:
    send, receive = open_handoff[GenerationEvent](capacity)
    progress = Progress()
    return OutputRelay(send, progress, INTER_TOKEN_S), progress, receive


def token(n: int) -> Delta:
    return Delta("r", token_ids=(n,), text=f"t{n} ")


async def test_offered_deltas_become_events_and_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    relay, progress, events = relay_with(4)
    assert relay.deadline(first_token_deadline=9.0) == 9.0  # nothing relayed yet
    await trio.sleep(1.0)
    assert relay.offer(Delta("r"))  # empty: nothing for the caller, but a sign of life
    assert progress.first_token_at is None
    await trio.sleep(1.0)
    assert relay.offer(token(7))
    assert events.receive_nowait() == DeltaEvent("t7 ", (7,), None)
    with pytest.raises(trio.WouldBlock):
        events.receive_nowait()
    assert (progress.first_token_at, progress.completion_tokens) == (2.0, 1)
    assert relay.relayed
    assert relay.deadline(first_token_deadline=9.0) == 2.0 + INTER_TOKEN_S


async def test_a_full_channel_refuses_an_offer_and_put_waits_without_a_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    relay, progress, events = relay_with(1)
    assert relay.offer(token(0))
    assert not relay.offer(token(1))  # refused: nothing was done
    assert progress.completion_tokens == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.put, token(1))
        await trio.sleep(10.0)  # the caller does not read
        assert relay.waiting_for_caller
        assert relay.deadline(first_token_deadline=0.0) == 10.0 + INTER_TOKEN_S
        assert [await events.receive(), await events.receive()] == [
            DeltaEvent("t0 ", (0,), None),
            DeltaEvent("t1 ", (1,), None),
        ]
    assert not relay.waiting_for_caller
    assert progress.completion_tokens == 2
    assert relay.last_delta_at == 10.0


async def test_the_first_delta_brings_the_waiting_scope_forward(
    autojump_clock: trio.testing.MockClock,
) -> None:
    relay, _, _ = relay_with(4)
    with trio.CancelScope(deadline=100.0) as relay.watch:
        await trio.sleep(1.0)
        assert relay.offer(token(0))
        assert relay.watch.deadline == 1.0 + INTER_TOKEN_S
        await trio.sleep(1.0)
        assert relay.offer(token(1))  # later deltas leave the scope alone
        assert relay.watch.deadline == 1.0 + INTER_TOKEN_S


async def test_a_caller_that_left_is_reported_and_the_sink_never_raises() -> None:
    relay, _, events = relay_with(4)
    events.close()
    with pytest.raises(trio.BrokenResourceError):
        relay.offer(token(0))
    assert relay.caller_left
    assert relay.sink(token(1)) is False
    with pytest.raises(trio.BrokenResourceError):
        await relay.put(token(2))


async def test_a_closed_relay_drops_late_deltas() -> None:
    relay, progress, events = relay_with(1)
    relay.close()
    assert relay.offer(token(0))
    assert relay.sink(token(1))
    await relay.put(token(2))
    with pytest.raises(trio.WouldBlock):
        events.receive_nowait()
    assert progress.completion_tokens == 0
    assert relay.last_delta_at == -math.inf


async def test_what_the_engine_gave_besides_text_reaches_the_caller() -> None:
    relay, _, events = relay_with(4)
    top = ((TokenLogprob(" a", -0.5), TokenLogprob(" b", -1.0)),)
    call = {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert relay.offer(Delta("r", (5,), " a", (-0.5,), tokens=(" a",), top_logprobs=top))
    assert relay.offer(Delta("r", fields=call))  # no text, no token: still output
    await relay.put(Delta("r", fields={"reasoning_content": "hm"}))
    assert [events.receive_nowait() for _ in range(3)] == [
        DeltaEvent(" a", (5,), (-0.5,), tokens=(" a",), top_logprobs=top),
        DeltaEvent("", (), fields=call),
        DeltaEvent("", (), fields={"reasoning_content": "hm"}),
    ]
