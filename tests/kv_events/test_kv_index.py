"""The exact KV block index: router-computed keys, matching, removal, purge, bounds."""

from __future__ import annotations

import pytest

from epd_actors.errors import ConfigError
from epd_actors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVBlockIndex
from epd_actors.simulator.prefix_cache import SimPrefixCache

BS = 4


class Recorder:
    def __init__(self):
        self.batches = []

    def publish(self, events):
        self.batches.append(list(events))


def engine(seed: int, capacity: int = 1000) -> tuple[SimPrefixCache, Recorder]:
    sink = Recorder()
    return SimPrefixCache(block_size=BS, capacity_blocks=capacity, hash_seed=seed, sink=sink), sink


def feed(index: KVBlockIndex, worker: str, sink: Recorder) -> None:
    for batch in sink.batches:
        index.apply(worker, batch)
    sink.batches.clear()


PROMPT = list(range(100, 120))  # 5 blocks of 4


def test_engines_with_different_hash_seeds_get_the_same_router_keys():
    a, sink_a = engine(seed=1)
    b, sink_b = engine(seed=2)
    a.store(PROMPT)
    b.store(PROMPT[:12])
    assert a.block_hashes(PROMPT)[:3] != b.block_hashes(PROMPT)[:3]  # the trap
    index = KVBlockIndex()
    feed(index, "a", sink_a)
    feed(index, "b", sink_b)
    assert index.match(PROMPT) == {"a": 5, "b": 3}
    assert index.match([*PROMPT[:8], 0, 0, 0, 0]) == {"a": 2, "b": 2}
    assert index.match(PROMPT[:3]) == {"a": 0, "b": 0}  # no full block
    assert index.match(PROMPT, workers=["a", "z"]) == {"a": 5, "z": 0}


def test_a_continuation_chains_on_the_parent_hash():
    a, sink = engine(seed=3)
    index = KVBlockIndex()
    a.store(PROMPT[:8])
    a.store(PROMPT)  # stores blocks 3..5 with block 2 as parent
    assert [e.parent_block_hash for b in sink.batches for e in b] == [
        None,
        a.block_hashes(PROMPT)[1],
    ]
    feed(index, "a", sink)
    assert index.match(PROMPT) == {"a": 5}


def test_removed_blocks_stop_a_match_where_the_engine_would():
    a, sink = engine(seed=4)
    index = KVBlockIndex()
    a.store(PROMPT)
    feed(index, "a", sink)
    hashes = a.block_hashes(PROMPT)
    index.apply("a", [BlockRemoved((hashes[2],), "GPU")])
    assert index.match(PROMPT) == {"a": 2}
    assert index.blocks("a") == 4


def test_lora_adapters_and_extra_keys_separate_blocks():
    index = KVBlockIndex()
    index.apply("a", [BlockStored((1,), None, (1, 2, 3, 4), BS, lora_name="ad")])
    index.apply("a", [BlockStored((2,), None, (5, 6, 7, 8), BS, extra_keys=(("img",),))])
    assert index.match([1, 2, 3, 4]) == {"a": 0}
    assert index.match([1, 2, 3, 4], lora_name="ad") == {"a": 1}
    assert index.match([5, 6, 7, 8]) == {"a": 0}
    assert index.match([5, 6, 7, 8], extra_keys=[("img",)]) == {"a": 1}


def test_an_unknown_parent_is_an_orphan_not_a_guess():
    index = KVBlockIndex()
    index.apply("a", [BlockStored((9,), 12345, (1, 2, 3, 4), BS)])
    assert index.blocks("a") == 0
    assert index.statistics().orphans == 1


def test_other_media_and_groups_are_ignored():
    index = KVBlockIndex()
    index.apply("a", [BlockStored((1,), None, (1, 2, 3, 4), BS, medium="CPU_PINNED")])
    index.apply("a", [BlockStored((2,), None, (1, 2, 3, 4), BS, medium="GPU", group_idx=1)])
    index.apply("a", [BlockRemoved((3,), medium="CPU_PINNED")])
    assert index.match([1, 2, 3, 4], workers=["a"]) == {"a": 0}
    assert index.blocks("a") == 0
    assert index.statistics().ignored == 3


def test_clear_and_purge_forget_one_worker_only():
    index = KVBlockIndex()
    for w in ("a", "b"):
        index.apply(w, [BlockStored((1,), None, (1, 2, 3, 4), BS)])
    index.apply("a", [AllBlocksCleared()])
    assert index.match([1, 2, 3, 4], workers=["a", "b"]) == {"a": 0, "b": 1}
    index.purge("b")
    assert index.match([1, 2, 3, 4], workers=["a", "b"]) == {"a": 0, "b": 0}
    assert index.statistics().blocks == 0


def test_a_changed_block_size_purges_the_worker():
    index = KVBlockIndex()
    index.apply("a", [BlockStored((1,), None, (1, 2, 3, 4), BS)])
    index.apply("a", [BlockStored((2,), None, (1, 2), 2)])
    assert index.block_size("a") == 2
    assert index.match([1, 2, 3, 4]) == {"a": 1}  # the 4-token block is gone
    assert index.blocks("a") == 1


def test_restoring_a_known_block_moves_it_to_the_newest():
    index = KVBlockIndex(max_blocks_per_worker=2)
    index.apply("a", [BlockStored((1,), None, (1, 1, 1, 1), BS)])
    index.apply("a", [BlockStored((2,), None, (2, 2, 2, 2), BS)])
    index.apply("a", [BlockStored((1,), None, (1, 1, 1, 1), BS)])  # block 1 again
    index.apply("a", [BlockStored((3,), None, (3, 3, 3, 3), BS)])  # evicts block 2
    assert index.engine_hashes("a") == {1, 3}


def test_a_flood_of_distinct_prompts_stays_within_both_bounds():
    index = KVBlockIndex(max_blocks_per_worker=300, max_blocks=500)
    caches = {w: engine(seed=i, capacity=10_000) for i, w in enumerate(("a", "b", "c"))}
    for n in range(400):
        for w, (cache, sink) in caches.items():
            cache.store([n * 1000 + i for i in range(16)])  # 4 fresh blocks each
            feed(index, w, sink)
            per_worker = index.blocks_per_worker()
            assert max(per_worker.values()) <= 300
            assert sum(per_worker.values()) <= 500
    stats = index.statistics()
    assert stats.blocks == 500
    assert stats.evicted == 3 * 400 * 4 - 500
    # what is left is the newest, and still matches where the engine has it
    newest = [399_000 + i for i in range(16)]
    assert index.match(newest) == {"a": 4, "b": 4, "c": 4}
    assert index.match(list(range(16))) == {"a": 0, "b": 0, "c": 0}
    # the engine-hash map is bounded with the entries
    assert sum(len(index.engine_hashes(w)) for w in "abc") == 500


def test_bounds_are_checked():
    with pytest.raises(ConfigError):
        KVBlockIndex(max_blocks=0)


def test_the_index_agrees_with_an_evicting_engine():
    cache, sink = engine(seed=7, capacity=20)
    index = KVBlockIndex()
    prompts = [[(n % 7) * 10_000 + i for i in range(4 * (1 + n % 5))] for n in range(60)]
    for p in prompts:
        cache.begin(p)
        cache.store(p)
        feed(index, "a", sink)
        assert index.engine_hashes("a") == cache.contents()
    for p in prompts:
        assert index.match(p) == {"a": cache.lookup(p)}
