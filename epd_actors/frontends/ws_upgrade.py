"""WebSocket upgrades on the HTTP port: recognise the request and hand its stream over.

Theory of operation
-------------------
The HTTP front end reads every request head with h11.  When a head asks for
``Upgrade: websocket`` on the WebSocket path, the connection stops serving
HTTP (its reader task is cancelled, which in Trio loses no byte already
received) and gives the socket to the WebSocket server.  trio-websocket's
``wrap_server_stream`` reads the opening handshake from the stream itself, so
the head h11 already consumed is rebuilt
(:func:`epd_actors.http.upgrade.replayed_head`) and put in front of whatever
h11 had buffered after it; :class:`~epd_actors.http.upgrade.ReplayStream`
returns those bytes first, then reads the socket.  wsproto then validates the
handshake exactly as on the separate WebSocket listener (a bad key, version
or missing ``Connection: Upgrade`` is refused there).  The replay itself is the
HTTP server shell's (:mod:`epd_actors.http.upgrade`).
"""

from __future__ import annotations

import trio

__all__ = ["stream_peer", "wants_websocket"]


def wants_websocket(method: str, headers: dict[str, str]) -> bool:
    """Whether a request head asks to switch to the WebSocket protocol."""
    if method != "GET":
        return False
    protocols = {item.strip().lower() for item in headers.get("upgrade", "").split(",")}
    return "websocket" in protocols


def stream_peer(stream: trio.abc.Stream) -> str:
    """``host:port`` of the client behind ``stream`` (TCP, TLS or replayed), or ``?``."""
    inner: object = stream
    while not isinstance(inner, trio.SocketStream):
        inner = getattr(inner, "transport_stream", None)
        if inner is None:
            return "?"
    try:
        peer = inner.socket.getpeername()
    except OSError:  # already reset
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
