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
from epd_actors.http.body import body_framer
from epd_actors.openai.format import SseFormatter
from epd_actors.request import DeltaEvent, GenerationEvent
from epd_actors.transport.nowait import NowaitWriter

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


async def test_a_delta_is_written_only_while_the_responses_task_is_idle(pair: Pair) -> None:
    server, client = pair
    exchange = Sent()
    writer = writer_on(server, exchange)
    assert writer(DeltaEvent("early", (1,))) is False  # not idle: queue it
    writer.idle = True
    assert writer(DeltaEvent("hello", (1,))) is True
    assert '"text":"hello"' in await read_text(client)
    assert writer.idle
    assert not writer.backlog
    assert not writer.failed
    assert exchange.sent > 0
    assert writer(DeltaEvent("", ())) is True  # nothing to render, nothing written
    assert writer(DeltaEvent("again", (2,))) is True
    assert (await read_text(client)).count("data: ") == 1


async def test_what_a_full_socket_did_not_take_waits_for_the_responses_task(pair: Pair) -> None:
    server, client = pair
    writer = writer_on(server)
    while True:  # fill the socket's buffers
        try:
            os.write(server.socket.fileno(), b"x" * 65536)
        except BlockingIOError:
            break
    writer.idle = True
    late = DeltaEvent("late", (1,))
    assert writer(late) is False  # rendered and kept, but queued to wake the response's task
    assert writer.written is late
    assert writer.backlog.endswith(b'"text":"late","logprobs":null,"finish_reason":null}]}\n\n\r\n')
    assert not writer.idle
    following = DeltaEvent("next", (2,))
    assert writer(following) is False  # queued behind the backlog
    send, receive = trio.open_memory_channel[GenerationEvent](4)
    send.send_nowait(late)  # as the relay queues what was refused
    send.send_nowait(following)
    assert await writer.next_batch(receive) == [following]  # "late" is not rendered twice
    assert writer.written is None
    backlog = writer.take_backlog()
    assert backlog
    assert not writer.backlog
    assert client.socket.fileno() != -1  # the client never read a byte


async def test_a_client_that_is_gone_is_reported_not_raised(pair: Pair) -> None:
    server, client = pair
    writer = writer_on(server)
    await client.aclose()
    writer.idle = True
    results = [writer(DeltaEvent(f"t{n}", (n,))) for n in range(3)]
    # The first write may still find the socket open; a later one meets the reset.
    assert results[-1] is False
    assert writer.failed
    assert not writer.idle


async def test_next_batch_is_open_to_direct_writes_only_on_an_empty_channel(pair: Pair) -> None:
    server, client = pair
    writer = writer_on(server)
    send, receive = trio.open_memory_channel[GenerationEvent](4)
    seen: list[list[GenerationEvent]] = []

    async def consume() -> None:
        seen.append(await writer.next_batch(receive))

    send.send_nowait(DeltaEvent("queued", (1,)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
    assert not writer.idle  # something was queued: no direct write meanwhile
    assert seen == [[DeltaEvent("queued", (1,))]]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        assert writer.idle  # waiting on an empty channel
        assert writer(DeltaEvent("direct", (2,))) is True
        send.send_nowait(DeltaEvent("wake", (3,)))
    assert not writer.idle
    assert '"text":"direct"' in await read_text(client)
