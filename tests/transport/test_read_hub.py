"""One task reading many sockets: handlers in the hub's task, owners parked until handed back."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio
import trio.lowlevel
import trio.testing

from epd_actors.transport.read_hub import ReadHub

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.skipif(not ReadHub.available, reason="the read hub needs epoll")

GUARD_S = 5.0  # real seconds: a hub that never hands an owner back fails instead of hanging


@asynccontextmanager
async def running_hub() -> AsyncIterator[ReadHub]:
    hub = ReadHub()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            yield hub
            nursery.cancel_scope.cancel()


def reader(sock: trio.socket.SocketType, into: list[bytes], until: int) -> Callable[[], bool]:
    """A handler that reads what ``sock`` has and keeps watching until ``until`` reads."""

    def handle() -> bool:
        into.append(os.read(sock.fileno(), 1024))
        return len(into) < until

    return handle


async def test_the_owner_stays_parked_while_its_handler_takes_the_bytes() -> None:
    left, right = trio.socket.socketpair()
    got: list[bytes] = []
    tasks: list[trio.lowlevel.Task] = []

    def handle() -> bool:
        tasks.append(trio.lowlevel.current_task())
        return reader(right, got, 3)()

    with left, right:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            served: list[bool] = []

            async def owner() -> None:
                served.append(await hub.serve(right, handle))

            nursery.start_soon(owner)
            for piece in (b"one", b"two", b"three"):
                await trio.testing.wait_all_tasks_blocked()
                assert not served  # still parked: the handler keeps watching
                await left.send(piece)
            await trio.testing.wait_all_tasks_blocked()
            assert served == [True]
            assert got == [b"one", b"two", b"three"]
            assert hub.watching == 0
    owner_tasks = set(tasks)
    assert len(owner_tasks) == 1
    assert owner_tasks != {trio.lowlevel.current_task()}


async def test_every_readable_socket_is_read_once_in_the_same_pass() -> None:
    pairs = [trio.socket.socketpair() for _ in range(5)]
    got: list[list[bytes]] = [[] for _ in pairs]
    try:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            for (_left, right), into in zip(pairs, got, strict=True):
                nursery.start_soon(hub.serve, right, reader(right, into, 1))
            await trio.testing.wait_all_tasks_blocked()
            passes = hub.passes
            for index, (left, _right) in enumerate(pairs):
                os.write(left.fileno(), b"token %d" % index)  # no checkpoint between them
            await trio.testing.wait_all_tasks_blocked()
            assert hub.passes == passes + 1
            assert got == [[b"token %d" % index] for index in range(5)]
    finally:
        for left, right in pairs:
            left.close()
            right.close()


async def test_a_handler_that_raises_resumes_its_owner_with_the_error_and_the_hub_goes_on() -> None:
    (bad_left, bad_right), (good_left, good_right) = (trio.socket.socketpair() for _ in range(2))

    def fail() -> bool:
        raise ValueError("broken framing")

    got: list[bytes] = []
    with bad_left, bad_right, good_left, good_right:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            nursery.start_soon(hub.serve, good_right, reader(good_right, got, 1))
            await bad_left.send(b"x")
            with pytest.raises(ValueError, match="broken framing"):
                await hub.serve(bad_right, fail)
            await good_left.send(b"still served")
            await trio.testing.wait_all_tasks_blocked()
            assert got == [b"still served"]


async def test_a_cancelled_owner_leaves_the_set_and_its_handler_is_not_called_again() -> None:
    left, right = trio.socket.socketpair()
    calls: list[bytes] = []
    with left, right:
        async with running_hub() as hub:
            with trio.move_on_after(0.05):
                await hub.serve(right, reader(right, calls, 99))
            assert hub.watching == 0
            await left.send(b"after")
            await trio.sleep(0.05)
            assert calls == []
            assert await right.recv(10) == b"after"  # the bytes wait for the owner


async def test_release_resumes_the_owner_at_once() -> None:
    left, right = trio.socket.socketpair()
    with left, right:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            served: list[bool] = []

            async def owner() -> None:
                served.append(await hub.serve(right, reader(right, [], 99)))

            nursery.start_soon(owner)
            await trio.testing.wait_all_tasks_blocked()
            hub.release(right)
            hub.release(right)  # nothing parked any more: no effect
            await trio.testing.wait_all_tasks_blocked()
            assert served == [True]


async def test_a_stopping_hub_hands_its_owners_back_and_serves_nobody_after() -> None:
    left, right = trio.socket.socketpair()
    hub = ReadHub()
    served: list[bool] = []
    with left, right, trio.fail_after(GUARD_S):
        async with trio.open_nursery() as owners:
            hub_scope = trio.CancelScope()

            async def run_hub(task_status: trio.TaskStatus[None]) -> None:
                with hub_scope:
                    await hub.run(task_status=task_status)

            await owners.start(run_hub)

            async def owner() -> None:
                served.append(await hub.serve(right, reader(right, [], 99)))

            owners.start_soon(owner)
            await trio.testing.wait_all_tasks_blocked()
            assert hub.watching == 1
            hub_scope.cancel()
        assert served == [False]
        assert not hub.running
        assert await hub.serve(right, reader(right, [], 1)) is False


async def test_one_owner_per_socket_and_one_run_per_hub() -> None:
    left, right = trio.socket.socketpair()
    with left, right:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            nursery.start_soon(hub.serve, right, reader(right, [], 99))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await hub.serve(right, reader(right, [], 99))
            with pytest.raises(trio.BusyResourceError):
                await hub.run()
            hub.release(right)


async def test_a_closed_socket_is_left_to_its_owner() -> None:
    left, right = trio.socket.socketpair()
    left.close()
    right.close()
    async with running_hub() as hub:
        assert await hub.serve(right, reader(right, [], 1)) is False
        assert hub.watching == 0


async def test_a_socket_that_stays_readable_does_not_starve_other_tasks() -> None:
    """The handler leaves the bytes unread: the set reports the socket every pass."""
    left, right = trio.socket.socketpair()
    calls: list[None] = []

    def peek() -> bool:
        calls.append(None)
        return True

    with left, right:
        async with running_hub() as hub, trio.open_nursery() as nursery:
            await left.send(b"never read")
            nursery.start_soon(hub.serve, right, peek)
            for _ in range(20):
                await trio.lowlevel.checkpoint()  # other tasks still get their turns
            hub.release(right)
            assert len(calls) >= 2
            assert hub.passes >= len(calls)


async def test_a_pass_handles_at_most_max_per_pass_sockets_and_lets_other_tasks_run() -> None:
    pairs = [trio.socket.socketpair() for _ in range(10)]
    order: list[str] = []
    passes: list[int] = []  # the pass each read was in

    def handler(index: int, sock: trio.socket.SocketType) -> Callable[[], bool]:
        def handle() -> bool:
            os.read(sock.fileno(), 1024)
            order.append(f"read {index}")
            passes.append(hub.passes)
            return False  # each owner is done after one read

        return handle

    async def other_task() -> None:
        while len([o for o in order if o.startswith("read")]) < len(pairs):
            order.append("other")
            await trio.lowlevel.checkpoint()

    hub = ReadHub(max_per_pass=4)
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as outer:
                await outer.start(hub.run)
                async with trio.open_nursery() as owners:
                    for index, (_left, right) in enumerate(pairs):
                        owners.start_soon(hub.serve, right, handler(index, right))
                    await trio.testing.wait_all_tasks_blocked()
                    for left, _right in pairs:  # all readable before the hub's next turn
                        os.write(left.fileno(), b"x")
                    owners.start_soon(other_task)
                outer.cancel_scope.cancel()
    finally:
        for left, right in pairs:
            left.close()
            right.close()
    reads = [o for o in order if o.startswith("read")]
    assert sorted(reads) == sorted(f"read {i}" for i in range(10))
    assert hub.passes == 3
    assert sorted(passes.count(n) for n in set(passes)) == [2, 4, 4]
    # The hub let the other task run between its passes (each pass is one scheduler
    # batch; Trio may run the two tasks of a batch in either order).
    runs = "".join("r" if o.startswith("read") else "o" for o in order)
    assert "o" in runs[runs.index("r") : runs.rindex("r")]


def test_max_per_pass_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReadHub(max_per_pass=0)
