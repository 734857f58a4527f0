"""The first SIGINT/SIGTERM drains, the second forces (sans processes: signals from a channel)."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import trio
import trio.testing

from epd_actors.program.signals import stop_on_signals

if TYPE_CHECKING:
    import pytest


async def test_the_first_signal_drains_and_the_second_forces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    send, receive = trio.open_memory_channel[int](4)
    stop = trio.Event()
    forced: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signals, receive, stop, lambda: forced.append("forced"))
        await send.send(signal.SIGTERM)
        await stop.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert forced == []
        await send.send(signal.SIGINT)
    assert forced == ["forced"]
    err = capsys.readouterr().err
    assert "SIGTERM: stopping, draining in-flight requests (send it again" in err
    assert "SIGINT again: stopping at once" in err


async def test_no_signal_no_stop() -> None:
    send, receive = trio.open_memory_channel[int](1)
    stop = trio.Event()
    send.close()  # the watcher ends with its signals (or is cancelled with the router)
    await stop_on_signals(receive, stop, lambda: None)
    assert not stop.is_set()
