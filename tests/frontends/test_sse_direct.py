"""The direct SSE writer: deltas written by the task that produced them, in order, never blocking.

A socket pair stands in for the client: the writer only writes without
waiting on a real socket (a memory stream takes nothing that way, which the
HTTP front end's tests cover: everything then goes through the backlog).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11
import pytest
import trio
import trio.testing

from epd_actors.frontends.sse_direct import DirectSseWriter
from epd_actors.handoff import HandoffReceiver, open_handoff
from epd_actors.http.body import body_framer
from epd_actors.openai.format import SseFormatter
from epd_actors.protocol import Usage
from epd_actors.request import DeltaEvent, DoneEvent, GenerationEvent, RequestTimings
from epd_actors.transport.nowait import NowaitWriter, memory_nowait_pair

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@dataclass
class Sent:
    sent: int = 0


def streaming_response() -> h11.Connection:
    """A server-side h11 connection that has sent the head of a chunked response."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    assert isinstance(connection.next_event(), h11.Request)
    connection.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
    return connection


def done_event() -> DoneEvent:
    return DoneEvent("stop", Usage(1, 1), RequestTimings(0.0, {}, None, 0.0, {}))


def writer_on(stream: trio.abc.Stream, exchange: Sent | None = None) -> DirectSseWriter:
    formatter = SseFormatter("completion", request_id="r", model="m", created=0)
    frame = body_framer(streaming_response())
    return DirectSseWriter(
        frame, NowaitWriter(stream), formatter, logprobs=False, exchange=exchange
    )


Pair = tuple[trio.SocketStream, trio.SocketStream]


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    left, right = trio.socket.socketpair()
    server, client = trio.SocketStream(left), trio.SocketStream(right)
    async with server, client:
        yield server, client


async def read_text(stream: trio.SocketStream) -> str:
    return (await stream.receive_some(65536)).decode()


async def waiting(
    receive: HandoffReceiver[GenerationEvent],
    seen: list[list[GenerationEvent]],
    writer: DirectSseWriter,
    nursery: trio.Nursery,
) -> None:
    """Have the response's task wait on ``receive`` (with ``writer`` attached)."""

    async def consume() -> None:
        seen.append(await writer.next_batch(receive))

    receive.attach(writer)
    nursery.start_soon(consume)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_delta_is_written_only_while_the_responses_task_waits(pair: Pair) -> None:
    server, client = pair
    exchange = Sent()
    writer = writer_on(server, exchange)
    send, receive = open_handoff[GenerationEvent](4)
    receive.attach(writer)
    send.send_nowait(DeltaEvent("early", (1,)))  # not waiting: queued
    assert receive.queued == 1
    seen: list[list[GenerationEvent]] = []
    async with trio.open_nursery() as nursery:
        await waiting(receive, seen, writer, nursery)
        assert seen == [[DeltaEvent("early", (1,))]]
        await waiting(receive, seen, writer, nursery)
        send.send_nowait(DeltaEvent("hello", (1,)))
        assert '"text":"hello"' in await read_text(client)
        assert not writer.backlog
        assert not writer.failed
        assert exchange.sent > 0
        send.send_nowait(DeltaEvent("", ()))  # nothing to render, nothing written
        send.send_nowait(DeltaEvent("again", (2,)))
        assert (await read_text(client)).count("data: ") == 1
        assert receive.queued == 0
        send.send_nowait(done_event())  # the end goes to the response's task
    assert seen[-1] == [done_event()]


async def test_what_a_full_socket_did_not_take_waits_for_the_responses_task(pair: Pair) -> None:
    server, client = pair
    writer = writer_on(server)
    while True:  # fill the socket's buffers
        try:
            os.write(server.socket.fileno(), b"x" * 65536)
        except BlockingIOError:
            break
    send, receive = open_handoff[GenerationEvent](4)
    late = DeltaEvent("late", (1,))
    following = DeltaEvent("next", (2,))
    seen: list[list[GenerationEvent]] = []
    async with trio.open_nursery() as nursery:
        await waiting(receive, seen, writer, nursery)
        send.send_nowait(late)  # rendered and kept, but queued to wake the response's task
        assert writer.written is late
        assert writer.backlog.endswith(
            b'"text":"late","logprobs":null,"finish_reason":null}]}\n\n\r\n'
        )
        send.send_nowait(following)  # queued behind the backlog
    assert seen == [[following]]  # "late" is not rendered twice
    assert writer.written is None
    backlog = writer.take_backlog()
    assert backlog
    assert not writer.backlog
    assert client.socket.fileno() != -1  # the client never read a byte


async def test_a_client_that_is_gone_is_reported_not_raised(pair: Pair) -> None:
    server, client = pair
    writer = writer_on(server)
    await client.aclose()
    results = [writer(DeltaEvent(f"t{n}", (n,))) for n in range(3)]
    # The first write may still find the socket open; a later one meets the reset.
    assert results[-1] is False
    assert writer.failed


async def test_a_write_in_progress_refuses_the_direct_one() -> None:
    server, client = memory_nowait_pair(room=8)
    nowait = NowaitWriter(server)
    formatter = SseFormatter("completion", request_id="r", model="m", created=0)
    writer = DirectSseWriter(
        body_framer(streaming_response()), nowait, formatter, logprobs=False, exchange=None
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(nowait.send_all, b"x" * 16)  # the response's task, waiting for room
        await trio.testing.wait_all_tasks_blocked()
        assert writer(DeltaEvent("direct", (1,))) is False
        assert not writer.failed
        assert not writer.backlog
        await client.receive_some()
        await client.receive_some()


async def test_the_twin_stream_takes_direct_writes_as_a_socket_does() -> None:
    server, client = memory_nowait_pair(room=1 << 16)
    writer = writer_on(server)
    send, receive = open_handoff[GenerationEvent](4)
    seen: list[list[GenerationEvent]] = []
    async with trio.open_nursery() as nursery:
        await waiting(receive, seen, writer, nursery)
        send.send_nowait(DeltaEvent("direct", (2,)))
        assert '"text":"direct"' in (await client.receive_some()).decode()
        server.set_room(0)
        send.send_nowait(DeltaEvent("wake", (3,)))  # nothing taken: the response's task wakes
    assert seen == [[]]
    assert writer.take_backlog().count(b"wake") == 1
