"""Decoding off the event loop, and applying in pieces: order, gaps, garbage, yields, cuts."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from epd_actors.errors import ConfigError
from epd_actors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVBlockIndex
from epd_actors.kv_events.chunks import event_blocks, split_events
from epd_actors.kv_events.feed import FeedState
from epd_actors.kv_events.subscriber import DISCONNECTED, KVEventSubscriber, ReplayAnswer

from .test_kv_subscriber import FakePublisher, settle, stored

BS = 2


def chain(first: int, count: int, parent: int | None = None) -> BlockStored:
    """Blocks ``first .. first + count - 1`` in one event, block n holding tokens (n, n)."""
    hashes = tuple(range(first, first + count))
    tokens = tuple(t for n in hashes for t in (n, n))
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


def tokens_of(first: int, count: int) -> list[int]:
    return [t for n in range(first, first + count) for t in (n, n)]


# ---------------------------------------------------------------- cutting events


def test_a_cut_block_stored_indexes_the_same_keys_as_the_whole():
    extras = tuple(("img", n) for n in range(10))
    event = BlockStored(
        tuple(range(10)), None, tuple(tokens_of(0, 10)), BS, None, "GPU", "lora", extras
    )
    whole, cut = KVBlockIndex(), KVBlockIndex()
    whole.apply("w", [event])
    pieces = list(split_events([event], 3))
    assert [sum(event_blocks(e) for e in p) for p in pieces] == [3, 3, 3, 1]
    for piece in pieces:
        cut.apply("w", piece)
    assert cut.engine_hashes("w") == whole.engine_hashes("w") == frozenset(range(10))
    assert cut.statistics() == whole.statistics()
    assert pieces[1][0].parent_block_hash == 2
    assert pieces[1][0].extra_keys == extras[3:6]
    assert pieces[1][0].token_ids == tuple(tokens_of(3, 3))


def test_pieces_keep_the_order_and_cut_removals_too():
    events = [chain(0, 4), BlockRemoved((0, 1, 2, 3, 9)), AllBlocksCleared(), chain(20, 2)]
    pieces = list(split_events(events, 2))
    flat = [e for p in pieces for e in p]
    assert all(sum(event_blocks(e) for e in p) <= 2 for p in pieces)
    assert [type(e).__name__ for e in flat] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "BlockRemoved",
        "AllBlocksCleared",
        "BlockStored",
    ]
    assert [h for e in flat if isinstance(e, BlockRemoved) for h in e.block_hashes] == [
        0,
        1,
        2,
        3,
        9,
    ]
    index = KVBlockIndex()
    for piece in pieces:
        index.apply("w", piece)
    assert index.engine_hashes("w") == {20, 21}


def test_small_events_share_a_piece():
    events = [stored(1), stored(2, 1), stored(3, 2)]
    assert list(split_events(events, 64)) == [events]
    assert list(split_events([], 64)) == []


def test_apply_blocks_must_be_positive():
    with pytest.raises(ConfigError, match="apply_blocks"):
        KVEventSubscriber("w", FakePublisher(), KVBlockIndex(), apply_blocks=0)


# ---------------------------------------------------------------- the applier yields


async def test_the_applier_hands_the_loop_back_inside_a_large_batch(nursery):
    index, pub = KVBlockIndex(), FakePublisher()
    sub = KVEventSubscriber("w", pub, index, apply_blocks=2)
    await nursery.start(sub.run)
    seen: set[int] = set()

    async def watch() -> None:
        while index.blocks("w") < 10:
            seen.add(index.blocks("w"))
            await trio.lowlevel.checkpoint()

    nursery.start_soon(watch)
    pub.publish(chain(0, 10))
    await settle()
    assert index.engine_hashes("w") == frozenset(range(10))
    # 5 pieces span 5 scheduler batches and the watcher runs in each of them,
    # so it ran (at least) in one that began with the batch partly applied
    assert seen & {2, 4, 6, 8}
    assert seen <= {0, 2, 4, 6, 8}  # never in the middle of a piece
    assert sub.state is FeedState.EXACT


async def test_a_long_replay_is_applied_in_pieces_too(nursery):
    index, pub = KVBlockIndex(), FakePublisher()
    for n in range(6):
        pub.publish(stored(n, None if n == 0 else n - 1), deliver=False)
    sub = KVEventSubscriber("w", pub, index, apply_blocks=2)
    await nursery.start(sub.run)
    seen: set[int] = set()

    async def watch() -> None:
        while index.blocks("w") < 7:
            seen.add(index.blocks("w"))
            await trio.lowlevel.checkpoint()

    nursery.start_soon(watch)
    pub.publish(stored(6, 5))
    await settle()
    assert pub.replays == [0]
    assert index.match(tokens_of(0, 7)) == {"w": 7}
    assert seen & {2, 4, 6}
    assert seen <= {0, 2, 4, 6}
    assert sub.state is FeedState.EXACT


async def test_cancelling_in_the_middle_of_a_batch_purges_the_worker():
    index, pub = KVBlockIndex(), FakePublisher()
    sub = KVEventSubscriber("w", pub, index, apply_blocks=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)

        async def cancel_when_partly_applied() -> None:
            while index.blocks("w") < 4:
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_when_partly_applied)
        pub.publish(chain(0, 10))
    assert index.blocks("w") == 0
    assert sub.state is FeedState.FALLBACK


async def test_a_restart_during_queued_updates_drops_them(nursery):
    index, pub = KVBlockIndex(), FakePublisher()
    sub = KVEventSubscriber("w", pub, index, apply_blocks=2)
    await nursery.start(sub.run)
    pub.publish(chain(0, 6))
    pub.restart()
    pub.publish(chain(100, 2))  # seq 0 again: purge, then only the new blocks
    await settle()
    assert index.engine_hashes("w") == {100, 101}
    assert sub.statistics().restarts == 1


# ---------------------------------------------------------------- decoding in a thread


class ThreadDecodingSource:
    """FakePublisher's frames, decoded in a worker thread as ZmqEventSource does."""

    def __init__(self, publisher: FakePublisher) -> None:
        self.publisher = publisher
        self.threads: set[int] = set()

    def _in_thread(self, decode, item):
        self.threads.add(threading.get_ident())
        return decode(item)

    async def receive(self, decode):
        item = await self.publisher.receive_channel.receive()
        if item == DISCONNECTED:
            return [item]
        return [await trio.to_thread.run_sync(self._in_thread, decode, item)]

    async def replay(self, start_seq, decode):
        self.publisher.replays.append(start_seq)
        frames = [[b"", s.to_bytes(8, "big"), p] for s, p in self.publisher.sent if s >= start_seq]

        def decode_all():
            self.threads.add(threading.get_ident())
            return tuple(d for f in frames if (d := decode(f)) is not None)

        return ReplayAnswer(await trio.to_thread.run_sync(decode_all), complete=True)


