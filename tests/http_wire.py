"""Raw HTTP/1.1 over memory streams, for tests of servers on the shell (``http.server``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import h11
import trio
import trio.testing

if TYPE_CHECKING:
    from epd_actors.http.server import HttpServer


async def exchange(server: HttpServer, data: bytes, *, eof: bool = True) -> bytes:
    """Send ``data`` on one connection, return every byte the server wrote until it closed."""
    client, stream = trio.testing.memory_stream_pair()
    answer = b""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, stream)
            await client.send_all(data)
            if eof:
                await client.send_eof()
            while chunk := await client.receive_some(65536):
                answer += chunk
    return answer


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Parse the server's bytes as h11 does: status, headers, body of each response."""
    conn = h11.Connection(h11.CLIENT)
    found: list[tuple[int, dict[str, str], bytes]] = []
    conn.receive_data(data)
    for _ in range(8):
        if not conn.trailing_data[0]:
            return found
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(b"")  # everything was fed: the rest is the close
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                found.append((status, headers, body))
                break
            else:
                return found
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return found
        conn.start_next_cycle()
    return found
