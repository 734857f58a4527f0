"""The hand-off channel: direct hand-over only to a receiver waiting empty, order kept."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from epd_actors.handoff import HandoffReceiver, HandoffSender, open_handoff

if TYPE_CHECKING:
    from collections.abc import Callable

CAPACITY = 2


# -- example tests


async def test_without_a_taker_it_is_a_bounded_channel() -> None:
    send, receive = open_handoff[int](2)
    send.send_nowait(1)
    assert send.offer(2)
    assert not send.offer(3)
    with pytest.raises(trio.WouldBlock):
        send.send_nowait(3)
    assert receive.queued == 2
    assert [receive.receive_nowait(), await receive.receive()] == [1, 2]
    send.close()
    with pytest.raises(trio.EndOfChannel):
        await receive.receive()


async def test_a_waiting_receiver_s_taker_takes_items_in_the_sending_task() -> None:
    send, receive = open_handoff[int](2)
    taken: list[int] = []

    def take(item: int) -> bool:
        taken.append(item)
        return True

    receive.attach(take)
    got: list[int] = []

    async def receiver() -> None:
        async for item in receive:
            got.append(item)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(1)
        await send.send(2)
        assert taken == [1, 2]
        assert receive.queued == 0
        send.close()
    assert got == []


async def test_after_a_refusal_items_queue_until_the_receiver_caught_up() -> None:
    send, receive = open_handoff[int](4)
    answers = [False, True]
    calls: list[int] = []

    def take(item: int) -> bool:
        calls.append(item)
        return answers.pop(0) if answers else True

    receive.attach(take)
    got: list[int] = []
    async with trio.open_nursery() as nursery:

        async def receiver() -> None:
            got.append(await receive.receive())
            got.append(await receive.receive())
            got.append(await receive.receive())

        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(1)  # refused: queued, and so is the next
        send.send_nowait(2)
        assert calls == [1]
        await trio.testing.wait_all_tasks_blocked()
        assert got == [1, 2]
        send.send_nowait(3)  # caught up and waiting again: taken directly
        assert calls == [1, 3]
        assert got == [1, 2]
        nursery.cancel_scope.cancel()


async def test_a_queued_item_skips_the_taker_and_what_follows_queues_behind_it() -> None:
    send, receive = open_handoff[int](4)
    calls: list[int] = []
    receive.attach(lambda item: calls.append(item) is None)  # takes everything offered
    got: list[int] = []
    async with trio.open_nursery() as nursery:

        async def receiver() -> None:
            got.append(await receive.receive())
            got.append(await receive.receive())

        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        send.send_nowait(1)  # waiting empty: taken directly
        send.queue_nowait(2)  # never offered
        send.send_nowait(3)  # must not overtake 2
        assert calls == [1]
        await trio.testing.wait_all_tasks_blocked()
        assert got == [2, 3]
    for n in range(4):
        send.queue_nowait(n)  # without a receiver: bounded like any send
    with pytest.raises(trio.WouldBlock):
        send.queue_nowait(4)


async def test_a_receiver_with_items_queued_takes_them_before_the_taker_runs() -> None:
    send, receive = open_handoff[int](4)
    calls: list[int] = []
    receive.attach(lambda item: calls.append(item) is None)
    send.send_nowait(1)
    assert await receive.receive() == 1  # queued first: not direct
    assert calls == []


async def test_a_closed_receiver_breaks_the_sender_and_detaches_the_taker() -> None:
    send, receive = open_handoff[int](1)
    calls: list[int] = []
    receive.attach(lambda item: calls.append(item) is None)
    receive.close()
    with pytest.raises(trio.BrokenResourceError):
        send.send_nowait(1)
    with pytest.raises(trio.BrokenResourceError):
        await send.send(1)
    assert calls == []


async def test_a_cancelled_direct_send_hands_nothing_over() -> None:
    send, receive = open_handoff[int](1)
    calls: list[int] = []
    receive.attach(lambda item: calls.append(item) is None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive.receive)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await send.send(1)
        assert calls == []
        nursery.cancel_scope.cancel()


async def test_a_cancelled_receive_stops_direct_hand_over() -> None:
    send, receive = open_handoff[int](1)
    calls: list[int] = []
    receive.attach(lambda item: calls.append(item) is None)
    with trio.move_on_after(1):
        await receive.receive()
    send.send_nowait(1)
    assert calls == []
    assert receive.queued == 1


async def test_sender_close_ends_the_receiver_after_the_queue() -> None:
    send, receive = open_handoff[int](2)
    async with send:
        send.send_nowait(1)
    with receive:
        assert [item async for item in receive] == [1]
    with pytest.raises(trio.ClosedResourceError):
        send.send_nowait(2)


# -- the state machine


class _TrioThread:
    """A Trio run in a thread, so that rules can act on one Trio program step by step."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self.nursery: trio.Nursery | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    def call(self, fn: Callable[..., Any], *args: object) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def settle(self) -> None:
        """Return once every task of the run is blocked."""
        trio.from_thread.run(trio.testing.wait_all_tasks_blocked, trio_token=self.token)

    def start(self, fn: Callable[..., Any], *args: object) -> None:
        assert self.nursery is not None
        self.call(self.nursery.start_soon, fn, *args)
        self.settle()

    def stop(self) -> None:
        assert self.nursery is not None
        self.call(self.nursery.cancel_scope.cancel)
        self._thread.join()


