"""TLS on the router's listeners: the server context and the listener wrapping.

``serve --ssl-certfile/--ssl-keyfile`` (vLLM's spelling) or ``[server]
ssl_certfile/ssl_keyfile`` turn TLS on for every listener of the router: the
HTTP port (and the WebSocket upgrades on it) and the separate WebSocket
listener.  Each accepted connection becomes a ``trio.SSLStream``; its
handshake runs on the first read, so it is bounded by the front end's first
timeout (the HTTP keep-alive timeout, the WebSocket handshake timeout), and a
client that fails it ends only its own connection.
"""

from __future__ import annotations

import ssl
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ..errors import ConfigError

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from .config_file import ServerConfig


def server_ssl_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A server context for ``certfile`` (PEM chain) and ``keyfile`` (None: in ``certfile``).

    TLS 1.2 or newer, the ``ssl`` module's default ciphers, ALPN ``http/1.1``.

    Raises:
        ConfigError: a file that cannot be read, or a key that does not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(certfile, keyfile)
    except FileNotFoundError as exc:
        raise ConfigError(f"ssl: no such file: {exc.filename}") from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"ssl: cannot load {certfile} / {keyfile or certfile}: {exc}") from None
    return context


def tls_listeners(
    listeners: Sequence[trio.abc.Listener[trio.SocketStream]], context: ssl.SSLContext | None
) -> list[trio.abc.Listener[trio.abc.Stream]]:
    """``listeners`` wrapped in ``trio.SSLListener`` (unchanged when ``context`` is None).

    ``https_compatible``: a client may close without TLS's close_notify, as
    HTTPS clients do, without that being an error.
    """
    if context is None:
        return list(listeners)
    return [trio.SSLListener(item, context, https_compatible=True) for item in listeners]


def tls_overrides(server: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    """``server`` with ``serve --ssl-certfile/--ssl-keyfile`` applied (each overrides the file).

    Raises:
        ConfigError: a key file without a certificate.
    """
    certfile = args.ssl_certfile or server.ssl_certfile
    keyfile = args.ssl_keyfile or (server.ssl_keyfile if not args.ssl_certfile else None)
    if keyfile is not None and certfile is None:
        raise ConfigError("--ssl-keyfile: needs --ssl-certfile too")
    return replace(server, ssl_certfile=certfile, ssl_keyfile=keyfile)
