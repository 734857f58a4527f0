"""Relaying vLLM's text chunks without a parse: the same deltas, the same client bytes.

Each stream is fed through ``SseDecoder`` and ``DeltaParser`` twice, with
``relay`` on and off, and what the router learns (the deltas) and what an SSE
client gets (the rendered chunks) are compared.  Chunks are written in the
shapes vLLM and the simulator write them, plus the ones that must fall back.
"""

from __future__ import annotations

import json

import pytest
import trio

from epd_actors.backends.openai_http.contract import DeltaParser, ReplyError, StreamFailed
from epd_actors.backends.openai_http.relay import ChunkScanner
from epd_actors.core.output_relay import OutputRelay, delta_event
from epd_actors.handoff import open_handoff
from epd_actors.http.sse import SseDecoder, SseError
from epd_actors.openai.engine_text import EngineText, joined_literal
from epd_actors.openai.format import SseFormatter
from epd_actors.protocol import Delta, Usage
from epd_actors.request import DeltaEvent, GenerationEvent

HEAD = {
    "id": "chatcmpl-engine-id",
    "object": "chat.completion.chunk",
    "created": 1764547200,
    "model": "engine-model",
}
COMPLETION_HEAD = {**HEAD, "id": "cmpl-engine-id", "object": "text_completion"}


def _json(obj: object, *, ascii_only: bool = False) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only)


def chat_event(
    text: str | None,
    ids: list[int] | None = None,
    *,
    finish: str | None = None,
    simulator_order: bool = False,
    ascii_only: bool = False,
    **extra: object,
) -> bytes:
    """A chat chunk, members in vLLM's order (or the simulator's: logprobs first)."""
    delta: dict[str, object] = {} if text is None else {"content": text}
    choice: dict[str, object] = {"index": 0}
    if simulator_order:
        choice["logprobs"] = None
        choice["delta"] = delta
    else:
        choice["delta"] = delta
        choice["logprobs"] = None
    choice["finish_reason"] = finish
    if ids is not None:
        choice["token_ids"] = ids
    choice.update(extra)
    return (
        b"data: " + _json({**HEAD, "choices": [choice]}, ascii_only=ascii_only).encode() + b"\n\n"
    )


