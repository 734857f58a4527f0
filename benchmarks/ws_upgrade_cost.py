"""What a WebSocket connection costs on the HTTP port against the separate listener.

One in-process router over a simulated fleet serves both: the HTTP port
(``GET /v1/ws`` with ``Upgrade: websocket`` handed over after h11 read the
head) and the separate WebSocket listener.  For each, ``--connections``
clients connect one after another, each does the handshake and one
``ping``/``pong``, and closes; then one connection runs ``--pings`` pings in a
row.  Reported: wall time per connection and per ping, and the process's CPU
time per connection (``time.process_time``, client and server together, as
both run here).  Optionally with TLS (``--tls``, a certificate from trustme).

    python benchmarks/ws_upgrade_cost.py
    python benchmarks/ws_upgrade_cost.py --connections 500 --pings 2000 --tls
"""

from __future__ import annotations

import argparse
import json
import ssl
import tempfile
import time
from functools import partial
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from epd_actors.program.config_file import FileConfig, ServerConfig
from epd_actors.program.serve import serve_router
from epd_actors.testing import build_sim_fleet

PING = json.dumps({"type": "ping"})


async def connect_many(url: str, count: int, context: ssl.SSLContext | None) -> tuple[float, float]:
    """Seconds of wall and CPU time per connection (handshake, one ping, close)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        async with open_websocket_url(url, ssl_context=context) as ws:
            await ws.send_message(PING)
            await ws.get_message()
    return (time.perf_counter() - wall) / count, (time.process_time() - cpu) / count


async def ping_many(url: str, count: int, context: ssl.SSLContext | None) -> float:
    """Seconds of wall time per ping/pong on one connection."""
    async with open_websocket_url(url, ssl_context=context) as ws:
        wall = time.perf_counter()
        for _ in range(count):
            await ws.send_message(PING)
            await ws.get_message()
        return (time.perf_counter() - wall) / count


async def main(args: argparse.Namespace) -> None:
    certfile = keyfile = None
    context = None
    scheme = "ws"
    if args.tls:
        import trustme

        authority = trustme.CA()
        cert = authority.issue_cert("127.0.0.1")
        directory = Path(tempfile.mkdtemp(prefix="ws-upgrade-"))
        certfile, keyfile = str(directory / "cert.pem"), str(directory / "key.pem")
        cert.private_key_and_cert_chain_pem.write_to_path(certfile)
        cert.private_key_pem.write_to_path(keyfile)
        context = ssl.create_default_context()
        authority.configure_trust(context)
        scheme = "wss"
    fleet = build_sim_fleet({"encode": 1, "prefill": 1, "decode": 1})
    server = ServerConfig("127.0.0.1:0", "127.0.0.1:0", ssl_certfile=certfile, ssl_keyfile=keyfile)
    config = FileConfig(fleet.router_config(), server)
    async with trio.open_nursery() as nursery:
        start = partial(
            serve_router, config, stop=trio.Event(), backend_factory=fleet.backend_factory
        )
        addresses, router = await nursery.start(start)
        await router.wait_ready()
        assert addresses.ws is not None
        urls = {
            "http port": f"{scheme}://127.0.0.1:{addresses.http[1]}/v1/ws",
            "ws listener": f"{scheme}://127.0.0.1:{addresses.ws[1]}/v1/ws",
        }
        for url in urls.values():  # warm both paths first
            await connect_many(url, 5, context)
        print(f"{'path':<12}{'ms/connection':>15}{'CPU ms/conn':>13}{'us/ping':>10}")
        for name, url in urls.items():
            per_connection, cpu = await connect_many(url, args.connections, context)
            per_ping = await ping_many(url, args.pings, context)
            print(
                f"{name:<12}{per_connection * 1e3:>15.3f}{cpu * 1e3:>13.3f}{per_ping * 1e6:>10.1f}"
            )
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--pings", type=int, default=1000)
    parser.add_argument("--tls", action="store_true")
    trio.run(main, parser.parse_args())
