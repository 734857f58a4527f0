"""The worker's Prometheus endpoint (``worker --metrics-listen``): ``GET /metrics``.

A native worker that embeds vLLM hides vLLM's HTTP server, and with it the
engine's own metrics (``vllm:num_requests_running``,
``vllm:prompt_tokens_by_source_total`` and the rest), which vLLM registers in
``prometheus_client``'s default registry of the process that owns the
``AsyncLLM``: the worker.  This module serves that registry in Prometheus' text
format, so operators scrape a native worker the way they scrape ``vllm serve``.

The endpoint itself is :mod:`epd_actors.http.metrics_endpoint` (one bounded
request per connection; only ``GET``/``HEAD /metrics`` answer 200; other paths
404, other methods 405); it never touches the worker's own protocol or engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import prometheus_client
import trio

from ..http.metrics_endpoint import metrics_server
from ..http.metrics_endpoint import serve_metrics as serve_endpoint

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from prometheus_client.registry import CollectorRegistry

    from ..http.server import HttpServer


def registry_server(registry: CollectorRegistry = prometheus_client.REGISTRY) -> HttpServer:
    """The endpoint's server for ``registry`` (serve it, or hand it connections)."""
    return metrics_server(_renderer(registry), prometheus_client.CONTENT_TYPE_LATEST)


async def serve_metrics(
    listeners: Sequence[trio.SocketListener],
    *,
    registry: CollectorRegistry = prometheus_client.REGISTRY,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` on ``listeners`` until cancelled.

    Cancellation: cancelling stops accepting and drops open connections.
    Backpressure: none needed; each connection is one bounded request.
    """
    render = _renderer(registry)
    await serve_endpoint(
        listeners, render, prometheus_client.CONTENT_TYPE_LATEST, task_status=task_status
    )


def _renderer(registry: CollectorRegistry) -> Callable[[], Awaitable[bytes]]:
    async def render() -> bytes:
        await trio.lowlevel.checkpoint()
        return bytes(prometheus_client.generate_latest(registry))

    return render
