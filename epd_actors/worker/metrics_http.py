"""The worker's Prometheus endpoint (``worker --metrics-listen``): ``GET /metrics``.

A native worker that embeds vLLM hides vLLM's HTTP server, and with it the
engine's own metrics (``vllm:num_requests_running``,
``vllm:prompt_tokens_by_source_total`` and the rest), which vLLM registers in
``prometheus_client``'s default registry of the process that owns the
``AsyncLLM``: the worker.  This module serves that registry in Prometheus' text
format, so operators scrape a native worker the way they scrape ``vllm serve``.

One request per connection, answered and closed.  Every connection is bounded:
``MAX_REQUEST_BYTES`` of request head and ``REQUEST_TIMEOUT_S`` to send it and
read the answer, after which the connection is dropped; it never touches the
worker's own protocol or engine.  Only ``GET``/``HEAD /metrics`` answer 200;
other paths 404, other methods 405.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import h11
import prometheus_client
import trio

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16384
REQUEST_TIMEOUT_S = 10.0
RECEIVE_BYTES = 4096


async def serve_metrics(
    listeners: list[trio.SocketListener],
    *,
    registry: CollectorRegistry = prometheus_client.REGISTRY,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` on ``listeners`` until cancelled.

    Cancellation: cancelling stops accepting and drops open connections.
    Backpressure: none needed; each connection is one bounded request.
    """

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                await _answer(stream, registry)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started()


async def _answer(stream: trio.abc.Stream, registry: CollectorRegistry) -> None:
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        request = await _read_request(stream, connection)
    except h11.RemoteProtocolError:
        return
    if request is None:
        return
    status, content_type, body = _response(request, registry)
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    headers.append(("connection", "close"))
    data = connection.send(h11.Response(status_code=status, headers=headers)) or b""
    if request.method != b"HEAD":
        data += connection.send(h11.Data(data=body)) or b""
    data += connection.send(h11.EndOfMessage()) or b""
    try:
        await stream.send_all(data)
    except trio.BrokenResourceError:
        logger.debug("metrics client went away before its answer")


async def _read_request(stream: trio.abc.Stream, connection: h11.Connection) -> h11.Request | None:
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except trio.BrokenResourceError:
                return None
            connection.receive_data(bytes(data))
            if not data:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _response(request: h11.Request, registry: CollectorRegistry) -> tuple[int, str, bytes]:
    path = request.target.split(b"?", 1)[0]
    if path != b"/metrics":
        return 404, "text/plain; charset=utf-8", b"not found: the only path is /metrics\n"
    if request.method not in (b"GET", b"HEAD"):
        return 405, "text/plain; charset=utf-8", b"method not allowed: use GET\n"
    return 200, prometheus_client.CONTENT_TYPE_LATEST, prometheus_client.generate_latest(registry)
