"""What the router's per-token steps cost in Python, one at a time, on this machine.

When a worker emits one token per delta, the router does a few things per
token that are pure Python and need no socket: decode the worker's frame (a
native ``Delta``, or a vLLM server-sent event), and frame the client's SSE
chunk.  This times each of them in a loop (``timeit``, the best of
``--repeat`` runs) and prints microseconds (µs) per item:

* ``native delta decode`` / ``encode``: one one-token ``Delta`` through the wire
  codec (``decode_body`` / ``encode``), and the frame's size;
* ``vLLM chunk -> delta``: a 64-token chat stream as vLLM writes it (one
  ``chat.completion.chunk`` per token, ``return_token_ids`` on), through
  ``SseDecoder`` and ``DeltaParser``: fed one event per call (a read per token,
  as in a paced stream) and all at once (one read for the stream);
* ``chunk -> client SSE``: the same stream, one event per read, through the
  decoder, the parser and the front end's ``SseFormatter`` (worker bytes to
  client text), with the ``openai_http`` relay of text chunks on (``relay``)
  and off (``parse``), when this checkout has the relay, and with a read of
  one text event made into its delta at once (``at once``, the stream's path
  for such a read), when this checkout has that;
* ``SSE chunk framing``: one rendered delta framed as an HTTP/1.1 chunk by
  ``h11.Data`` and by the front end's own framer, when this checkout has one;
* ``relay a delta``: one one-token delta through the output relay to a caller
  that takes it directly (``OutputRelay.offer``, as the backend's reader calls
  it), with the per-request inter-token gap record when this checkout has one;
  and the Python and C function calls it makes per delta (``sys.setprofile``),
  a count the machine's load does not move;
* ``record``: building a one-token ``Delta`` and the caller's ``DeltaEvent``
  with every field given, as this checkout defines them and as a frozen
  dataclass with the same fields (what they were before they became
  ``token_record`` classes).

To compare checkouts, run it from each with ``PYTHONPATH`` pointing at that
checkout (the machine is shared, so run them back to back, twice)::

    python benchmarks/per_token_cost.py
    PYTHONPATH=<checkout> python benchmarks/per_token_cost.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import timeit
from typing import TYPE_CHECKING

import h11
import trio

from epd_actors.backends.openai_http.contract import DeltaParser
from epd_actors.core.output_relay import OutputRelay
from epd_actors.handoff import open_handoff
from epd_actors.http.sse import SseDecoder
from epd_actors.protocol import Delta, decode_body, encode
from epd_actors.protocol.codec import HEADER

if TYPE_CHECKING:
    from collections.abc import Callable

TOKENS = 64


def per_item(work: Callable[[], object], items: int, number: int, repeat: int) -> float:
    """Microseconds per item: the best of ``repeat`` runs of ``number`` calls of ``work``."""
    best = min(timeit.repeat(work, number=number, repeat=repeat))
    return best / number / items * 1e6


def vllm_event(index: int, finish: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": 1764547200,
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "delta": {"content": f" tok{index}"},
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": [1000 + index],
            }
        ],
    }
    # Compact, as vLLM writes it (pydantic's ``model_dump_json``).
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class _Progress:
    first_token_at: float | None = None
    completion_tokens = 0


def relay_us(number: int, repeat: int) -> float:
    """Microseconds per one-token delta through ``OutputRelay.offer`` (inside Trio)."""

    async def measure() -> float:
        send, receive = open_handoff[object](1)
        receive.attach(lambda event: True)  # a front end that takes every event directly
        relay = OutputRelay(send, _Progress(), 10.0, **gap_record())  # type: ignore[arg-type]
        delta = Delta("r", token_ids=(1234,), text=" token")
        return per_item(lambda: relay.offer(delta), 1, number, repeat)

    return trio.run(measure)


def relay_calls(deltas: int = 1000) -> tuple[float, float]:
    """Python and C function calls per one-token delta through ``OutputRelay.offer``."""

    async def count() -> tuple[float, float]:
        send, receive = open_handoff[object](1)
        receive.attach(lambda event: True)  # a front end that takes every event directly
        relay = OutputRelay(send, _Progress(), 10.0, **gap_record())  # type: ignore[arg-type]
        delta = Delta("r", token_ids=(1234,), text=" token")
        relay.offer(delta)  # the first delta: no gap yet

        def offer_all() -> None:
            for _ in range(deltas):
                relay.offer(delta)

        python_calls, c_calls = profiled_calls(offer_all)
        return python_calls / deltas, c_calls / deltas

    return trio.run(count)


def relay_lines(events: list[bytes], number: int, repeat: int) -> None:
    """The HTTP backend's relay of text chunks, where this checkout has it, against the parse.

    ``chunk -> client SSE``: one event per read through the decoder, the
    parser and the front end's formatter (what a token costs from the
    worker's bytes to the client's), with ``relay`` on and off.
    """
    try:
        from epd_actors.backends.openai_http.relay import ChunkScanner  # noqa: F401
    except ImportError:
        modes = ["parse"]
    else:
        modes = ["relay", "parse"]
    if hasattr(DeltaParser, "text_delta"):
        modes.insert(0, "at once")
    from epd_actors.core.output_relay import delta_event
    from epd_actors.openai.format import SseFormatter

    def to_client(mode: str) -> Callable[[], None]:
        options = {} if mode == "parse" else {"relay": True}

        def run() -> None:
            decoder = SseDecoder(1 << 20)
            deltas = DeltaParser("r", chat=True, **options)  # type: ignore[arg-type]
            formatter = SseFormatter("chat", request_id="r", model="m", created=1)
            for event in events:
                delta = None
                if mode == "at once":  # the stream's path for a read of one event
                    data = decoder.single_data(event)
                    delta = None if data is None else deltas.text_delta(data)
                if delta is None:
                    deltas.feed(decoder.feed(event))
                    delta = deltas.take()
                if delta is not None and delta.text:
                    formatter.event(delta_event(delta))

        return run

    runs = max(1, number // TOKENS)
    for label in modes:
        print(
            f"chunk -> client SSE   {per_item(to_client(label), TOKENS, runs, repeat):6.2f} µs"
            f"   (one event per read, {label})"
        )
    for label in modes:
        python_calls, c_calls = calls_per_token(to_client(label))
        print(
            f"chunk -> client SSE   {python_calls:6.1f} Python calls, {c_calls:.1f} C calls"
            f"   ({label})"
        )


def calls_per_token(work: Callable[[], None]) -> tuple[float, float]:
    """Python and C function calls per token of one run of ``work`` (a 64-token stream)."""
    work()  # warm up (regular expressions compiled, caches filled)
    python_calls, c_calls = profiled_calls(work)
    return python_calls / TOKENS, c_calls / TOKENS


def profiled_calls(work: Callable[[], None]) -> tuple[int, int]:
    """The Python and C function calls of one run of ``work`` (``sys.setprofile``)."""
    calls = {"call": 0, "c_call": 0}

    def profile(frame: object, event: str, arg: object) -> None:
        if event in calls:
            calls[event] += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls["call"], calls["c_call"]


def frozen_twin(cls: type) -> type:
    """A frozen, slotted dataclass with ``cls``'s fields and defaults (what it was built as)."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)
    ]
    twin: type = dataclasses.make_dataclass(
        f"Frozen{cls.__name__}", fields, frozen=True, slots=True
    )
    return twin


