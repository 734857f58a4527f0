"""One router process under ``serve --processes N``: the child's side.

Theory of operation: the parent (:mod:`epd_actors.program.processes`) starts each
child as an ordinary ``python -m epd_actors serve --config FILE`` with the
environment variable :data:`CHILD_ENV` set to a small JSON object, a
:class:`ChildSpec`: the child's index and the addresses
(port 0 already resolved by the parent) of the HTTP and WebSocket listeners.
``serve`` reads its configuration and checks it exactly as a single router
does, then :func:`serve_child` opens the router and binds its own listening
sockets on those addresses with ``SO_REUSEPORT`` (the parent holds a bound,
non-listening socket on each, so the port stays reserved while children come
and go), plus one private HTTP listener on ``127.0.0.1`` (port 0) that serves
the same routes, so that this one process can be reached on purpose
(``/metrics``, ``/health``, ``/admin``).

Once every listener accepts, the child writes one line on its stdout:
``READY_MARKER {"index": I, "pid": P, "private_http": "127.0.0.1:PORT"}``; the
parent waits for it.  A child that cannot start writes its error on stderr (as
``serve`` does) and exits non-zero before that line.

The child never outlives the parent: it watches its stdin, a pipe whose other
end only the parent holds (the kernel closes it when the parent exits, however
it dies): end of file means the parent is gone, and the child drains as on
SIGTERM (bounded by ``drain_timeout_s``) and exits.  ``prctl(PR_SET_PDEATHSIG)``
is not used: Linux sends that signal when the *thread* that forked the child
exits, and Trio starts processes from its worker threads, which exit after a
few idle seconds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..errors import ConfigError
from .serve import serve_router

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    from .config_file import FileConfig

logger = logging.getLogger(__name__)

CHILD_ENV = "EPD_ROUTER_PROCESS"
READY_MARKER = "epd_actors-router-process-ready"
PRIVATE_HOST = "127.0.0.1"
# The kernel caps it at net.core.somaxconn, as for trio.open_tcp_listeners.
LISTEN_BACKLOG = 65535


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """What the parent tells one router process (JSON in :data:`CHILD_ENV`).

    Attributes:
        index: the process's number, 0 to N-1 (stable across restarts).
        http: ``(host, port)`` of each HTTP listening socket to bind.
        ws: ``(host, port)`` of each WebSocket listening socket to bind.
    """

    index: int
    http: tuple[tuple[str, int], ...]
    ws: tuple[tuple[str, int], ...] = ()

    def to_env(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "http": [list(a) for a in self.http],
                "ws": [list(a) for a in self.ws],
            }
        )

    @classmethod
    def from_env(cls, text: str) -> ChildSpec:
        """Parse :meth:`to_env`'s text.

        Raises:
            ConfigError: not a spec this version writes.
        """
        try:
            data = json.loads(text)
            return cls(
                index=int(data["index"]),
                http=tuple((str(h), int(p)) for h, p in data["http"]),
                ws=tuple((str(h), int(p)) for h, p in data["ws"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{CHILD_ENV}: not a router process spec: {exc!r}") from None


def child_spec(environ: Mapping[str, str] | None = None) -> ChildSpec | None:
    """The spec of this process when a parent started it as a router process, else None."""
    text = (os.environ if environ is None else environ).get(CHILD_ENV)
    return None if text is None else ChildSpec.from_env(text)


async def watch_parent(stop: trio.Event, stream: trio.abc.ReceiveStream) -> None:
    """Set ``stop`` when ``stream`` (the child's stdin) ends: the parent is gone.

    Anything the parent writes is ignored; only the end of the pipe counts.
    Cancellation: returns when cancelled.
    """
    try:
        while await stream.receive_some(512):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    if not stop.is_set():
        logger.warning("router process: the parent process is gone; draining and exiting")
    stop.set()


def reuse_port_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (listening unless told not).

    Every process that binds the same address this way (same user) gets its
    own accept queue, and the kernel spreads new connections over the
    listening ones by a hash of the connection's addresses.

    Raises:
        OSError: the address cannot be bound, or the platform has no
            ``SO_REUSEPORT``.
    """
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    if reuse_port is None:
        raise OSError("this platform has no SO_REUSEPORT, which --processes needs")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        if listen:
            sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def private_socket() -> socket.socket:
    """A listening socket on ``127.0.0.1``, any free port, for this process alone."""
    return socket.create_server((PRIVATE_HOST, 0))


async def serve_child(config: FileConfig, spec: ChildSpec) -> None:
    """Serve as router process ``spec.index`` until SIGTERM/SIGINT or the parent's end.

    Cancellation: cancelling skips the drain, as for :func:`serve_router`.
    """
    stop = trio.Event()
    http_sockets = [reuse_port_socket(host, port) for host, port in spec.http]
    private = private_socket()
    ws_sockets = [reuse_port_socket(host, port) for host, port in spec.ws] or None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as watchers:
            watchers.start_soon(watch_parent, stop, trio.lowlevel.FdStream(os.dup(0)))
            watchers.start_soon(_stop_on_signal, stop, signals)
            async with trio.open_nursery() as serving:
                await serving.start(
                    partial(
                        serve_router,
                        config,
                        stop=stop,
                        http_sockets=[*http_sockets, private],
                        ws_sockets=ws_sockets,
                    )
                )
                ready = {
                    "index": spec.index,
                    "pid": os.getpid(),
                    "private_http": "{}:{}".format(*private.getsockname()[:2]),
                }
                print(f"{READY_MARKER} {json.dumps(ready)}", flush=True)
            # serve_router has drained and returned: the watchers are done too.
            watchers.cancel_scope.cancel(reason="router process stopped")
    logger.info("router process %d stopped", spec.index)


async def _stop_on_signal(stop: trio.Event, signals: AsyncIterator[int]) -> None:
    async for _ in signals:
        stop.set()
        return
