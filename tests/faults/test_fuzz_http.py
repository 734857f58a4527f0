"""Property-based fuzzing of the HTTP front end and the OpenAI request parser.

* Random bytes, mutated valid requests and random JSON bodies are fed to
  ``HttpServer.handle_connection`` over a memory stream on the virtual clock:
  the handler always ends (the client's end sees zero or more well-formed
  HTTP/1.1 responses, then a close), never hits its "unexpected error" path,
  and leaves no task behind.
* Random JSON values are fed to ``parse_chat_completion`` and
  ``parse_completion``: the only exception either may raise is
  ``InvalidRequest``.

The native protocol decoder is fuzzed in ``tests/protocol/test_protocol_codec.py``; it
is not repeated here.  Settings: ``tests/wire_strategies.py`` (derandomized, no
example database), so every run sees the same examples.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import TYPE_CHECKING

import h11
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from epd_actors.errors import InvalidRequest
from epd_actors.frontends.http import HttpServer, HttpSettings
from epd_actors.openai.media import MediaLimits
from epd_actors.openai.schema import parse_chat_completion, parse_completion
from epd_actors.protocol import Usage
from epd_actors.request import DeltaEvent, DoneEvent, RequestTimings
from tests.frontends.test_http_frontend import ScriptedApp
from tests.wire_strategies import FUZZ_SETTINGS

if TYPE_CHECKING:
    from collections.abc import Callable

SETTINGS = HttpSettings(
    linger_s=0.5, max_body_bytes=4096, max_header_bytes=2048, keep_alive_timeout_s=2.0
)
TIMINGS = RequestTimings(0.0, {"decode": 0.001}, 0.001, 0.001, {"decode": ("d0",)})
SCRIPT = [DeltaEvent("hi", (1,)), DoneEvent("stop", Usage(3, 1), TIMINGS)]
GUARD_S = 300.0  # virtual seconds


def request_bytes(method: str, target: str, body: bytes | None, *, extra: str = "") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nhost: test\r\n{extra}"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
).encode()
STREAM = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()
SEEDS = [
    request_bytes("POST", "/v1/chat/completions", CHAT),
    request_bytes("POST", "/v1/chat/completions", STREAM),
    request_bytes("POST", "/v1/completions", b'{"model": "m", "prompt": "once"}'),
    request_bytes("GET", "/health", None),
    request_bytes("GET", "/v1/models", None),
    request_bytes("POST", "/v1/chat/completions", CHAT, extra="expect: 100-continue\r\n"),
    request_bytes("POST", "/v1/chat/completions", b"").replace(
        b"content-length: 0", b"transfer-encoding: chunked"
    )
    + b"%x\r\n" % len(CHAT)
    + CHAT
    + b"\r\n0\r\n\r\n",
    request_bytes("GET", "/health", None) * 2,
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request (or two) with a few byte-level edits."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "repeat"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "truncate":
            del data[at:]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
FIELD_NAMES = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "n",
        "logprobs",
        "top_logprobs",
        "user",
        "role",
        "content",
        "type",
        "text",
        "image_url",
        "url",
        "input_audio",
        "tools",
        "response_format",
        "include_usage",
    ]
) | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELD_NAMES, inner, max_size=6),
    max_leaves=25,
)


@st.composite
def chat_like(draw: st.DrawFn) -> object:
    """A body shaped like a chat request, with random values in every slot."""
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "video_url", "x"])},
        optional={"text": JSON_VALUES, "image_url": JSON_VALUES, "input_audio": JSON_VALUES},
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSON_SCALARS,
            "content": JSON_SCALARS | st.lists(part, max_size=3),
        }
    )
    return draw(
        st.fixed_dictionaries(
            {"model": st.just("m") | JSON_SCALARS, "messages": st.lists(message, max_size=3)},
            optional={
                name: JSON_VALUES
                for name in ("max_tokens", "stream", "stream_options", "stop", "temperature")
            },
        )
    )


def json_request(body: object) -> bytes:
    payload = json.dumps(body).encode()
    target = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else ("/v1/completions")
    )
    return request_bytes("POST", target, payload)


HTTP_INPUTS = (
    st.binary(max_size=600)
    | mutated()
    | JSON_VALUES.map(json_request)
    | chat_like().map(json_request)
)


def responses_in(data: bytes) -> list[int]:
    """The statuses of the complete HTTP/1.1 responses in ``data``; fails on
    anything else (a cut response, bytes that are not HTTP)."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(data)
    conn.receive_data(b"")
    statuses: list[int] = []
    while True:
        if not conn.trailing_data[0]:
            return statuses  # nothing more: the server closed between responses
        # The server answers whatever it parsed; pretend a GET went out so that
        # h11 parses the next answer (none of the inputs' methods is HEAD).
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "test")]))
        conn.send(h11.EndOfMessage())
        while True:
            event = conn.next_event()
            assert event is not h11.NEED_DATA, f"a cut response in {data[-200:]!r}"
            if isinstance(event, h11.ConnectionClosed):
                return statuses
            if isinstance(event, h11.Response):
                statuses.append(event.status_code)
            if isinstance(event, h11.EndOfMessage):
                break
        if conn.their_state is not h11.DONE:
            assert isinstance(conn.next_event(), h11.ConnectionClosed)
            return statuses
        conn.start_next_cycle()


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def exchange(data: bytes) -> bytes:
    """Send ``data`` and EOF to a fresh connection handler; return all it wrote."""
    client, server_end = trio.testing.memory_stream_pair()
    server = HttpServer(ScriptedApp(list(SCRIPT)), SETTINGS)  # type: ignore[arg-type]
    before = trio.lowlevel.current_statistics().tasks_living
    received = bytearray()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, server_end)
            try:
                await client.send_all(data)
                # Half-closing at once may race the answer (the server takes EOF
                # as the client leaving); a virtual second lets it answer first.
                await trio.sleep(1.0)
                await client.send_eof()
            except trio.BrokenResourceError:
                pass  # the server hung up first: allowed
            while chunk := await client.receive_some(65536):
                received += chunk
    assert trio.lowlevel.current_statistics().tasks_living == before
    assert server.connections == 0
    return bytes(received)


def run_exchange(data: bytes) -> bytes:
    collect = Collect()
    logger = logging.getLogger("epd_actors.frontends")
    logger.addHandler(collect)
    try:
        out = trio.run(exchange, data, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        logger.removeHandler(collect)
    assert [r.getMessage() for r in collect.records] == []
    return out


@FUZZ_SETTINGS
@given(HTTP_INPUTS)
def test_no_input_crashes_the_connection_handler(data: bytes) -> None:
    for status in responses_in(run_exchange(data)):
        assert status != 500
        assert 100 <= status < 600


def test_the_seeds_themselves_are_answered() -> None:
    statuses = [responses_in(run_exchange(seed)) for seed in SEEDS]
    assert statuses == [[200], [200], [200], [200], [200], [200], [200], [200, 200]]


LIMITS = MediaLimits()
PARSERS: list[Callable[[object], object]] = [
    lambda body: parse_chat_completion(body, request_id="fuzz", limits=LIMITS),
    lambda body: parse_completion(body, request_id="fuzz", limits=LIMITS),
]


@FUZZ_SETTINGS
@given(JSON_VALUES | chat_like())
def test_the_openai_parser_only_raises_invalid_request(body: object) -> None:
    for parse in PARSERS:
        with contextlib.suppress(InvalidRequest):  # anything else fails the test
            parse(body)