def completion_event(text: str, ids: list[int], *, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice["stop_reason"] = None
    choice["token_ids"] = ids
    return b"data: " + _json({**COMPLETION_HEAD, "choices": [choice]}).encode() + b"\n\n"


def usage_event(prompt: int, completion: int, head: dict[str, object] = HEAD) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    return b"data: " + _json({**head, "choices": [], "usage": usage}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
ROLE = (
    b"data: "
    + _json(
        {
            **HEAD,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    ).encode()
    + b"\n\n"
)
TEXTS = [" Hello", ",", " w\u00f6rld", ' "quoted"', " back\\slash", " line\nbreak", " \u2603", "!"]


def chat_stream(**options: bool) -> list[bytes]:
    events = [ROLE]
    events += [chat_event(text, [100 + i], **options) for i, text in enumerate(TEXTS)]
    events += [chat_event("", [], finish="stop", **options), usage_event(5, len(TEXTS)), DONE]
    return events


def deltas_of(reads: list[bytes], *, chat: bool = True, relay: bool) -> list[Delta]:
    """Every delta of a stream given as its network reads, one ``take`` per read."""
    decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=chat, relay=relay)
    out: list[Delta] = []
    for read in reads:
        parser.feed(decoder.feed(read))
        delta = parser.take()
        if delta is not None:
            out.append(delta)
    final = parser.end_of_stream()
    if final is not None:
        out.append(final)
    return out


def rendered(deltas: list[Delta], *, kind: str = "chat", model: str = "router-model") -> list[str]:
    """The SSE text a client gets for each delta with output (the router's own prefix)."""
    formatter = SseFormatter(kind, request_id="req-1", model=model, created=1764547299)  # type: ignore[arg-type]
    return [formatter.event(delta_event(d)) for d in deltas if d.text or d.fields]


# ---------------------------------------------------------------- the common case


@pytest.mark.parametrize("simulator_order", [False, True])
@pytest.mark.parametrize("ascii_only", [False, True])
def test_a_text_stream_gives_the_same_deltas_and_the_same_bytes(
    simulator_order: bool, ascii_only: bool
) -> None:
    reads = chat_stream(simulator_order=simulator_order, ascii_only=ascii_only)
    relayed, parsed = deltas_of(reads, relay=True), deltas_of(reads, relay=False)
    assert relayed == parsed  # text (as str), token ids, finish reason, usage
    assert [type(d.text) for d in relayed[:-1]] == [EngineText] * len(TEXTS)
    assert relayed[-1].finish_reason == "stop"
    assert relayed[-1].usage == Usage(5, len(TEXTS))
    relayed_chunks, parsed_chunks = rendered(relayed), rendered(parsed)
    if not ascii_only:  # the engine escaped as the router does: byte for byte
        assert relayed_chunks == parsed_chunks
    # Either way the client decodes the same chunks.
    assert [json.loads(c[len("data: ") :]) for c in relayed_chunks] == [
        json.loads(c[len("data: ") :]) for c in parsed_chunks
    ]
    assert all('"id":"chatcmpl-req-1"' in c and "token_ids" not in c for c in relayed_chunks)


def test_a_completion_stream_is_relayed_too() -> None:
    reads = [completion_event(t, [7 + i]) for i, t in enumerate(TEXTS)]
    reads += [completion_event("", [], finish="length"), usage_event(3, 8, COMPLETION_HEAD), DONE]
    relayed, parsed = (
        deltas_of(reads, chat=False, relay=True),
        deltas_of(reads, chat=False, relay=False),
    )
    assert relayed == parsed
    assert type(relayed[0].text) is EngineText
    assert rendered(relayed, kind="completion") == rendered(parsed, kind="completion")


def test_the_events_of_one_read_merge_into_one_literal() -> None:
    reads = [b"".join(chat_stream())]
    relayed, parsed = deltas_of(reads, relay=True), deltas_of(reads, relay=False)
    assert relayed == parsed
    assert len(relayed) == 1
    text = relayed[0].text
    assert type(text) is EngineText
    assert json.loads(text.json) == "".join(TEXTS)
    assert rendered(relayed) == rendered(parsed)
    assert relayed[0].token_ids == tuple(range(100, 100 + len(TEXTS)))


def test_a_model_alias_and_the_router_s_id_replace_the_engine_s() -> None:
    (chunk,) = rendered(deltas_of([chat_event(" hi", [1])], relay=True), model="alias-name")
    assert "engine-model" not in chunk
    assert "chatcmpl-engine-id" not in chunk
    body = json.loads(chunk[len("data: ") :])
    assert body["model"] == "alias-name"
    assert body["id"] == "chatcmpl-req-1"
    assert body["choices"] == [
        {"index": 0, "delta": {"content": " hi"}, "logprobs": None, "finish_reason": None}
    ]


def test_a_joined_string_is_a_plain_str_again() -> None:
    text = EngineText("ab")
    text.json = '"ab"'
    assert text == "ab"
    assert type(text + "c") is str
    assert type("".join([text, text])) is str
    assert joined_literal(['"a\\n"', '"b"']) == '"a\\nb"'


def deltas_at_once(reads: list[bytes], *, chat: bool = True) -> list[Delta]:
    """:func:`deltas_of` with the stream's path for a read of one event: built at once."""
    decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=chat, relay=True)
    out: list[Delta] = []
    for read in reads:
        data = decoder.single_data(read)
        delta = None if data is None else parser.text_delta(data)
        if delta is None:
            parser.feed(decoder.feed(read))
            delta = parser.take()
        if delta is not None:
            out.append(delta)
    final = parser.end_of_stream()
    if final is not None:
        out.append(final)
    return out


@pytest.mark.parametrize("simulator_order", [False, True])
@pytest.mark.parametrize("ascii_only", [False, True])
def test_a_read_of_one_text_event_gives_the_delta_the_parse_gives(
    simulator_order: bool, ascii_only: bool
) -> None:
    reads = chat_stream(simulator_order=simulator_order, ascii_only=ascii_only)
    reads.insert(3, chat_event("", [77]))  # token ids without text
    at_once, parsed = deltas_at_once(reads), deltas_of(reads, relay=False)
    assert at_once == parsed
    assert [type(d.text) for d in at_once[:-1]] == [EngineText] * 2 + [str] + [EngineText] * 6
    assert rendered(at_once) == rendered(deltas_of(reads, relay=True))
    completions = [completion_event(t, [7 + i]) for i, t in enumerate(TEXTS)]
    completions += [completion_event("", [], finish="length"), DONE]
    assert deltas_at_once(completions, chat=False) == deltas_of(
        completions, chat=False, relay=False
    )


def test_a_read_of_one_event_is_built_at_once_only_from_a_clean_state() -> None:
    decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=True, relay=True)
    event = chat_event(" a", [1])
    data = decoder.single_data(event)
    assert data is not None
    delta = parser.text_delta(data)
    assert delta == Delta("r", (1,), " a")
    assert type(delta.text) is EngineText
    assert delta.text.json == '" a"'
    # Another shape, or a chunk that carries nothing: feed it.
    for other in (ROLE, chat_event("", None), chat_event(" z", [3], finish="stop"), DONE):
        other_data = decoder.single_data(other)
        assert other_data is not None
        assert parser.text_delta(other_data) is None
    # Something pending (a read of two events fed, not taken): feed it too, in order.
    parser.feed(decoder.feed(event + event))
    assert parser.text_delta(data) is None
    assert parser.take() == Delta("r", (1, 1), " a a")
    # Past the finish reason nothing is built at once.
    parser.feed(decoder.feed(chat_event("", [], finish="stop")))
    assert parser.text_delta(data) is None
    # Relay off: the parser never builds one.
    assert DeltaParser("r", chat=True).text_delta(data) is None


