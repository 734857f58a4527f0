"""``stream_coalescing = "off"`` in the backends: the deltas of one read go on one by one.

With ``merge_reads`` (``ready``) the native reader merges the deltas one read
of the socket brought; without it (``off``) each delta the worker framed is
handed on as it came, in order (the native backend's own tests cover the
merging; these use its harness, a worker spoken by hand over memory streams).
The ``openai_http`` stream likewise parses the chunks of one read into one
delta, or one delta per chunk.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

from epd_actors.backends.openai_http.backend import (
    OpenAIHttpBackend,
    OpenAIHttpDeltaStream,
    OpenAIHttpSettings,
)
from epd_actors.errors import RemoteWorkerError
from epd_actors.protocol import Delta, ErrorCode, GenerateRequest, Prompt, Usage
from epd_actors.protocol.codec import encode
from tests.backends.test_native_backend import FAST, RawWorker, WorkerLink, generate, harness
from tests.http.test_openai_http_client import ready_backend

if TYPE_CHECKING:
    from epd_actors.protocol import Message


async def one_read(frames: list[Delta], *, merge_reads: bool) -> tuple[list[Delta], list[Delta]]:
    """What a taking sink was offered, and what the reader got, for ``frames`` in one write."""

    def one_write(message: Message) -> list[Message | bytes]:
        rid = message.request_id
        return [b"".join(encode(replace(frame, request_id=rid)) for frame in frames)]

    offered: list[Delta] = []

    def sink(delta: Delta) -> bool:
        offered.append(delta)
        return True

    settings = replace(FAST, merge_reads=merge_reads)
    async with (
        harness(WorkerLink(RawWorker(one_write).serve), settings=settings) as backend,
        backend.open_stream(generate("g")) as stream,
    ):
        stream.set_sink(sink)
        received = [delta async for delta in stream]
    return offered, received


FRAMES = [
    *(Delta("", token_ids=(n,), text=f"t{n} ", logprobs=(-0.5 * n,)) for n in range(3)),
    Delta("", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3)),
]


@pytest.mark.parametrize("merge_reads", [True, False], ids=["ready", "off"])
async def test_one_reads_deltas_are_merged_only_when_coalescing(
    autojump_clock: object, merge_reads: bool
) -> None:
    offered, received = await one_read(FRAMES, merge_reads=merge_reads)
    if merge_reads:
        assert [(d.token_ids, d.text, d.logprobs) for d in offered] == [
            ((0, 1, 2), "t0 t1 t2 ", (0.0, -0.5, -1.0))
        ]
    else:
        assert [(d.token_ids, d.text, d.logprobs) for d in offered] == [
            ((n,), f"t{n} ", (-0.5 * n,)) for n in range(3)
        ]
    assert [d.finish_reason for d in received] == ["stop"]


class OneRead:
    """A streamed reply whose whole body arrives in one network read."""

    def __init__(self, body: bytes) -> None:
        self._chunks = [body]

    async def next_chunk(self) -> bytes | None:
        return self._chunks.pop(0) if self._chunks else None


def vllm_chunk(text: str, token: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    choice["token_ids"] = [token] if text else None
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


BODY = b"".join(
    [
        *(vllm_chunk(f"w{n} ", n) for n in range(3)),
        vllm_chunk("", 0, "stop"),
        b"data: "
        + json.dumps(
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
        ).encode()
        + b"\n\n",
        b"data: [DONE]\n\n",
    ]
)


@pytest.mark.parametrize("merge_reads", [True, False], ids=["ready", "off"])
async def test_vllm_chunks_of_one_read_are_one_delta_only_when_coalescing(
    merge_reads: bool,
) -> None:
    settings = OpenAIHttpSettings(merge_reads=merge_reads)
    backend = SimpleNamespace(settings=settings)
    call = SimpleNamespace(request_id="g", chat=True)
    stream = OpenAIHttpDeltaStream(backend, call, OneRead(BODY))  # type: ignore[arg-type]
    deltas = []
    while not stream.finished:
        deltas.append(await stream.receive())
    seen = [(d.text, d.token_ids, d.finish_reason) for d in deltas]
    if merge_reads:  # the whole read, end included, is one (terminal) delta
        assert seen == [("w0 w1 w2 ", (0, 1, 2), "stop")]
    else:
        assert seen == [*((f"w{n} ", (n,), None) for n in range(3)), ("", (), "stop")]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage == Usage(prompt_tokens=2, completion_tokens=3)


def completion_chunk(text: str, token: int) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": [token], "finish_reason": None}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


@pytest.mark.parametrize("merge_reads", [True, False], ids=["ready", "off"])
@pytest.mark.parametrize(
    "bad", [b"data: not json\n\n", b"data: \xff\n\n"], ids=["not-json", "not-utf8"]
)
async def test_a_malformed_chunk_after_good_ones_is_a_protocol_error_in_both_modes(
    merge_reads: bool, bad: bytes
) -> None:
    events = completion_chunk("w0 ", 0) + completion_chunk("w1 ", 1) + bad
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    reply = head + b"content-length: %d\r\n\r\n%s" % (len(events), events)
    settings = OpenAIHttpSettings(health_interval_s=0.05, merge_reads=merge_reads)
    got: list[str] = []

    async def read_all(backend: OpenAIHttpBackend) -> None:
        async with backend.open_stream(GenerateRequest("r1", Prompt(text="hi"))) as stream:
            while True:
                got.append((await stream.receive()).text)

    async with ready_backend({b"/v1/completions": reply}, settings) as backend:
        with pytest.raises(RemoteWorkerError) as caught:
            await read_all(backend)
    assert caught.value.code == ErrorCode.PROTOCOL_ERROR
    # off: the chunks before the bad one come out one by one, then the error;
    # ready, or bytes that do not even decode: the error, nothing of that read.
    parsed_one_by_one = not merge_reads and b"not json" in bad
    assert got == (["w0 ", "w1 "] if parsed_one_by_one else [])
