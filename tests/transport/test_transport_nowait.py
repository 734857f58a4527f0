"""Writing without waiting: a socket, its in-memory twin, and the one-writer guard."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from epd_actors.transport.nowait import NowaitWriter, memory_nowait_pair, send_some_nowait


async def test_a_socket_takes_what_fits_without_waiting() -> None:
    left, right = trio.socket.socketpair()
    server, client = trio.SocketStream(left), trio.SocketStream(right)
    async with server, client:
        assert send_some_nowait(server, b"hello") == 5
        assert await client.receive_some(100) == b"hello"
        big = b"x" * (1 << 24)
        taken = send_some_nowait(server, big)
        assert 0 < taken < len(big)  # the kernel's buffer is full
        assert send_some_nowait(server, b"more") == 0
        await server.send_eof()
        assert send_some_nowait(server, b"after eof") == 0


async def test_a_reset_socket_is_broken() -> None:
    left, right = trio.socket.socketpair()
    server = trio.SocketStream(left)
    right.close()
    with pytest.raises(trio.BrokenResourceError):
        send_some_nowait(server, b"x" * 65536)
    await server.aclose()
    assert send_some_nowait(server, b"closed") == 0


async def test_other_streams_take_nothing_without_waiting() -> None:
    left, _right = trio.testing.memory_stream_pair()
    assert send_some_nowait(left, b"data") == 0


async def test_the_twin_takes_what_its_buffer_holds_and_waits_for_the_rest() -> None:
    server, client = memory_nowait_pair(room=4)
    assert send_some_nowait(server, b"abcdef") == 4
    assert send_some_nowait(server, b"gh") == 0
    assert await client.receive_some(2) == b"ab"
    assert server.send_some_nowait(b"gh") == 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send_all, b"ijklmn")
        received = b""
        while len(received) < 10:
            received += await client.receive_some()
        assert received == b"cdghijklmn"
    server.set_room(1)
    assert server.send_some_nowait(b"xy") == 1
    await server.send_eof()
    assert await client.receive_some() == b"x"
    assert await client.receive_some() == b""
    assert server.send_some_nowait(b"z") == 0
    with pytest.raises(trio.ClosedResourceError):
        await server.send_all(b"z")


async def test_the_twin_is_broken_once_its_peer_closed() -> None:
    server, client = memory_nowait_pair(room=2)
    async with trio.open_nursery() as nursery:

        async def blocked_write() -> None:
            with pytest.raises(trio.BrokenResourceError):
                await server.send_all(b"abcd")

        nursery.start_soon(blocked_write)
        await trio.testing.wait_all_tasks_blocked()
        await client.aclose()
    with pytest.raises(trio.BrokenResourceError):
        server.send_some_nowait(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await client.receive_some()
    await server.wait_send_all_might_not_block()


async def test_the_writer_refuses_a_second_writer_while_one_waits() -> None:
    server, client = memory_nowait_pair(room=2)
    writer = NowaitWriter(server)
    assert await writer.write(b"ab") == 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.write, b"cdef")  # waits: the buffer is full
        await trio.testing.wait_all_tasks_blocked()
        assert writer.busy
        with pytest.raises(trio.BusyResourceError):
            writer.send_some_nowait(b"x")
        with pytest.raises(trio.BusyResourceError):
            await writer.send_all(b"x")
        received = b""
        while len(received) < 6:
            received += await client.receive_some()
        assert received == b"abcdef"
    assert not writer.busy
    assert writer.send_some_nowait(b"gh") == 2