def test_the_decoder_gives_one_event_s_data_only_when_nothing_is_pending() -> None:
    decoder = SseDecoder(64)
    assert decoder.single_data(b"data: x\n\n") == "x"
    assert decoder.single_data(b"data: x\n\ndata: y\n\n") is None  # two events
    assert decoder.single_data(b"event: e\ndata: x\n\n") is None
    assert decoder.single_data(b"data: x\r\n\n") is None  # a CRLF line: feed it
    assert decoder.feed(b"data: par") == []
    assert decoder.single_data(b"data: x\n\n") is None  # an event is pending
    with pytest.raises(SseError, match="exceeds"):
        SseDecoder(4).single_data(b"data: 12345\n\n")
    with pytest.raises(SseError, match="UTF-8"):
        SseDecoder(64).single_data(b"data: \xff\n\n")


# ---------------------------------------------------------------- every fallback


def test_logprobs_tool_calls_and_a_second_choice_take_the_parse() -> None:
    logprobs = {
        "content": [{"token": " x", "logprob": -0.5, "bytes": [32, 120], "top_logprobs": []}]
    }
    tool = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}
    reads = [
        chat_event(" x", [1], logprobs=logprobs),  # replaces the null logprobs
        b"data: "
        + _json(
            {
                **HEAD,
                "choices": [{"index": 0, "delta": tool, "logprobs": None, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n",
        chat_event(" y", [2], index=1),
        chat_event(" z", [3], finish="stop"),
        DONE,
    ]
    relayed, parsed = deltas_of(reads, relay=True), deltas_of(reads, relay=False)
    assert relayed == parsed
    assert relayed[0].logprobs == (-0.5,)
    assert relayed[1].fields == tool
    assert all(type(d.text) is str for d in relayed)
    assert relayed[-1].finish_reason == "stop"
    assert "".join(d.text for d in relayed) == " x y z"


def test_a_parsed_piece_makes_the_merged_text_plain() -> None:
    reads = [chat_event(" a", [1]) + chat_event(" b", [2], index=1) + chat_event(" c", [3])]
    (delta,) = deltas_of(reads, relay=True)
    assert delta.text == " a b c"
    assert type(delta.text) is str
    assert delta.token_ids == (1, 2, 3)


def test_an_error_event_mid_stream_fails_it_as_before() -> None:
    error = b'data: {"error":{"message":"engine died","type":"InternalServerError"}}\n\n'
    named = b'event: error\ndata: {"id":"x","object":"chat.completion.chunk"}\n\n'
    for bad in (error, named, b'data: {"object":"error","message":"engine died"}\n\n'):
        decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=True, relay=True)
        parser.feed(decoder.feed(chat_event(" ok", [1])))
        assert parser.take() is not None
        with pytest.raises(StreamFailed):
            parser.feed(decoder.feed(bad))


def test_a_stream_without_a_finish_reason_has_no_terminal_delta() -> None:
    reads = [chat_event(" a", [1]), chat_event(" b", [2])]
    relayed = deltas_of(reads, relay=True)
    assert [d.finish_reason for d in relayed] == [None, None]
    decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=True, relay=True)
    parser.feed(decoder.feed(b"".join(reads)))
    parser.take()
    assert parser.end_of_stream() is None


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        b'[{"index":0,"delta":{"content":"x\\q"},"logprobs":null,"finish_reason":null}]}\n\n',
        # a data field split over two lines: the event's data holds a raw newline
        b'data: {"id":"a","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        b'[{"index":0,"delta":{"content":"x\ndata: y"},"logprobs":null,"finish_reason":null}]}'
        b"\n\n",
    ],
)
def test_a_chunk_that_is_not_json_is_refused_as_before(bad: bytes) -> None:
    for relay in (True, False):
        decoder, parser = SseDecoder(1 << 20), DeltaParser("r", chat=True, relay=relay)
        with pytest.raises(ReplyError):
            parser.feed(decoder.feed(bad))


