"""Run a router with its front ends, and stop it gracefully.

Theory of operation: :func:`serve_router` opens the router, starts the HTTP
server (and the WebSocket server when configured) with their connection tasks
in a nursery of their own, reports the bound addresses, and serves until
``stop`` is set (the CLI sets it on SIGTERM or SIGINT).  Then the shutdown
ladder runs:

0. give notice: ``/health`` and ``/readyz`` answer 503 ``draining`` at once,
   and for ``drain_notice_s`` (0 by default) the router keeps accepting and
   serving, so that load balancers polling them move traffic away first;
1. stop accepting: the listeners close, new connections are refused;
2. let in-flight requests finish, up to ``drain_timeout_s``;
3. end what is left with ``StageTimeout(phase="drain")``: each client gets a
   final error (an SSE error event, or a 504), each worker an abort; wait up to
   ``deadlines.cleanup_timeout_s`` for those answers to be written;
4. cancel the connections still open, and close the worker connections as the
   router exits.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import trio

from ..core.router import BackendFactory, Router, open_router
from ..discovery import open_discovery
from ..frontends.admin import RouterAdmin
from ..frontends.http import serve_http
from ..frontends.http_app import RouterHttpApp
from ..frontends.media_fetch import open_allowed_fetcher
from ..frontends.ws import WsServer, serve_ws
from ..frontends.ws_metrics import WsCollector
from ..limits import ACCEPT_BURST
from .config_file import FileConfig, parse_host_port
from .tls import server_ssl_context, tls_listeners

if TYPE_CHECKING:
    import ssl
    from collections.abc import Sequence

logger = logging.getLogger(__name__)

# accept() failures that say "no room now" (trio's serve_listeners logs and
# waits on them); the burst stops and the next real accept meets them.
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class BurstListener(trio.abc.Listener[trio.SocketStream]):
    """A TCP listener that takes every waiting connection, up to ``burst``, per wake-up.

    ``trio.SocketListener.accept`` yields to the scheduler after each
    connection, so an accept loop takes at most one connection per scheduling
    round.  With thousands of streams open a round lasts long enough that the
    kernel's backlog fills and new clients wait out SYN retries (seen at about
    4,000 open streams on two cores).  This listener does one ordinary accept
    (which waits, and checkpoints, as usual), then takes up to ``burst - 1``
    more connections already waiting without blocking, and returns those from
    the following calls at once.

    Args:
        listener: the listener to wrap (it is closed with this one).
        burst: the most connections taken per wake-up.

    Resource handling: ``aclose`` closes the listener and any connection taken
    but not yet handed out.
    """

    def __init__(self, listener: trio.SocketListener, *, burst: int = ACCEPT_BURST) -> None:
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.listener = listener
        self.socket = listener.socket
        self.burst = burst
        # A second handle on the same listening socket, for non-blocking accepts
        # (the descriptor is a duplicate: closing either leaves the other usable).
        self._raw = socket.socket(fileno=os.dup(listener.socket.fileno()))
        self._raw.setblocking(False)
        self._ready: deque[trio.SocketStream] = deque()

    @property
    def queued(self) -> int:
        """Connections taken from the kernel and not yet handed out."""
        return len(self._ready)

    async def accept(self) -> trio.SocketStream:
        """The next connection: one already taken (no checkpoint), else wait for one.

        Raises:
            trio.ClosedResourceError: the listener was closed.
            OSError: as ``trio.SocketListener.accept``.
        """
        if self._ready:
            return self._ready.popleft()
        stream = await self.listener.accept()
        self._take_waiting()
        return stream

    def _take_waiting(self) -> None:
        for _ in range(self.burst - 1):
            try:
                conn, _address = self._raw.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _CAPACITY_ERRNOS:
                    return
                continue  # e.g. ECONNABORTED: that client gave up; try the next
            self._ready.append(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))

    async def aclose(self) -> None:
        ready, self._ready = self._ready, deque()
        for stream in ready:
            await trio.aclose_forcefully(stream)
        self._raw.close()
        await self.listener.aclose()


@dataclass(frozen=True, slots=True)
class ServingAddresses:
    """Where the front ends listen once bound (port 0 resolved)."""

    http: tuple[str, int]
    ws: tuple[str, int] | None
    tls: bool = False

    @property
    def http_url(self) -> str:
        host, port = self.http
        return f"{'https' if self.tls else 'http'}://{_url_host(host)}:{port}"

    @property
    def ws_url(self) -> str | None:
        if self.ws is None:
            return None
        host, port = self.ws
        return f"{'wss' if self.tls else 'ws'}://{_url_host(host)}:{port}/v1/ws"


def _listener(sock: socket.socket) -> trio.SocketListener:
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


async def _ws_listeners(
    host: str | None,
    port: int,
    sockets: Sequence[socket.socket] | None,
    tls: ssl.SSLContext | None,
) -> list[trio.SocketListener]:
    if sockets is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    else:
        listeners = [_listener(sock) for sock in sockets]
    # serve_ws only accepts from its listeners (trio.serve_listeners) and reads their sockets.
    return cast("list[trio.SocketListener]", tls_listeners(listeners, tls))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve_router(
    config: FileConfig,
    *,
    stop: trio.Event,
    backend_factory: BackendFactory | None = None,
    http_sockets: Sequence[socket.socket] | None = None,
    ws_sockets: Sequence[socket.socket] | None = None,
    task_status: trio.TaskStatus[tuple[ServingAddresses, Router]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``stop`` is set, then drain (see the module docstring).

    Reports ``(addresses, router)`` once every listener accepts.  With
    ``http_sockets`` (``ws_sockets``) the front end accepts on those listening
    sockets, already bound (by a parent process, see :mod:`epd_actors.processes`),
    instead of binding ``server.http_listen`` (``server.ws_listen``); the
    reported address is the first socket's.

    Cancellation: cancelling skips the graceful steps: every request is
    cancelled at once (workers are still told to abort, shielded and bounded).
    """
    server = config.server
    tls = None
    if server.ssl_certfile is not None:
        tls = server_ssl_context(server.ssl_certfile, server.ssl_keyfile)
    async with (
        open_router(config.router, backend_factory=backend_factory) as router,
        open_discovery(router, config.discovery),
    ):
        app = RouterHttpApp(router)
        app.admin = RouterAdmin(router)
        async with (
            open_allowed_fetcher(server.ws.media) as ws_fetcher,
            trio.open_nursery() as connections,
        ):
            # WebSocket upgrades on the HTTP port (the separate listener is an option too).
            upgrades = (
                WsServer(router, server.ws, fetcher=ws_fetcher) if server.ws_on_http else None
            )
            ws_servers: list[WsServer] = [] if upgrades is None else [upgrades]
            ws_collector = WsCollector(ws_servers)
            router.metrics.registry.register(ws_collector)
            async with trio.open_nursery() as acceptors:
                host, port = parse_host_port(server.http_listen, key="server.http_listen")
                if http_sockets is None:
                    listeners = await trio.open_tcp_listeners(port, host=host)
                else:
                    listeners = [_listener(sock) for sock in http_sockets]
                # serve_http only accepts from its listeners (trio.serve_listeners).
                bursting = tls_listeners([BurstListener(item) for item in listeners], tls)
                await acceptors.start(
                    partial(
                        serve_http,
                        app,
                        cast("list[trio.SocketListener]", bursting),
                        settings=server.http,
                        handler_nursery=connections,
                        websocket=upgrades,
                    )
                )
                http_address = (host, listeners[0].socket.getsockname()[1])
                ws_address = None
                # As over HTTP, a request must name a model the router serves:
                # the router resolves it (models and adapters come and go with
                # workers), unless the configuration names the accepted ones.
                ws_settings = server.ws
                if server.ws_listen is not None:
                    ws_host, ws_port = parse_host_port(server.ws_listen, key="server.ws_listen")
                    ws_server: WsServer = await acceptors.start(
                        partial(
                            serve_ws,
                            router,
                            ws_host,
                            ws_port,
                            settings=ws_settings,
                            handler_nursery=connections,
                            listeners=await _ws_listeners(ws_host, ws_port, ws_sockets, tls),
                        )
                    )
                    ws_address = (ws_host, ws_server.port)
                    ws_servers.append(ws_server)
                addresses = ServingAddresses(http_address, ws_address, tls=tls is not None)
                task_status.started((addresses, router))
                await stop.wait()
                app.draining = True
                if server.drain_notice_s > 0:
                    logger.info(
                        "stopping: /health answers draining for %.1fs before the listeners close",
                        server.drain_notice_s,
                    )
                    await trio.sleep(server.drain_notice_s)
                logger.info("stopping: no new connections; draining in-flight requests")
                acceptors.cancel_scope.cancel(reason="router stopping")
            with trio.move_on_after(server.drain_timeout_s) as drain:
                await router.supervisor.wait_idle()
            if drain.cancelled_caught:
                logger.warning(
                    "drain deadline of %.1fs passed with %d requests in flight; ending them",
                    server.drain_timeout_s,
                    router.supervisor.requests_in_flight,
                )
                # Each request ends with a typed error its client sees (an SSE
                # error event, a 504), its workers abort; bounded, then cut.
                router.supervisor.expire_requests(
                    f"the router stopped and its drain deadline of {server.drain_timeout_s:g}s "
                    "passed"
                )
                with trio.move_on_after(router.config.deadlines.cleanup_timeout_s):
                    await router.supervisor.wait_idle()
            connections.cancel_scope.cancel(reason="router stopped")
