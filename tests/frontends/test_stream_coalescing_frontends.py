"""``[server] stream_coalescing`` at the front ends, over in-memory streams.

The deltas are queued before the response's task takes its first batch, so
they arrive together: ``ready`` writes them as one SSE event (one WebSocket
message), ``off`` as one each, in order.
"""

from __future__ import annotations

import json

import pytest

from epd_actors.frontends.http import HttpSettings
from epd_actors.frontends.ws_messages import batch_messages
from epd_actors.protocol import Usage
from epd_actors.request import DeltaEvent, GenerationEvent, UsageEvent
from tests.frontends.test_http_frontend import CHAT, ScriptedApp, connected, done


def script(words: tuple[str, ...]) -> list[GenerationEvent]:
    deltas: list[GenerationEvent] = [DeltaEvent(w, (n,)) for n, w in enumerate(words)]
    return [*deltas, UsageEvent(Usage(3, len(words))), done(tokens=len(words))]


async def streamed(mode: str, events: list[GenerationEvent], **body: object) -> str:
    app = ScriptedApp(events)
    settings = HttpSettings(linger_s=0.5, stream_coalescing=mode)
    async with connected(app, settings) as client:
        reply = await client.request(
            "POST",
            "/v1/chat/completions",
            json_body={**CHAT, "stream": True, "stream_options": {"include_usage": True}, **body},
        )
    assert reply.status == 200
    return reply.body.decode()


def data_chunks(text: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def content_chunks(text: str) -> list[str]:
    out = []
    for chunk in data_chunks(text):
        choices = chunk["choices"]
        assert isinstance(choices, list)
        if choices and choices[0]["finish_reason"] is None and "role" not in choices[0]["delta"]:
            out.append(choices[0]["delta"]["content"])
    return out


WORDS = ("one ", "two ", "three ", "four ", "five ")


async def test_off_writes_one_sse_event_per_queued_delta_in_order() -> None:
    text = await streamed("off", script(WORDS))
    assert content_chunks(text) == list(WORDS)


async def test_ready_writes_the_queued_deltas_as_one_merged_event() -> None:
    text = await streamed("ready", script(WORDS))
    assert content_chunks(text) == ["".join(WORDS)]


async def test_the_end_of_the_stream_is_the_same_in_both_modes() -> None:
    ready = await streamed("ready", script(WORDS))
    off = await streamed("off", script(WORDS))
    for text in (ready, off):
        chunks = data_chunks(text)
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 5,
            "total_tokens": 8,
        }
        assert text.endswith("data: [DONE]\n\n")
    ends = []
    for text in (ready, off):
        end = text[text.index('"finish_reason":"stop"') :]
        ends.append(end.split('"created":', 1)[-1].split(",", 1)[-1])  # past the clock
    assert ends[0] == ends[1]


@pytest.mark.parametrize(("mode", "per_chunk"), [("ready", [3]), ("off", [1, 1, 1])])
async def test_logprobs_per_token_survive_both_modes(mode: str, per_chunk: list[int]) -> None:
    events: list[GenerationEvent] = [
        DeltaEvent(w, (n,), logprobs=(-1.0 - n,), tokens=(w,)) for n, w in enumerate("abc")
    ]
    text = await streamed(mode, [*events, done(tokens=3)], logprobs=True)
    entries = [
        chunk["choices"][0]["logprobs"]["content"]  # type: ignore[index]
        for chunk in data_chunks(text)
        if chunk["choices"] and chunk["choices"][0]["logprobs"]  # type: ignore[index]
    ]
    assert [len(e) for e in entries] == per_chunk
    flat = [entry for chunk in entries for entry in chunk]
    assert [(e["token"], e["logprob"]) for e in flat] == [("a", -1.0), ("b", -2.0), ("c", -3.0)]


def ws_deltas(texts: list[str]) -> list[tuple[str, list[int]]]:
    out = []
    for text in texts:
        message = json.loads(text)
        assert message["type"] == "delta"
        out.append((message["text"], message["token_ids"]))
    return out


@pytest.mark.parametrize("logprobs", [False, True])
def test_websocket_messages_per_delta_when_off_merged_when_ready(logprobs: bool) -> None:
    deltas = [DeltaEvent(w, (n,), logprobs=(-1.0 - n,)) for n, w in enumerate(WORDS)]
    off = batch_messages("c1", deltas, logprobs=logprobs, coalesce=False)
    ready = batch_messages("c1", deltas, logprobs=logprobs, coalesce=True)
    assert ws_deltas(off) == [(w, [n]) for n, w in enumerate(WORDS)]
    assert ws_deltas(ready) == [("".join(WORDS), list(range(len(WORDS))))]
    if logprobs:
        assert [json.loads(t)["logprobs"] for t in off] == [[-1.0 - n] for n in range(5)]
        assert json.loads(ready[0])["logprobs"] == [-1.0 - n for n in range(5)]
