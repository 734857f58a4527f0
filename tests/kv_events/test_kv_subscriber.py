"""KV event subscribers: gaps, replay, restarts, losses, states, and ZMQ on loopback."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from epd_actors.kv_events import BlockStored, FeedState, KVBlockIndex
from epd_actors.kv_events.metrics import KVFeedCollector
from epd_actors.kv_events.subscriber import (
    DISCONNECTED,
    KVEventSubscriber,
    ReplayAnswer,
    ZmqEventSource,
)
from epd_actors.protocol import PrefillRequest, Prompt, Role
from epd_actors.simulator.engine import SimConfig, SimEngine
from epd_actors.simulator.kv_events import (
    SimKVEventPublisher,
    encode_batch,
    sim_worker_kv_events,
)
from epd_actors.simulator.store import create_sim_stores

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

BS = 2


def stored(n: int, parent: int | None = None) -> BlockStored:
    """Block ``n`` holding tokens (n, n), chained on ``parent``."""
    return BlockStored((n,), parent, (n, n), BS, None, "GPU", None)


class FakePublisher:
    """Speaks the real frames: numbers batches, keeps them for replay, can lose or garble some."""

    def __init__(self, *, replay: bool = True, keep: int = 1000):
        self.sent: list[tuple[int, bytes]] = []
        self.replay_enabled = replay
        self.keep = keep
        self.seq = 0
        self.replays: list[int] = []
        self.send, self.receive_channel = trio.open_memory_channel(100)

    def publish(self, *events, deliver: bool = True, garble: bool = False) -> None:
        payload = encode_batch(events, ts=0.0, encoding="map")
        if garble:
            payload = b"\xc1"
        self.sent.append((self.seq, payload))
        self.sent = self.sent[-self.keep :]
        if deliver:
            self.send.send_nowait([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def restart(self) -> None:
        self.seq = 0
        self.sent = []

    async def receive(self, decode):
        item = await self.receive_channel.receive()
        return [item if item == DISCONNECTED else decode(item)]

    async def replay(self, start_seq, decode):
        self.replays.append(start_seq)
        if not self.replay_enabled:
            return None
        frames = ([b"", s.to_bytes(8, "big"), p] for s, p in self.sent if s >= start_seq)
        return ReplayAnswer(tuple(d for f in frames if (d := decode(f)) is not None), True)


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


@pytest.fixture
async def rig(nursery):
    index = KVBlockIndex()
    pub = FakePublisher()
    sub = KVEventSubscriber("w", pub, index, recovery_batches=2)
    await nursery.start(sub.run)
    return index, pub, sub


async def test_in_order_batches_are_exact(rig):
    index, pub, sub = rig
    assert sub.state is FeedState.FALLBACK
    pub.publish(stored(1))
    pub.publish(stored(2, 1))
    await settle()
    assert sub.state is FeedState.EXACT
    assert index.match([1, 1, 2, 2]) == {"w": 2}
    assert pub.replays == []


async def test_a_gap_is_replayed_in_order(rig):
    index, pub, sub = rig
    pub.publish(stored(1))
    pub.publish(stored(2, 1), deliver=False)
    pub.publish(stored(3, 2))
    await settle()
    assert pub.replays == [1]
    assert sub.state is FeedState.EXACT
    assert index.match([1, 1, 2, 2, 3, 3]) == {"w": 3}
    assert sub.statistics().gaps == 1


async def test_a_new_subscriber_gets_no_snapshot_and_catches_up_by_replay(nursery):
    index, pub = KVBlockIndex(), FakePublisher()
    pub.publish(stored(1), deliver=False)  # before anyone listened
    pub.publish(stored(2, 1), deliver=False)
    sub = KVEventSubscriber("w", pub, index)
    await nursery.start(sub.run)
    pub.publish(stored(3, 2))
    await settle()
    assert pub.replays == [0]
    assert sub.state is FeedState.EXACT
    assert index.match([1, 1, 2, 2, 3, 3]) == {"w": 3}


async def test_history_past_the_replay_buffer_leaves_the_worker_degraded(nursery):
    index, pub = KVBlockIndex(), FakePublisher(keep=1)
    pub.publish(stored(1), deliver=False)
    pub.publish(stored(2, 1), deliver=False)  # seq 0 no longer replayable
    sub = KVEventSubscriber("w", pub, index, recovery_batches=2)
    await nursery.start(sub.run)
    pub.publish(stored(3, 2))
    await settle()
    assert sub.state is FeedState.DEGRADED
    assert index.match([1, 1, 2, 2, 3, 3]) == {"w": 0}  # its parent was never seen
    assert index.match([2, 2]) == {"w": 0}
    pub.publish(stored(4))
    pub.publish(stored(5))
    await settle()
    assert sub.state is FeedState.EXACT  # recovery_batches in order
    assert index.match([4, 4]) == {"w": 1}


async def test_an_unreplayable_gap_purges_the_worker(nursery):
    index, pub = KVBlockIndex(), FakePublisher(replay=False)
    sub = KVEventSubscriber("w", pub, index, recovery_batches=5)
    await nursery.start(sub.run)
    pub.publish(stored(1))
    pub.publish(stored(9), deliver=False)  # a lost batch could have removed block 1
    pub.publish(stored(2, 1))
    await settle()
    assert sub.state is FeedState.DEGRADED
    assert index.blocks("w") == 0  # purged; block 2's parent is gone too
    assert sub.statistics().losses == 1


async def test_a_restarted_engine_counting_from_zero_is_purged(rig):
    index, pub, sub = rig
    for n in range(1, 4):
        pub.publish(stored(n))
    await settle()
    assert index.blocks("w") == 3
    pub.restart()
    pub.publish(stored(7))
    await settle()
    assert sub.statistics().restarts == 1
    assert index.engine_hashes("w") == {7}
    assert sub.state is FeedState.EXACT


async def test_a_disconnect_drops_the_worker_to_fallback(rig):
    index, pub, sub = rig
    pub.publish(stored(1))
    await settle()
    pub.send.send_nowait(DISCONNECTED)
    await settle()
    assert sub.state is FeedState.FALLBACK
    assert index.blocks("w") == 0
    pub.publish(stored(2))  # seq 1 after a reconnect: catch up from 0
    await settle()
    assert pub.replays == [0]
    assert index.engine_hashes("w") == {1, 2}


async def test_an_undecodable_batch_is_a_loss_not_a_crash(rig):
    index, pub, sub = rig
    pub.publish(stored(1))
    pub.publish(garble=True)
    pub.send.send_nowait([b"only one frame"])
    pub.publish(stored(2))
    await settle()
    stats = sub.statistics()
    assert stats.decode_errors == 2
    assert index.engine_hashes("w") == {2}
    assert sub.state is FeedState.DEGRADED


async def test_cancelling_the_subscriber_purges_its_worker():
    index, pub = KVBlockIndex(), FakePublisher()
    sub = KVEventSubscriber("w", pub, index)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        pub.publish(stored(1))
        await settle()
        assert index.blocks("w") == 1
        nursery.cancel_scope.cancel()
    assert index.blocks("w") == 0
    assert sub.state is FeedState.FALLBACK


async def test_the_state_gauge(rig):
    index, pub, sub = rig
    pub.publish(stored(1))
    await settle()
    metrics = {m.name: m for m in KVFeedCollector(lambda: [sub], index).collect()}
    states = {s.labels["state"]: s.value for s in metrics["epd_kv_index_state"].samples}
    assert states == {"exact": 1.0, "degraded": 0.0, "fallback": 0.0}
    (blocks,) = metrics["epd_kv_index_blocks"].samples
    assert blocks.value == 1


# ---------------------------------------------------------------- loopback ZMQ


def prefill(text: str, n: int) -> PrefillRequest:
    return PrefillRequest(f"r{n}", Prompt(text=text))


async def wait_until(predicate, tries: int = 200) -> None:
    for _ in range(tries):
        if predicate():
            return
        await trio.sleep(0.02)
    raise AssertionError("condition not reached")


async def publish_until(publisher, events, predicate) -> None:
    """Publish ``events`` again until ``predicate`` holds (a SUB may still be connecting)."""
    for _ in range(100):
        publisher.publish(events)
        for _ in range(5):
            await trio.sleep(0.02)
            if predicate():
                return
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_sim_publisher_to_subscriber_to_index_agrees_with_the_sims_cache(encoding):
    config = SimConfig(
        prefill_token_s=0.0,
        prefix_cache_blocks=12,
        prefix_block_size=4,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_encoding=encoding,
        kv_events_topic="kv",
    )
    stores = create_sim_stores()
    sim = SimEngine(
        Role.PREFILL, worker_id="p0", config=config, ec_store=stores.ec, kv_store=stores.kv
    )
    index = KVBlockIndex()
    from prometheus_client import CollectorRegistry

    with sim_worker_kv_events(sim, registry=CollectorRegistry()) as pub:
        assert pub is not None
        await sim.prefill(prefill("early words before the router subscribed " * 2, 0))
        with ZmqEventSource(pub.endpoint, pub.replay_endpoint, topic="kv") as source:
            sub = KVEventSubscriber("p0", source, index)
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                texts = [f"system prompt {n % 3} " * 4 + f"question {n}" for n in range(12)]
                for n, text in enumerate(texts):
                    await sim.prefill(prefill(text, n + 1))
                cache = sim.prefix_cache
                assert cache is not None
                # A SUB still connecting loses what is published meanwhile; the next
                # batch it sees is a gap, replayed.  Keep prefilling until it has seen one.
                for n in range(100):
                    if sub.statistics().batches >= pub.published > 0:
                        break
                    await sim.prefill(prefill(f"late prompt number {n} " * 3, 100 + n))
                    await trio.sleep(0.02)
                # On a loaded machine the subscriber may still trail the last batches.
                # Every batch numbered so far taken in order (the publisher's thread
                # sends them a little later), and its pieces applied.
                with trio.fail_after(20):
                    while sub.statistics().expected_seq != pub.numbered or sub.applying:  # noqa: ASYNC110  (another thread's work: polled)
                        await trio.sleep(0.02)
                assert sub.state is FeedState.EXACT
                assert index.engine_hashes("p0") == cache.contents()
                from epd_actors.simulator.prefix_cache import prompt_token_ids

                for text in texts:
                    ids = prompt_token_ids(Prompt(text=text), (), 0)
                    assert index.match(ids) == {"p0": cache.lookup(ids)}
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def rebound_publisher(endpoint: str, replay: str) -> AsyncIterator[SimKVEventPublisher]:
    """A publisher bound to the addresses another one just closed.

    ZMQ closes sockets in its I/O thread, so the port may stay taken for a moment
    (longer on a loaded machine); an engine restarted on the same port retries too.
    """
    from epd_actors.errors import ConfigError

    with trio.fail_after(20):
        while True:
            publisher = SimKVEventPublisher(endpoint, replay)
            try:
                publisher.__enter__()
                break
            except ConfigError:
                await trio.sleep(0.05)
    try:
        yield publisher
    finally:
        publisher.close()


async def test_a_restarted_publisher_on_the_same_port_purges_the_worker():
    index = KVBlockIndex()
    with SimKVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as first:
        endpoint, replay = first.endpoint, first.replay_endpoint
        with ZmqEventSource(endpoint, replay, poll_interval_s=0.02) as source:
            sub = KVEventSubscriber("w", source, index)
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                await publish_until(
                    first, [stored(1), stored(2), stored(3)], lambda: index.blocks("w") == 3
                )
                first.close()
                async with rebound_publisher(endpoint, replay) as second:
                    await wait_until(lambda: sub.state is FeedState.FALLBACK)
                    await publish_until(
                        second, [stored(8)], lambda: index.engine_hashes("w") == {8}
                    )
                    assert sub.state is FeedState.EXACT
                    nursery.cancel_scope.cancel()


def test_kv_events_without_a_prefix_cache_is_a_config_error():
    from epd_actors.errors import ConfigError

    stores = create_sim_stores()
    sim = SimEngine(
        Role.PREFILL,
        worker_id="p",
        config=SimConfig(kv_events_endpoint="tcp://127.0.0.1:*"),
        ec_store=stores.ec,
        kv_store=stores.kv,
    )
    with pytest.raises(ConfigError, match="prefix-cache-blocks"), sim_worker_kv_events(sim):
        pass
