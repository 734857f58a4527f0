"""A Prometheus scrape endpoint on the server shell: ``GET``/``HEAD /metrics``, nothing else.

Used by the worker's ``--metrics-listen`` and by the parent of ``serve
--processes N``.  Each connection answers one request and closes
(``connection: close``), bounded by :data:`LIMITS`: a 16 KiB head, no body
worth the name, ``REQUEST_TIMEOUT_S`` for each of the head, the body and the
answer's write.  Other paths answer 404, other methods on ``/metrics`` 405.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import trio

from .server import HttpResponse, HttpServer, ServerLimits

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .server import HttpRequest, Responder

__all__ = ["LIMITS", "METRICS_PATH", "metrics_server", "serve_metrics"]

METRICS_PATH: Final = "/metrics"
REQUEST_TIMEOUT_S: Final = 10.0
LIMITS: Final = ServerLimits(
    max_header_bytes=16384,
    max_body_bytes=16384,
    keep_alive_timeout_s=REQUEST_TIMEOUT_S,
    body_timeout_s=REQUEST_TIMEOUT_S,
    write_timeout_s=REQUEST_TIMEOUT_S,
    max_connections=64,
)
_CLOSE: Final = (("connection", "close"),)


def metrics_server(
    render: Callable[[], Awaitable[bytes]], content_type: str, *, name: str = "metrics"
) -> HttpServer:
    """A server answering ``GET /metrics`` with ``await render()`` as ``content_type``."""

    async def answer(request: HttpRequest, responder: Responder) -> HttpResponse:
        if request.path != METRICS_PATH:
            return HttpResponse(404, b"not found: the only path is /metrics\n", headers=_CLOSE)
        if request.method not in ("GET", "HEAD"):
            return HttpResponse(405, b"method not allowed: use GET\n", headers=_CLOSE)
        return HttpResponse(200, await render(), content_type, _CLOSE)

    return HttpServer(answer, LIMITS, name=name)


async def serve_metrics(
    listeners: Sequence[trio.SocketListener],
    render: Callable[[], Awaitable[bytes]],
    content_type: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve :func:`metrics_server` on ``listeners`` until cancelled.

    Cancellation: cancelling stops accepting and drops open connections.
    Backpressure: each connection is one bounded request.
    """
    server = metrics_server(render, content_type)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        task_status.started()
