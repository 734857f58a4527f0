"""Worker addresses: ``tcp://HOST:PORT`` and ``unix:PATH``, parsed, listened on, dialled."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class Address:
    """Where a native worker listens.

    Attributes:
        scheme: ``tcp`` or ``unix``.
        host: TCP host (IPv6 without brackets); empty for Unix sockets.
        port: TCP port (0 asks the OS for a free one when listening).
        path: Unix socket path; empty for TCP.
    """

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_address(text: str, *, key: str = "address") -> Address:
    """Parse ``tcp://HOST:PORT`` or ``unix:PATH``.

    Raises:
        ConfigError: naming ``key`` and what is wrong.
    """
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError(f"{key}: unix address {text!r} has no path")
        return Address("unix", path=path)
    if not text.startswith("tcp://"):
        raise ConfigError(f"{key}: {text!r} is not tcp://HOST:PORT or unix:PATH")
    rest = text[len("tcp://") :]
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: {text!r} needs HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{key}: port {port_text!r} in {text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} in {text!r} is out of range")
    return Address("tcp", host=host, port=port)


async def open_listeners(address: Address) -> list[trio.SocketListener]:
    """Bind ``address``; a stale Unix socket (and only a socket) at the path is replaced."""
    if address.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(address.path).st_mode):
                os.unlink(address.path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(address.path)
        sock.listen(128)
        return [trio.SocketListener(sock)]
    return await trio.open_tcp_listeners(address.port, host=address.host)


def bound_address(address: Address, listeners: list[trio.SocketListener]) -> Address:
    """The address actually bound (fills in the port chosen for port 0)."""
    if address.scheme == "unix":
        return address
    port = listeners[0].socket.getsockname()[1]
    return Address("tcp", host=address.host, port=port)


async def open_stream(address: Address) -> trio.SocketStream:
    """Connect to a worker.

    Raises:
        OSError: the connection could not be made.
    """
    if address.scheme == "unix":
        return await trio.open_unix_socket(address.path)
    return await trio.open_tcp_stream(address.host, address.port)


def check_http_url(text: str, *, key: str) -> None:
    """Accept ``http(s)://HOST[:PORT][/PREFIX]`` (a vLLM server's base URL).

    Raises:
        ConfigError: naming ``key`` and what is wrong.
    """
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: {text!r} is not an http(s)://HOST:PORT URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{key}: {text!r} must not carry credentials, a query or a fragment")
    try:
        port = parts.port  # urlsplit checks the port only when it is read
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"{key}: {text!r} has an invalid port")
