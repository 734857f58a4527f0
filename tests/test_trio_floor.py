"""benchmarks/trio_floor.py passes a chunked stream on whole, however its reads split it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

if TYPE_CHECKING:
    from types import ModuleType

pytestmark = pytest.mark.trio

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trio_floor.py"
EVENTS = [b'data: {"n": %d}\n\n' % n for n in range(3)] + [b"data: [DONE]\n\n"]
BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
NEXT = b"HTTP/1.1 200 OK\r\n"  # what follows the body on a kept-alive connection


def floor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trio_floor", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("trio_floor", module)
    spec.loader.exec_module(module)
    return module


async def relay_split_at(cut: int, *, hub: bool = False) -> tuple[bytes, bytes]:
    """Relay ``BODY`` (then ``NEXT``) sent in two writes cut at ``cut``; what the client got
    (``hub``: the body after its first read read by the floor's read hub, ``--hub``)."""
    module = floor()
    worker_a, worker_b = trio.socket.socketpair()
    client_a, client_b = trio.socket.socketpair()
    worker, source = trio.SocketStream(worker_a), trio.SocketStream(worker_b)
    client, reader = trio.SocketStream(client_a), trio.SocketStream(client_b)
    got = bytearray()
    source_reader = module.Reader(source)
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            await worker.send_all(BODY[:cut])
            await trio.sleep(0.001)  # a second read on the relay's side
            await worker.send_all(BODY[cut:] + NEXT)

        nursery.start_soon(send)
        if hub:
            read_hub = module.ReadHub()
            nursery.start_soon(read_hub.run)
            # The first read, as the request's task makes it before handing the body over.
            source_reader.buffer += await source.receive_some(4096)
            await read_hub.relay(source_reader, client, b"HEAD\r\n")
            assert not read_hub.streams  # handed back
        else:
            await module.relay_chunked(source_reader, client, b"HEAD\r\n")
        await client.aclose()
        while data := await reader.receive_some(4096):
            got += data
        nursery.cancel_scope.cancel()  # the hub's task
    for stream in (worker, source, reader):
        await stream.aclose()
    return bytes(got), bytes(source_reader.buffer)


@pytest.mark.parametrize("hub", [False, True], ids=["task", "hub"])
@pytest.mark.parametrize("cut", range(1, len(BODY)))
async def test_the_floor_relays_the_whole_body_and_keeps_what_follows(cut: int, hub: bool) -> None:
    got, left = await relay_split_at(cut, hub=hub)
    assert got == b"HEAD\r\n" + BODY
    assert NEXT.startswith(left)  # the next response's bytes stay with the connection