def record_lines(number: int, repeat: int) -> None:
    """``record``: building a one-token ``Delta`` and the caller's ``DeltaEvent``, every field
    given, as this checkout defines them and as a frozen dataclass with the same fields."""
    from epd_actors.request import DeltaEvent

    delta_fields = {
        f.name: getattr(Delta("r", (1234,), " tok"), f.name) for f in dataclasses.fields(Delta)
    }
    event_fields = {
        f.name: getattr(DeltaEvent(" tok", (1234,)), f.name) for f in dataclasses.fields(DeltaEvent)
    }
    for cls, values in ((Delta, delta_fields), (DeltaEvent, event_fields)):
        frozen = frozen_twin(cls)
        own = per_item(functools.partial(cls, **values), 1, number, repeat)
        twin = per_item(functools.partial(frozen, **values), 1, number, repeat)
        print(f"record {cls.__name__:<14} {own:6.2f} µs   (frozen dataclass {twin:.2f} µs)")


def gap_record() -> dict[str, object]:
    """The relay's inter-token gap record, as the supervisor passes it, where there is one."""
    try:
        from epd_actors.core.token_gaps import TokenGaps
    except ImportError:
        return {}
    return {"gaps": TokenGaps()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs; the best counts")
    args = parser.parse_args()
    number, repeat = args.number, args.repeat

    delta = Delta("req-0123456789abcdef", token_ids=(1234,), text=" token")
    frame = encode(delta)
    body = frame[HEADER.size :]
    decode_us = per_item(lambda: decode_body(body), 1, number, repeat)
    encode_us = per_item(lambda: encode(delta), 1, number, repeat)
    print(f"native delta decode   {decode_us:6.2f} µs   ({len(frame)}-byte frame)")
    print(f"native delta encode   {encode_us:6.2f} µs")

    events = [vllm_event(i) for i in range(TOKENS - 1)] + [vllm_event(TOKENS - 1, "stop")]
    stream = b"".join(events)

    def event_per_read() -> None:
        decoder, deltas = SseDecoder(1 << 20), DeltaParser("r", chat=True)
        for event in events:
            deltas.feed(decoder.feed(event))
            deltas.take()

    def stream_per_read() -> None:
        decoder, deltas = SseDecoder(1 << 20), DeltaParser("r", chat=True)
        deltas.feed(decoder.feed(stream))
        deltas.take()

    runs = max(1, number // TOKENS)
    print(
        f"vLLM chunk -> delta   {per_item(event_per_read, TOKENS, runs, repeat):6.2f} µs"
        "   (one event per read)"
    )
    print(
        f"vLLM chunk -> delta   {per_item(stream_per_read, TOKENS, runs, repeat):6.2f} µs"
        "   (the whole stream in one read)"
    )
    relay_lines(events, number, repeat)

    piece = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"text":" token"}]}\n\n'
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    connection.next_event()
    connection.next_event()
    connection.send(h11.Response(status_code=200, headers=[]))
    h11_us = per_item(lambda: connection.send(h11.Data(data=piece)), 1, number, repeat)
    print(f"SSE chunk framing     {h11_us:6.2f} µs   (h11.Data)")
    print(f"relay a delta         {relay_us(number, repeat):6.2f} µs   (OutputRelay.offer, taken)")
    python_calls, c_calls = relay_calls()
    print(f"relay a delta         {python_calls:6.1f} Python calls, {c_calls:.1f} C calls")
    record_lines(number, repeat)
    try:
        from epd_actors.http.body import body_framer
    except ImportError:
        return
    frame_piece = body_framer(connection)
    print(
        f"SSE chunk framing     {per_item(lambda: frame_piece(piece), 1, number, repeat):6.2f} µs"
        "   (body_framer)"
    )


if __name__ == "__main__":
    main()