async def until(predicate) -> None:
    for _ in range(2000):
        if predicate():
            return
        await trio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_decoded_in_a_thread_order_gaps_and_replay_still_hold(nursery):
    index, pub = KVBlockIndex(), FakePublisher()
    source = ThreadDecodingSource(pub)
    sub = KVEventSubscriber("w", source, index, apply_blocks=3)
    await nursery.start(sub.run)
    pub.publish(chain(0, 4))
    pub.publish(chain(4, 4, parent=3), deliver=False)  # a gap: replayed
    for n in range(8, 40, 4):
        pub.publish(chain(n, 4, parent=n - 1))
    await until(lambda: sub.statistics().batches == 10 and index.blocks("w") == 40)
    assert pub.replays == [1]
    assert index.match(tokens_of(0, 40)) == {"w": 40}
    assert sub.state is FeedState.EXACT
    assert source.threads
    assert threading.get_ident() not in source.threads


async def test_decoded_in_a_thread_a_garbage_message_in_a_burst_is_counted_and_skipped(nursery):
    index, pub = KVBlockIndex(), FakePublisher(replay=False)
    sub = KVEventSubscriber("w", ThreadDecodingSource(pub), index, recovery_batches=2)
    await nursery.start(sub.run)
    pub.publish(stored(1))
    pub.publish(stored(2, 1))
    pub.publish(garble=True)
    pub.send.send_nowait([b"kv", b"short", b""])
    for n in range(10, 14):
        pub.publish(stored(n, None if n == 10 else n - 1))
    await until(lambda: sub.statistics().batches == 6 and not sub.applying)
    stats = sub.statistics()
    assert stats.decode_errors == 2
    assert index.engine_hashes("w") == {10, 11, 12, 13}  # the loss purged 1 and 2
    assert sub.state is FeedState.EXACT  # recovered after 2 batches in order
