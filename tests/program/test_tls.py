"""TLS on the router's listeners: a certificate made in the test, real TLS clients on loopback."""

from __future__ import annotations

import argparse
import json
import ssl
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

import h11
import pytest
import trio
import trustme
from trio_websocket import open_websocket_url

from epd_actors.errors import ConfigError
from epd_actors.program.config_file import FileConfig, ServerConfig, parse_config
from epd_actors.program.processes import child_command
from epd_actors.program.serve import ServingAddresses, serve_router
from epd_actors.program.tls import server_ssl_context, tls_overrides
from epd_actors.testing import build_sim_fleet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

EPD = {"encode": 1, "prefill": 1, "decode": 1}
GUARD_S = 10.0
GENERATE = {
    "type": "generate",
    "id": "g",
    "kind": "completion",
    "request": {"model": "sim-model", "prompt": "hello", "max_tokens": 3},
}


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def files(authority: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, in PEM files."""
    directory = tmp_path_factory.mktemp("tls")
    cert = authority.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(certfile), append=True)
    cert.private_key_pem.write_to_path(str(keyfile))
    return str(certfile), str(keyfile)


@pytest.fixture
def client_context(authority: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    return context


@asynccontextmanager
async def deployed(files: tuple[str, str], **server: object) -> AsyncIterator[ServingAddresses]:
    fleet = build_sim_fleet(EPD)
    certfile, keyfile = files
    settings = ServerConfig(
        "127.0.0.1:0",
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        **server,  # type: ignore[arg-type]
    )
    config = FileConfig(fleet.router_config(), settings)
    async with trio.open_nursery() as nursery:
        start = partial(
            serve_router, config, stop=trio.Event(), backend_factory=fleet.backend_factory
        )
        addresses, router = await nursery.start(start)
        await router.wait_ready()
        yield addresses
        nursery.cancel_scope.cancel(reason="test over")


async def https_get(port: int, path: str, context: ssl.SSLContext) -> tuple[int, bytes]:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1", https_compatible=True)
    async with stream:
        client = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="GET", target=path, headers=[("host", "x"), ("connection", "close")]
        )
        await stream.send_all(client.send(request) + client.send(h11.EndOfMessage()))
        status, body = 0, b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some())
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body


async def generated(url: str, context: ssl.SSLContext) -> list[str]:
    types = []
    async with open_websocket_url(url, ssl_context=context) as ws:
        await ws.send_message(json.dumps(GENERATE))
        while not types or types[-1] not in ("done", "error", "cancelled"):
            types.append(json.loads(await ws.get_message())["type"])
    return types


async def test_https_and_wss_on_the_http_port(
    files: tuple[str, str], client_context: ssl.SSLContext
) -> None:
    with trio.fail_after(GUARD_S):
        async with deployed(files) as addresses:
            port = addresses.http[1]
            status, body = await https_get(port, "/livez", client_context)
            types = await generated(f"wss://127.0.0.1:{port}/v1/ws", client_context)
    assert addresses.http_url == f"https://127.0.0.1:{port}"
    assert (status, json.loads(body)) == (200, {"status": "alive"})
    assert types[-1] == "done"


async def test_wss_on_the_separate_listener(
    files: tuple[str, str], client_context: ssl.SSLContext
) -> None:
    with trio.fail_after(GUARD_S):
        async with deployed(files, ws_listen="127.0.0.1:0") as addresses:
            assert addresses.ws_url is not None
            assert addresses.ws_url.startswith("wss://")
            types = await generated(addresses.ws_url, client_context)
    assert types[-1] == "done"


async def test_a_plain_or_untrusting_client_fails_alone(
    files: tuple[str, str], client_context: ssl.SSLContext
) -> None:
    with trio.fail_after(GUARD_S):
        async with deployed(files) as addresses:
            port = addresses.http[1]
            plain = await trio.open_tcp_stream("127.0.0.1", port)
            async with plain:
                await plain.send_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = await plain.receive_some()
            assert not answer.startswith(b"HTTP/")  # a TLS alert, or nothing
            with pytest.raises(trio.BrokenResourceError):
                await https_get(port, "/livez", ssl.create_default_context())  # unknown CA
            status, _ = await https_get(port, "/livez", client_context)
    assert status == 200


def test_server_context_errors(files: tuple[str, str], tmp_path: Path) -> None:
    certfile, keyfile = files
    assert isinstance(server_ssl_context(certfile, keyfile), ssl.SSLContext)
    with pytest.raises(ConfigError, match="no such file"):
        server_ssl_context(str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="cannot load"):
        server_ssl_context(certfile)  # the key is in the other file
    other = trustme.CA().issue_cert("127.0.0.1")
    stranger = tmp_path / "stranger.pem"
    other.private_key_pem.write_to_path(str(stranger))
    with pytest.raises(ConfigError, match="cannot load"):
        server_ssl_context(certfile, str(stranger))  # a key that does not match


POOLS = {"pools": {"pd": {"workers": [{"id": "pd0", "address": "tcp://127.0.0.1:9000"}]}}}


def test_config_and_command_line() -> None:
    tables = {**POOLS, "server": {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem"}}
    server = parse_config(tables).server
    assert (server.ssl_certfile, server.ssl_keyfile) == ("c.pem", "k.pem")
    with pytest.raises(ConfigError, match=r"server\.ssl_keyfile: needs ssl_certfile"):
        parse_config({**POOLS, "server": {"ssl_keyfile": "k.pem"}})
    args = argparse.Namespace(ssl_certfile=None, ssl_keyfile=None)
    assert tls_overrides(server, args) == server
    args = argparse.Namespace(ssl_certfile="/x/c2.pem", ssl_keyfile=None)
    assert (tls_overrides(server, args).ssl_certfile, tls_overrides(server, args).ssl_keyfile) == (
        "/x/c2.pem",
        None,
    )
    with pytest.raises(ConfigError, match="--ssl-keyfile"):
        tls_overrides(ServerConfig(), argparse.Namespace(ssl_certfile=None, ssl_keyfile="k"))
    command = child_command(
        argparse.Namespace(
            config="epd.toml",
            http_listen=None,
            ws_listen=None,
            access_log=False,
            log_level="INFO",
            log_format="text",
            ssl_certfile="/x/c.pem",
            ssl_keyfile="/x/k.pem",
        )
    )
    assert command[-4:] == ["--ssl-certfile", "/x/c.pem", "--ssl-keyfile", "/x/k.pem"]
