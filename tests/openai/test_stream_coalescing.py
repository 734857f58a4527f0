"""Stream coalescing as rendered SSE text: ``ready`` merges a batch's deltas, ``off`` does not."""

from __future__ import annotations

import json

import pytest

from epd_actors.errors import ConfigError
from epd_actors.openai.coalescing import check_stream_coalescing, coalesced
from epd_actors.openai.format import SseFormatter
from epd_actors.openai.media import MediaLimits
from epd_actors.openai.schema import ParsedRequest, parse_chat_completion
from epd_actors.openai.sse import render_batch
from epd_actors.protocol import TokenLogprob, Usage
from epd_actors.request import (
    DeltaEvent,
    DoneEvent,
    GenerationEvent,
    RequestTimings,
    UsageEvent,
)

TIMINGS = RequestTimings(0.0, {}, 0.001, 0.002, {})


def parsed(**extra: object) -> ParsedRequest:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    return parse_chat_completion(body, request_id="r1", limits=MediaLimits())


def formatter(logprobs: bool = False) -> SseFormatter:
    return SseFormatter("chat", request_id="r1", model="m", created=0, logprobs=logprobs)


def chunks(text: str) -> list[dict[str, object]]:
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


def contents(text: str) -> list[object]:
    out = []
    for chunk in chunks(text):
        choices = chunk["choices"]
        assert isinstance(choices, list)
        if choices and choices[0]["finish_reason"] is None:
            out.append(choices[0]["delta"].get("content"))
    return out


def tail(text: str) -> str:
    """Everything from the finish chunk on."""
    return text[text.index('"finish_reason":"stop"') :]


def batch_of(*deltas: DeltaEvent) -> list[GenerationEvent]:
    return [*deltas, UsageEvent(Usage(3, len(deltas))), DoneEvent("stop", Usage(3, 3), TIMINGS)]


DELTAS = (DeltaEvent("a", (1,)), DeltaEvent("b", (2,)), DeltaEvent("c", (3,)))


def test_off_renders_one_event_per_delta_in_order() -> None:
    text, final = render_batch(formatter(), batch_of(*DELTAS), parsed(), coalesce=False)
    assert contents(text) == ["a", "b", "c"]
    assert isinstance(final, DoneEvent)


def test_ready_renders_the_queued_deltas_as_one_event() -> None:
    text, final = render_batch(formatter(), batch_of(*DELTAS), parsed(), coalesce=True)
    assert contents(text) == ["abc"]
    assert isinstance(final, DoneEvent)


def test_finish_usage_timings_and_done_are_the_same_in_both_modes() -> None:
    ready, _ = render_batch(formatter(), batch_of(*DELTAS), parsed(), coalesce=True)
    off, _ = render_batch(formatter(), batch_of(*DELTAS), parsed(), coalesce=False)
    assert tail(ready) == tail(off)
    assert ready.endswith("data: [DONE]\n\n")
    assert chunks(ready)[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert ": timings " in tail(ready)


def logprob_deltas() -> tuple[DeltaEvent, ...]:
    return tuple(
        DeltaEvent(
            word,
            (n,),
            logprobs=(-0.1 * (n + 1),),
            tokens=(word,),
            top_logprobs=((TokenLogprob(word, -0.1 * (n + 1)), TokenLogprob("z", -3.0)),),
        )
        for n, word in enumerate(("x", "y", "w"))
    )


def logprob_entries(text: str) -> list[list[tuple[str, float]]]:
    """Per chunk with content: its ``logprobs.content`` as (token, logprob) pairs."""
    out = []
    for chunk in chunks(text):
        choice = chunk["choices"][0] if chunk["choices"] else None  # type: ignore[index]
        if choice and choice["logprobs"]:
            out.append([(e["token"], e["logprob"]) for e in choice["logprobs"]["content"]])
    return out


@pytest.mark.parametrize("coalesce", [True, False], ids=["ready", "off"])
def test_logprobs_stay_one_entry_per_token(coalesce: bool) -> None:
    request = parsed(logprobs=True, top_logprobs=2)
    text, _ = render_batch(
        formatter(logprobs=True), batch_of(*logprob_deltas()), request, coalesce=coalesce
    )
    entries = logprob_entries(text)
    flat = [pair for chunk in entries for pair in chunk]
    assert [token for token, _ in flat] == ["x", "y", "w"]
    assert [logprob for _, logprob in flat] == pytest.approx([-0.1, -0.2, -0.3])
    assert len(entries) == (1 if coalesce else 3)


def test_ready_cuts_a_run_where_a_merge_would_drop_logprobs() -> None:
    with_lp = DeltaEvent("a", (1,), logprobs=(-0.5,), tokens=("a",))
    without = DeltaEvent("b", (2,))
    merged = coalesced([with_lp, DeltaEvent("c", (3,), logprobs=(-0.7,), tokens=("c",)), without])
    assert [(d.text, d.logprobs) for d in merged if isinstance(d, DeltaEvent)] == [
        ("ac", (-0.5, -0.7)),
        ("b", None),
    ]


def test_ready_merges_tool_call_pieces_as_a_client_would() -> None:
    first = DeltaEvent(
        "",
        (),
        fields={
            "tool_calls": [
                {
                    "index": 0,
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a"'},
                }
            ]
        },
    )
    second = DeltaEvent(
        "", (), fields={"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    )
    (merged,) = coalesced([first, second])
    assert isinstance(merged, DeltaEvent)
    assert merged.fields == {
        "tool_calls": [
            {
                "index": 0,
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1}'},
            }
        ]
    }


def test_events_other_than_deltas_end_a_run() -> None:
    usage = UsageEvent(Usage(1, 2))
    out = coalesced([DELTAS[0], usage, DELTAS[1], DELTAS[2]])
    assert out == [DELTAS[0], usage, DeltaEvent("bc", (2, 3))]


def test_an_unknown_mode_is_a_config_error_naming_the_key() -> None:
    assert check_stream_coalescing("off", key="server.stream_coalescing") == "off"
    with pytest.raises(ConfigError, match=r"server\.stream_coalescing: must be one of ready, off"):
        check_stream_coalescing("window", key="server.stream_coalescing")