class HandoffMachine(RuleBasedStateMachine):
    """One sender, one receiver, a taker that accepts or refuses; cancellations."""

    def __init__(self) -> None:
        super().__init__()
        self.trio = _TrioThread()
        self.send: HandoffSender[int]
        self.receive: HandoffReceiver[int]
        self.send, self.receive = open_handoff(CAPACITY)
        self.accept = True
        self.refusals = 0  # refuse this many, then answer ``accept``
        self.sent: list[int] = []  # handed over or queued, in order
        self.delivered: list[int] = []  # taken by the taker or received, in order
        self.next_item = 0
        self.receiving: trio.CancelScope | None = None  # a receive is in progress
        self.in_receive = False  # ...and parked in it
        self.sending: trio.CancelScope | None = None  # a blocking send is in progress
        self.sending_item = -1
        self.sender_closed = False
        self.receiver_closed = False
        self.ended = False

    def teardown(self) -> None:
        self.trio.stop()

    # the taker

    def _take(self, item: int) -> bool:
        assert self.in_receive, "taker called while the receiver was not waiting"
        assert self.receive.queued == 0, "taker called with items queued"
        if self.refusals:
            self.refusals -= 1
            return False
        if self.accept:
            self.delivered.append(item)
        return self.accept

    @rule(count=st.integers(1, 2))
    def refuse_next(self, count: int) -> None:
        self.refusals = count

    @rule(accept=st.booleans())
    def set_accept(self, accept: bool) -> None:
        self.accept = accept

    @rule(attached=st.booleans())
    def attach(self, attached: bool) -> None:
        self.trio.call(self.receive.attach, self._take if attached else None)

    # the sender

    def _item(self) -> int:
        self.next_item += 1
        return self.next_item

    @precondition(lambda self: self.sending is None and not self.sender_closed)
    @rule()
    def send_nowait(self) -> None:
        self.trio.call(self._send_some, 1)
        self.trio.settle()

    def _send_some(self, count: int) -> None:
        for _ in range(count):
            item = self._item()
            try:
                self.send.send_nowait(item)
            except trio.WouldBlock:
                assert self.receive.queued == CAPACITY
                return
            except trio.BrokenResourceError:
                assert self.receiver_closed
                return
            self.sent.append(item)

    @precondition(lambda self: self.sending is None and not self.sender_closed)
    @rule(count=st.integers(1, 4))
    def send_burst(self, count: int) -> None:
        """Several items in one go, the receiver not running in between."""
        self.trio.call(self._send_some, count)
        self.trio.settle()

    @precondition(
        lambda self: (
            self.sending is None
            and self.receiving is None
            and not (self.sender_closed or self.receiver_closed)
        )
    )
    @rule(count=st.integers(1, 4))
    def race(self, count: int) -> None:
        """A receiver reading in a loop while the sender sends with checkpoints between."""
        scope = self.receiving = trio.CancelScope()

        async def receiver() -> None:
            try:
                with scope:
                    while True:
                        self.in_receive = True
                        try:
                            item = await self.receive.receive()
                        except trio.EndOfChannel:
                            self.ended = True
                            return
                        finally:
                            self.in_receive = False
                        self.delivered.append(item)
            finally:
                self.receiving = None

        async def sender() -> None:
            for _ in range(count):
                self._send_some(1)
                await trio.lowlevel.checkpoint()

        async def both() -> None:
            assert self.trio.nursery is not None
            self.trio.nursery.start_soon(receiver)
            self.trio.nursery.start_soon(sender)

        trio.from_thread.run(both, trio_token=self.trio.token)
        self.trio.settle()

    @precondition(lambda self: self.sending is None and not self.sender_closed)
    @rule()
    def start_send(self) -> None:
        item = self.sending_item = self._item()
        self.sent.append(item)  # taken back if the send is cancelled or fails
        scope = self.sending = trio.CancelScope()

        async def go() -> None:
            try:
                with scope:
                    await self.send.send(item)
                    return
                self.sent.remove(item)  # cancelled: neither handed over nor queued
            except trio.BrokenResourceError:
                assert self.receiver_closed
                self.sent.remove(item)
            finally:
                self.sending = None

        self.trio.start(go)

    @precondition(lambda self: self.sending is not None)
    @rule()
    def cancel_send(self) -> None:
        assert self.sending is not None
        self.trio.call(self.sending.cancel)
        self.trio.settle()

    @precondition(lambda self: self.sending is None and not self.sender_closed)
    @rule()
    def close_sender(self) -> None:
        self.sender_closed = True
        self.trio.call(self.send.close)
        self.trio.settle()

    # the receiver

    @precondition(lambda self: self.receiving is None and not self.receiver_closed)
    @rule()
    def start_receive(self) -> None:
        scope = self.receiving = trio.CancelScope()

        async def go() -> None:
            try:
                with scope:
                    self.in_receive = True
                    try:
                        item = await self.receive.receive()
                    except trio.EndOfChannel:
                        self.ended = True
                        return
                    finally:
                        self.in_receive = False
                    self.delivered.append(item)
            finally:
                self.receiving = None

        self.trio.start(go)

    @precondition(lambda self: self.receiving is None and not self.receiver_closed)
    @rule()
    def receive_nowait(self) -> None:
        def go() -> None:
            try:
                self.delivered.append(self.receive.receive_nowait())
            except trio.WouldBlock:
                assert self.receive.queued == 0
            except trio.EndOfChannel:
                self.ended = True

        self.trio.call(go)
        self.trio.settle()

    @precondition(lambda self: self.receiving is not None)
    @rule()
    def cancel_receive(self) -> None:
        assert self.receiving is not None
        self.trio.call(self.receiving.cancel)
        self.trio.settle()

    @precondition(lambda self: self.receiving is None and not self.receiver_closed)
    @rule()
    def close_receiver(self) -> None:
        self.receiver_closed = True
        self.trio.call(self.receive.close)
        self.trio.settle()

    # invariants

    @invariant()
    def order_holds(self) -> None:
        assert self.delivered == self.sent[: len(self.delivered)]

    @invariant()
    def bounded(self) -> None:
        assert self.receive.queued <= CAPACITY

    @invariant()
    def nothing_lost(self) -> None:
        if self.receiver_closed:
            return
        pending = 1 if self.sending is not None else 0
        assert self.receive.queued == len(self.sent) - len(self.delivered) - pending
        if self.receiving is not None:
            assert self.receive.queued == 0  # a parked receiver has nothing queued

    @invariant()
    def ends_only_when_drained(self) -> None:
        if self.ended:
            assert self.sender_closed
            assert self.delivered == self.sent


HandoffMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestHandoffMachine = HandoffMachine.TestCase
