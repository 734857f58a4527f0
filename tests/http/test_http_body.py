"""Framing a streamed response's body pieces outside h11: a real h11 client must read them."""

from __future__ import annotations

import h11
import pytest

from epd_actors.http.body import body_framer

PIECES = (b"data: one\n\n", b"", "data: \u00e9t\u00e9\n\n".encode(), b"x" * 70_000)


def exchange(version: bytes) -> tuple[h11.Connection, h11.Connection]:
    """A server that read a request of HTTP/``version``, and a client to read its answer."""
    client = h11.Connection(h11.CLIENT)
    headers = [("host", "x"), ("content-length", "0")]
    client.send(h11.Request(method="POST", target="/", headers=headers))
    client.send(h11.EndOfMessage())
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"POST / HTTP/%b\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % version)
    assert isinstance(server.next_event(), h11.Request)
    assert isinstance(server.next_event(), h11.EndOfMessage)
    return server, client


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_framed_pieces_read_back_as_the_body_h11_would_have_sent(version: bytes) -> None:
    server, client = exchange(version)
    head = server.send(h11.Response(status_code=200, headers=[("content-type", "text/plain")]))
    assert head is not None
    frame = body_framer(server)
    wire = head + b"".join(frame(piece) for piece in PIECES)
    wire += server.send(h11.EndOfMessage()) or b""
    assert server.our_state is (h11.DONE if version == b"1.1" else h11.MUST_CLOSE)
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (version == b"1.1")
    client.receive_data(wire)
    if not chunked:
        client.receive_data(b"")  # an HTTP/1.0 body ends with the connection
    body = b""
    while (event := client.next_event()) is not h11.NEED_DATA:
        if isinstance(event, h11.Data):
            body += event.data
        if isinstance(event, h11.EndOfMessage):
            break
    assert body == b"".join(PIECES)


def test_an_empty_piece_frames_to_nothing_rather_than_ending_the_body() -> None:
    server, _ = exchange(b"1.1")
    server.send(h11.Response(status_code=200, headers=[]))
    frame = body_framer(server)
    assert frame(b"") == b""
    assert frame(b"abc") == b"3\r\nabc\r\n"
