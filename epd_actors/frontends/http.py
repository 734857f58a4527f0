"""The OpenAI-compatible HTTP/1.1 + SSE front end: h11 over Trio.

Theory of operation
-------------------
:func:`serve_http` accepts connections with ``trio.serve_listeners`` and gives
each to :meth:`HttpServer.handle_connection`: the package's HTTP server shell
(:class:`epd_actors.http.server.HttpServer`: the connection loop, its reader
task, limits, keep-alive, linger, the per-connection error boundary) serves
it, with one :class:`~.http_connection.HttpConnection` per connection as its
exchanges (routes, auth, CORS, completions, streaming; its docstring walks
through one request).  This server holds what connections share: the app,
the settings (as the shell's limits), the API keys (compared in constant
time), the media fetcher, and the shell (beyond ``max_connections`` a
connection gets a 503 and is closed).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``, and ``/admin/*`` when
the app has an admin hook and admin keys are set; with a WebSocket server
given, ``GET /v1/ws`` with ``Upgrade: websocket`` becomes a WebSocket
connection (:mod:`.ws_upgrade`), so one port serves both.  ``/v1/*`` needs an API key
when any is configured; ``/health`` and ``/metrics`` are open (as in vLLM).
Errors map to HTTP in :mod:`epd_actors.openai.errors`; settings and the app protocol live
in :mod:`.http_app`; docs/http.md is the narrative.

Why h11 and not an ASGI server: the front end is on the hot path.  On this
class of machine a Hypercorn + Starlette stack on Trio served ~1.8k small
requests/s, a thin h11 loop on Trio ~9k.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Final, NoReturn

import trio

from ..http.server import HttpResponse, ServerLimits
from ..http.server import HttpServer as ServerShell
from ..logs import enable_access_log
from ..openai.errors import ErrorResponse, HttpError, error_response
from ..openai.format import error_body
from .http_app import HttpApp, HttpSettings, RouterHttpApp
from .http_connection import ROUTES, HttpConnection
from .media_fetch import open_allowed_fetcher

if TYPE_CHECKING:
    from ..http.server_connection import ServerConnection
    from .media_fetch import MediaFetcher
    from .ws import WsServer

__all__ = [
    "ROUTES",
    "ErrorResponse",
    "HttpApp",
    "HttpError",
    "HttpServer",
    "HttpSettings",
    "RouterHttpApp",
    "error_response",
    "serve_http",
]

logger = logging.getLogger(__name__)

_BUSY: Final = HttpResponse.json(
    503,
    error_body("too many connections", type="service_unavailable_error", code="busy"),
    headers=(("retry-after", "1"),),
)


async def serve_http(
    app: HttpApp,
    listeners: list[trio.SocketListener],
    *,
    settings: HttpSettings | None = None,
    handler_nursery: trio.Nursery | None = None,
    websocket: WsServer | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the OpenAI HTTP API on ``listeners`` until cancelled.

    Args:
        app: the router (wrap one in :class:`RouterHttpApp`) or a fake.
        listeners: e.g. from ``trio.open_tcp_listeners(8000)``.
        settings: limits, timeouts and keys (default: :class:`HttpSettings`).
        handler_nursery: where connection tasks run (default: an internal one).
        websocket: serves WebSocket upgrades of its path on these listeners
            (None: no upgrades).
        task_status: reports the listeners once they accept.

    Cancellation: cancelling stops accepting and cancels every connection;
    their requests are cancelled and their workers told to abort.
    Backpressure: at most ``settings.max_connections`` connections are
    served; more are answered 503 and closed.
    Resource handling: with media URL prefixes allowed, one shared httpx
    client lives as long as this call.
    """
    settings = settings or HttpSettings()
    async with open_allowed_fetcher(settings.media) as fetcher:
        server = HttpServer(app, settings, fetcher=fetcher, websocket=websocket)
        await server.serve(listeners, handler_nursery=handler_nursery, task_status=task_status)


class HttpServer(ServerShell):
    """Serves HTTP connections for one app; call :meth:`handle_connection` per stream.

    The server shell, configured with the front end's limits, its exchanges
    (:class:`~.http_connection.HttpConnection`, one per connection), its 503
    and the WebSocket hand-off; so :meth:`handle_connection` (the shell's) is
    each connection's error boundary: an unexpected exception (a bug) is logged
    with its traceback and closes that connection only, after a best-effort
    500.  Cancellation: cancels the connection's request (its workers are told
    to abort) and closes the stream forcefully.  Backpressure: one request at a
    time per connection.

    Args:
        app: what requests run against.
        settings: limits, timeouts and keys.
        fetcher: loads allowed media URLs (None: URL media are refused).
        websocket: takes the connections whose request asks for a WebSocket
            on its path (``Upgrade: websocket``); None: no upgrades.
    """

    def __init__(
        self,
        app: HttpApp,
        settings: HttpSettings,
        *,
        fetcher: MediaFetcher | None = None,
        websocket: WsServer | None = None,
    ) -> None:
        self.app = app
        self.websocket = websocket
        self.settings = settings
        self.fetcher = fetcher
        if settings.access_log:
            enable_access_log()
        self._api_keys = tuple(key.encode() for key in settings.api_keys)
        self._admin_keys = tuple(key.encode() for key in settings.admin_keys)
        self._upgrade_path = None if websocket is None else websocket.settings.path
        super().__init__(
            limits=ServerLimits.of(settings),
            exchanges=self._connection_exchanges,
            busy_response=_BUSY,
            on_upgrade=None if websocket is None else websocket.handle_stream,
            name="http",
            log=logger,
        )

    def __repr__(self) -> str:
        return f"<HttpServer connections={self.connections}>"

    def _connection_exchanges(self, conn: ServerConnection) -> HttpConnection:
        return HttpConnection(
            conn,
            app=self.app,
            settings=self.settings,
            authorized=self.authorized,
            fetcher=self.fetcher,
            upgrade_path=self._upgrade_path,
        )

    def authorized(self, header: str, *, admin: bool = False) -> bool:
        """Whether ``Authorization: <header>`` carries an accepted key.

        Every configured key is compared (in constant time), so timing does not
        tell which key, or how much of one, matched.  With no API keys the
        ``/v1`` routes are open; with no admin keys admin is closed.
        """
        keys = self._admin_keys if admin else self._api_keys
        if not keys:
            return not admin
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and scheme.lower() == "bearer"
