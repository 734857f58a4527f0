"""Costs of the KV-event index: decoding a batch, applying it, matching a prompt.

    python benchmarks/kv_index.py

Prints milliseconds per operation (docs/benchmarks.md, "KV-event index").
"""

from __future__ import annotations

import timeit

from epd_actors.kv_events import BlockStored, KVBlockIndex, decode_batch
from epd_actors.simulator.kv_events import encode_batch
from epd_actors.simulator.prefix_cache import SimPrefixCache


class _Recorder:
    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    def publish(self, events: object) -> None:
        self.batches.append(list(events))  # type: ignore[call-overload]


def main() -> None:
    index = KVBlockIndex()
    for w in range(8):
        sink = _Recorder()
        cache = SimPrefixCache(block_size=16, capacity_blocks=1 << 20, hash_seed=w, sink=sink)
        cache.store(list(range(8192)))
        for batch in sink.batches:
            index.apply(f"w{w}", batch)  # type: ignore[arg-type]
    ids = list(range(8192))
    t = timeit.timeit(lambda: index.match(ids), number=50) / 50
    print(f"match 8192 tokens (512 blocks) against 8 workers: {t * 1e3:.2f} ms")
    events = [
        BlockStored(tuple(range(i * 32, i * 32 + 32)), None, tuple(range(512)), 16, None, "GPU")
        for i in range(100)
    ]
    for encoding in ("array", "map"):
        payload = encode_batch(events, ts=0.0, encoding=encoding)
        t = timeit.timeit(lambda p=payload: decode_batch(p), number=20) / 20
        print(f"decode a {encoding} batch of 3200 blocks ({len(payload)} bytes): {t * 1e3:.2f} ms")
    sink = _Recorder()
    cache = SimPrefixCache(block_size=16, capacity_blocks=1 << 20, hash_seed=1, sink=sink)
    cache.store(list(range(16 * 3200)))
    fresh = KVBlockIndex()
    t = timeit.timeit(lambda: fresh.apply("x", sink.batches[0]), number=5) / 5  # type: ignore[arg-type]
    print(f"apply one BlockStored of 3200 blocks: {t * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
