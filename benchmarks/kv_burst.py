"""How long a burst of KV events holds the router's event loop.

    python benchmarks/kv_burst.py [--batches 20] [--blocks 4000] [--replay 200]

A real :class:`~epd_actors.kv_events.subscriber.ZmqEventSource` subscribes
over ``inproc://`` (no network) to a PUB socket and a ROUTER answering replay
requests the way vLLM's ``ZmqEventPublisher`` does.  While the subscriber
takes a burst, a probe task sleeps 1 ms in a loop and records how late it
wakes; the worst lateness is how long the loop was held.  Two bursts:

- **live**: ``--batches`` batches of one ``BlockStored`` of ``--blocks``
  blocks each, published back to back;
- **replay**: a subscriber that joins late catches up on ``--replay``
  batches of ``--blocks`` / 10 blocks through the replay socket.

Prints milliseconds: the longest single task step (how long one task held
the loop) and the probe's worst lateness (docs/benchmarks.md, "KV-event
index").  ``--no-gc`` turns the cyclic garbage collector off, whose pauses
(proportional to the heap, not to the step) otherwise add to whichever
step they fall in.  Needs pyzmq (the ``kv-events`` extra).
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from typing import Any

import trio

from epd_actors.kv_events import BlockStored, KVBlockIndex
from epd_actors.kv_events.subscriber import KVEventSubscriber, ZmqEventSource
from epd_actors.kv_events.zmq_import import import_zmq
from epd_actors.simulator.kv_events import encode_batch

BLOCK_SIZE = 16


def payloads(count: int, blocks: int, first: int) -> list[bytes]:
    """``count`` encoded batches, each one fresh sequence of ``blocks`` blocks."""
    out = []
    for b in range(count):
        base = (first + b) * blocks
        hashes = tuple(range(base, base + blocks))
        tokens = tuple(t % 50_000 for t in range(base * BLOCK_SIZE, (base + blocks) * BLOCK_SIZE))
        event = BlockStored(hashes, None, tokens, BLOCK_SIZE, None, "GPU")
        out.append(encode_batch([event], ts=0.0, encoding="array"))
    return out


def serve_replay(router: Any, kept: list[bytes], stop: threading.Event) -> None:
    """Answer replay requests (``[id, b"", seq]``) from ``kept`` until ``stop``."""
    while not stop.is_set():
        if not router.poll(50):
            continue
        ident, _, seq_frame = router.recv_multipart()
        start = int.from_bytes(seq_frame, "big", signed=True)
        for seq in range(max(0, start), len(kept)):
            router.send_multipart([ident, b"", seq.to_bytes(8, "big"), kept[seq]])
        router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])


class LongestStep(trio.abc.Instrument):
    """The longest single step of any task but the probe: how long one task held the loop."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.longest = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.started is not None and task.name != f"{__name__}.probe":
            d = time.perf_counter() - self.started
            self.longest = max(self.longest, d)


async def probe(worst: list[float]) -> None:
    """Sleep 1 ms in a loop; keep the worst lateness in ``worst[0]``."""
    while True:
        before = trio.current_time()
        await trio.sleep(0.001)
        worst[0] = max(worst[0], trio.current_time() - before - 0.001)


async def burst(name: str, live: list[bytes], kept: list[bytes], total: int) -> None:
    """Subscribe, publish ``live`` after ``kept`` (replayable), report the loop's worst hold.

    Done when the index holds ``total`` blocks.
    """
    zmq = import_zmq()
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"inproc://{name}-pub")
    router.bind(f"inproc://{name}-replay")
    stop = threading.Event()
    all_batches = kept + live
    server = threading.Thread(target=serve_replay, args=(router, all_batches, stop), daemon=True)
    server.start()
    index = KVBlockIndex(max_blocks_per_worker=1 << 22, max_blocks=1 << 23)
    source = ZmqEventSource(f"inproc://{name}-pub", f"inproc://{name}-replay", context=ctx)
    worst = [0.0]
    with source:
        sub = KVEventSubscriber("w", source, index, buffer=64)
        async with trio.open_nursery() as nursery:
            await nursery.start(sub.run)
            await trio.sleep(0.2)  # the SUB is connected (inproc joins at once)
            nursery.start_soon(probe, worst)
            await trio.sleep(0.05)

            def send_all() -> None:
                for offset, payload in enumerate(live):
                    seq = len(kept) + offset
                    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

            steps = LongestStep()
            trio.lowlevel.add_instrument(steps)
            started = trio.current_time()
            await trio.to_thread.run_sync(send_all)
            while index.statistics().stored < total:  # noqa: ASYNC110 -- polls the index
                await trio.sleep(0.005)
            took = trio.current_time() - started
            trio.lowlevel.remove_instrument(steps)
            late = worst[0]
            batches = sub.statistics().batches
            nursery.cancel_scope.cancel()
    stop.set()
    server.join()
    pub.close(linger=0)
    router.close(linger=0)
    ctx.term()
    print(
        f"{name}: {batches} batches ({total} blocks) applied in {took * 1e3:.0f} ms; "
        f"longest task step {steps.longest * 1e3:.1f} ms; a 1 ms sleeper woke at most "
        f"{late * 1e3:.1f} ms late"
    )


async def main(args: argparse.Namespace) -> None:
    live = payloads(args.batches, args.blocks, first=0)
    await burst("live", live, [], args.batches * args.blocks)
    small = max(1, args.blocks // 10)
    kept = payloads(args.replay, small, first=10_000)
    await burst("replay", payloads(1, small, first=20_000), kept, (args.replay + 1) * small)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=4000)
    parser.add_argument("--replay", type=int, default=200)
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC (its pauses)")
    arguments = parser.parse_args()
    if arguments.no_gc:
        gc.disable()
    trio.run(main, arguments)