def test_the_scanner_reads_only_the_common_shape() -> None:
    scanner = ChunkScanner(chat=True)
    line = chat_event(' a\\"', [1, 22]).decode()[len("data: ") : -2]
    assert scanner.scan(line) == (' a\\"', '" a\\\\\\""', "1,22")
    plain = chat_event(" plain", [5]).decode()[len("data: ") : -2]
    assert scanner.scan(plain) == (" plain", '" plain"', "5")
    assert scanner.scan(line.replace('"index":0', '"index":0,"extra":1')) is None
    assert scanner.scan(line.replace('"finish_reason":null', '"finish_reason":"stop"')) is None
    assert scanner.scan(line.replace("[1,22]", "[1,,22]")) is None
    assert scanner.scan(line.replace("]}]}", "]}],}")) is None
    ids_first = line.replace(
        ',"finish_reason":null,"token_ids":[1,22]', ',"token_ids":[1,22],"finish_reason":null'
    )
    assert ids_first != line
    assert scanner.scan(ids_first) == scanner.scan(line)  # the simulator's order
    assert scanner.scan(line.replace("[1,22]", "null")) == (' a\\"', '" a\\\\\\""', None)
    other = line.replace("engine-model", "another-model")  # a new prefix is matched again
    assert scanner.scan(other) == scanner.scan(line)
    assert scanner.scan(line[:-1] + ',"usage":{"prompt_tokens":1}}') is None
    assert ChunkScanner(chat=False).scan(line) is None
    emoji = chat_event("\U0001f600", None, ascii_only=True).decode()[len("data: ") : -2]
    assert scanner.scan(emoji) == ("\U0001f600", '"\\ud83d\\ude00"', None)
    assert scanner.scan(emoji.replace("\\ude00", "\\x")) is None


def test_relay_off_never_keeps_a_literal() -> None:
    assert all(type(d.text) is str for d in deltas_of(chat_stream(), relay=False))


# ---------------------------------------------------------------- what the router keeps


async def test_a_relayed_delta_counts_tokens_and_marks_the_output_started() -> None:
    class Progress:
        first_token_at: float | None = None
        completion_tokens = 0

    send, receive = open_handoff[GenerationEvent](4)
    progress = Progress()
    relay = OutputRelay(send, progress, inter_token_s=5.0)
    (delta,) = deltas_of([chat_event(" a", [1]) + chat_event(" b", [2])], relay=True)
    attempt = trio.CancelScope(deadline=trio.current_time() + 1.0)  # a first-token deadline
    relay.attempt = attempt
    assert relay.offer(delta)
    assert relay.relayed
    assert attempt.deadline == float("inf")
    assert progress.first_token_at is not None
    assert progress.completion_tokens == 2
    event = receive.receive_nowait()
    assert isinstance(event, DeltaEvent)
    assert type(event.text) is EngineText
    formatter = SseFormatter("chat", request_id="q", model="m", created=1)
    assert formatter.event(event) == formatter.delta(" a b")
