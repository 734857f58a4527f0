"""The router's memory of encoder outputs: bounds, TTL and scope, with time passed in."""

from __future__ import annotations

import hashlib

import pytest

from epd_actors.core.actors.encode import memory_key
from epd_actors.core.encoder_cache import (
    HASH_PREFIX,
    EncoderCache,
    EncoderReuse,
    missing_hashes,
)
from epd_actors.errors import ConfigError
from epd_actors.protocol import MediaItem

TTL = EncoderReuse(mode="ttl", ttl_s=10.0)


def h(n: int) -> str:
    """A content hash (64 hex characters), distinct for each ``n`` from its first ones."""
    return hashlib.sha256(str(n).encode()).hexdigest()


def params(n: int) -> dict[str, object]:
    return {h(n): {"producer": "encode-0"}}


def test_a_remembered_entry_is_recalled_with_its_params_until_its_ttl() -> None:
    cache = EncoderCache(TTL)
    cache.remember(h(1), "encode-0", params(1), 1000, now=5.0)
    entry = cache.recall(h(1), now=14.9)
    assert entry is not None
    assert (entry.producer, entry.ec_transfer_params, entry.media_bytes) == (
        "encode-0",
        params(1),
        1000,
    )
    assert cache.recall(h(1), now=15.0) is None  # written at 5, trusted for 10 s
    assert len(cache) == 0
    stats = cache.statistics()
    assert (stats.hits, stats.media_bytes_reused, stats.misses, stats.expired) == (1, 1000, 1, 1)


def test_reading_an_entry_does_not_extend_its_ttl() -> None:
    cache = EncoderCache(TTL)
    cache.remember(h(1), "encode-0", params(1), 10, now=0.0)
    for now in (3.0, 6.0, 9.0):
        assert cache.recall(h(1), now=now) is not None
    assert cache.recall(h(1), now=10.0) is None


def test_writing_again_restarts_the_ttl_and_replaces_the_params() -> None:
    cache = EncoderCache(TTL)
    cache.remember(h(1), "encode-0", params(1), 10, now=0.0)
    cache.remember(h(1), "encode-1", {"other": True}, 10, now=8.0)
    entry = cache.recall(h(1), now=17.0)
    assert entry is not None
    assert (entry.producer, entry.ec_transfer_params) == ("encode-1", {"other": True})
    assert len(cache) == 1


def test_the_count_bound_evicts_the_least_recently_used() -> None:
    cache = EncoderCache(EncoderReuse(mode="ttl", max_entries=2))
    cache.remember(h(1), "e", params(1), 1, now=0.0)
    cache.remember(h(2), "e", params(2), 1, now=0.0)
    assert cache.recall(h(1), now=1.0) is not None  # 1 is now the most recent
    cache.remember(h(3), "e", params(3), 1, now=1.0)
    assert cache.recall(h(2), now=1.0) is None
    assert cache.recall(h(1), now=1.0) is not None
    assert cache.recall(h(3), now=1.0) is not None
    assert cache.statistics().evicted == 1


def test_the_byte_bound_holds_and_an_oversized_entry_is_not_kept() -> None:
    one = EncoderCache(EncoderReuse(mode="ttl"))
    one.remember(h(1), "e", params(1), 1, now=0.0)
    cost = one.statistics().bytes
    cache = EncoderCache(EncoderReuse(mode="ttl", max_bytes=2 * cost + cost // 2))
    for n in range(1, 6):
        cache.remember(h(n), "e", params(n), 1, now=0.0)
        assert cache.statistics().bytes <= 2 * cost + cost // 2
    assert len(cache) == 2
    assert [cache.recall(h(n), now=0.0) is not None for n in range(1, 6)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    huge: dict[str, object] = {"blob": "x" * (3 * cost)}
    cache.remember(h(9), "e", huge, 1, now=0.0)
    assert cache.recall(h(9), now=0.0) is None
    assert len(cache) == 2


def test_forgetting_returns_the_bytes() -> None:
    cache = EncoderCache(TTL)
    cache.remember(h(1), "e", params(1), 1, now=0.0)
    cache.remember(h(2), "e", None, 1, now=0.0)
    assert cache.forget(h(1)) is True
    assert cache.forget(h(1)) is False
    cache.found_missing([h(2), h(3)])
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.found_missing) == (0, 0, 2)


def test_off_remembers_nothing_and_counts_no_misses() -> None:
    cache = EncoderCache(EncoderReuse())
    cache.remember(h(1), "e", params(1), 1, now=0.0)
    assert cache.recall(h(1), now=0.0) is None
    assert cache.statistics().misses == 0
    assert len(cache) == 0


def test_the_worker_scope_trusts_an_entry_only_while_its_producer_is_reachable() -> None:
    cache = EncoderCache(EncoderReuse(mode="ttl", scope="worker"))
    cache.remember(h(1), "encode-0", params(1), 1, now=0.0)
    assert cache.recall(h(1), now=1.0, reachable={"encode-0"}.__contains__) is not None
    assert cache.recall(h(1), now=1.0, reachable=set[str]().__contains__) is None
    assert len(cache) == 0  # dropped, not kept for a producer that may return empty


def test_the_shared_scope_outlives_its_producer() -> None:
    cache = EncoderCache(EncoderReuse(mode="ttl", scope="shared"))
    cache.remember(h(1), "encode-0", params(1), 1, now=0.0)
    assert cache.recall(h(1), now=1.0, reachable=set[str]().__contains__) is not None


@pytest.mark.parametrize(
    ("reuse", "key"),
    [
        (EncoderReuse(mode="always"), "reuse"),
        (EncoderReuse(mode="ttl", scope="cluster"), "reuse_scope"),
        (EncoderReuse(mode="ttl", ttl_s=0.0), "reuse_ttl_s"),
        (EncoderReuse(mode="ttl", ttl_s=float("inf")), "reuse_ttl_s"),
        (EncoderReuse(mode="ttl", max_entries=0), "reuse_max_entries"),
        (EncoderReuse(mode="ttl", max_bytes=0), "reuse_max_bytes"),
    ],
)
def test_bad_settings_are_refused_by_name(reuse: EncoderReuse, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"pools\.encode\.{key}"):
        reuse.check("pools.encode")


def test_a_refusal_names_the_missing_hashes_by_prefix() -> None:
    remembered = [h(1), h(2), h(3)]
    detail = f"no encoder-cache entry for 2 media item(s): {h(3)[:HASH_PREFIX]}, {h(1)[:16]}"
    assert missing_hashes(detail, remembered) == [h(1), h(3)]


def test_a_refusal_that_names_none_means_every_remembered_item() -> None:
    remembered = [h(2), h(1), h(2)]
    assert missing_hashes("encoder output not found", remembered) == [h(2), h(1)]


def test_an_item_is_remembered_under_its_processing_options() -> None:
    item = MediaItem.from_bytes(b"frames" * 8, "video/mp4")
    plain = memory_key(item, None)
    assert plain == memory_key(item, {"frequency_penalty": 0.5}) == item.content_hash
    four = memory_key(item, {"media_io_kwargs": {"video": {"num_frames": 4}}})
    eight = memory_key(item, {"media_io_kwargs": {"video": {"num_frames": 8}}})
    assert len({plain, four, eight}) == 3
    assert four.startswith(item.content_hash)  # refusals name items by hash prefix
    both = {"mm_processor_kwargs": {"fps": 1, "max_pixels": 4}, "media_io_kwargs": {}}
    reordered = {"media_io_kwargs": {}, "mm_processor_kwargs": {"max_pixels": 4, "fps": 1}}
    assert memory_key(item, both) == memory_key(item, reordered)
