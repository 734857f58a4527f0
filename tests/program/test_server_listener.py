"""The router's HTTP listener takes waiting connections in bursts, and the CLI's fd limit."""

from __future__ import annotations

import contextlib
import resource

import pytest
import trio

from epd_actors.program import cli
from epd_actors.program.serve import BurstListener


async def _listener(burst: int) -> BurstListener:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return BurstListener(listener, burst=burst)


async def test_every_connection_is_handed_out_once_and_works() -> None:
    listener = await _listener(burst=4)
    port = listener.socket.getsockname()[1]
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(7)]
    served = []
    for _ in range(7):
        served.append(await listener.accept())
        assert listener.queued <= 3  # never more than burst - 1 taken ahead
    by_peer = {stream.socket.getpeername(): stream for stream in served}
    assert set(by_peer) == {client.socket.getsockname() for client in clients}
    for index, client in enumerate(clients):
        await by_peer[client.socket.getsockname()].send_all(b"%d" % index)
        assert await client.receive_some(16) == b"%d" % index
    for stream in (*clients, *served):
        await stream.aclose()
    await listener.aclose()


async def test_close_closes_connections_taken_but_not_handed_out() -> None:
    listener = await _listener(burst=8)
    port = listener.socket.getsockname()[1]
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
    first = await listener.accept()
    await listener.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()
    for client in clients:
        if client.socket.getsockname() == first.socket.getpeername():
            continue
        # Taken and closed by aclose, or reset with the listening socket.
        with contextlib.suppress(trio.BrokenResourceError):
            assert await client.receive_some(16) == b""
    await first.aclose()
    for client in clients:
        await client.aclose()


async def test_burst_must_be_positive() -> None:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    with pytest.raises(ValueError, match="burst"):
        BurstListener(listener, burst=0)
    await listener.aclose()


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    state = {"now": (1024, 65536)}

    def getrlimit(which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return state["now"]

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        state["now"] = value

    monkeypatch.setattr(cli.resource, "getrlimit", getrlimit)
    monkeypatch.setattr(cli.resource, "setrlimit", setrlimit)
    return state


def test_soft_open_file_limit_is_raised_to_the_hard_limit(
    limits: dict[str, tuple[int, int]],
) -> None:
    assert cli.raise_open_file_limit() == (65536, 65536)
    assert limits["now"] == (65536, 65536)


def test_open_file_limit_already_at_the_hard_limit_is_left_alone(
    limits: dict[str, tuple[int, int]],
) -> None:
    limits["now"] = (4096, 4096)
    assert cli.raise_open_file_limit() == (4096, 4096)


def test_unlimited_hard_open_file_limit_asks_for_a_bounded_soft_limit(
    limits: dict[str, tuple[int, int]],
) -> None:
    limits["now"] = (1024, resource.RLIM_INFINITY)
    assert cli.raise_open_file_limit() == (cli.UNLIMITED_NOFILE_TARGET, resource.RLIM_INFINITY)


def test_a_refused_raise_leaves_the_limit(
    limits: dict[str, tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(which: int, value: tuple[int, int]) -> None:
        raise OSError("operation not permitted")

    monkeypatch.setattr(cli.resource, "setrlimit", refuse)
    assert cli.raise_open_file_limit() == (1024, 65536)
