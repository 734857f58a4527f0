"""The simulator's shared stores, in memory and in a directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from epd_actors.simulator.store import (
    DirectoryEncoderCacheStore,
    DirectoryKVStore,
    EncoderCacheEntry,
    KVEntry,
    KVStore,
    MemoryEncoderCacheStore,
    MemoryKVStore,
    SimStores,
    create_sim_stores,
    is_safe_key,
)

if TYPE_CHECKING:
    from pathlib import Path


def kv_entry(handle: str = "h1", expires_at: float = 30.0) -> KVEntry:
    return KVEntry(handle, "p0", "req-1", "d" * 32, 12, expires_at, "run")


def ec_entry(content_hash: str = "c1") -> EncoderCacheEntry:
    return EncoderCacheEntry(content_hash, "e0", "image", 100, 256)


@pytest.fixture(params=["memory", "directory"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> SimStores:
    return create_sim_stores(None if request.param == "memory" else tmp_path)


def test_factory_picks_the_backend(tmp_path: Path) -> None:
    memory = create_sim_stores(ec_capacity=3)
    assert isinstance(memory.ec, MemoryEncoderCacheStore)
    assert memory.ec.capacity == 3
    assert isinstance(memory.kv, MemoryKVStore)
    on_disk = create_sim_stores(tmp_path / "shared")
    assert isinstance(on_disk.ec, DirectoryEncoderCacheStore)
    assert isinstance(on_disk.kv, DirectoryKVStore)
    assert (tmp_path / "shared" / "ec").is_dir()
    assert (tmp_path / "shared" / "kv").is_dir()


def test_kv_round_trip_and_single_consume(stores: SimStores) -> None:
    kv = stores.kv
    kv.create(kv_entry(expires_at=float("inf")))
    assert kv.contains("h1")
    assert len(kv) == 1
    assert kv.peek("h1") == kv_entry(expires_at=float("inf"))
    assert kv.take("h1") == kv_entry(expires_at=float("inf"))
    assert kv.take("h1") is None
    assert kv.peek("h1") is None
    assert not kv.contains("h1")
    assert len(kv) == 0


def test_kv_discard_happens_once(stores: SimStores) -> None:
    stores.kv.create(kv_entry())
    assert stores.kv.discard("h1") is True
    assert stores.kv.discard("h1") is False
    assert stores.kv.take("h1") is None


def test_ec_put_overwrites_and_get(stores: SimStores) -> None:
    assert stores.ec.get("c1") is None
    stores.ec.put(ec_entry())
    stores.ec.put(ec_entry())
    assert stores.ec.get("c1") == ec_entry()
    assert len(stores.ec) == 1


def test_two_directory_stores_on_one_path_share_state(tmp_path: Path) -> None:
    producer, consumer = create_sim_stores(tmp_path), create_sim_stores(tmp_path)
    producer.ec.put(ec_entry("abc"))
    producer.kv.create(kv_entry())
    assert consumer.ec.get("abc") == ec_entry("abc")
    assert consumer.kv.take("h1") == kv_entry()
    assert producer.kv.discard("h1") is False


def test_directory_files_are_named_by_key_and_temporaries_are_gone(tmp_path: Path) -> None:
    stores = create_sim_stores(tmp_path)
    stores.ec.put(ec_entry("abc123"))
    stores.kv.create(kv_entry("ff00"))
    assert sorted(p.name for p in (tmp_path / "ec").iterdir()) == ["abc123"]
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["ff00"]
    stores.kv.take("ff00")
    assert list((tmp_path / "kv").iterdir()) == []


@pytest.mark.parametrize(
    "key",
    ["", "../x", "a/b", "..", ".tmp-1", "ABC", "a b", "a" * 129, "-lead", "x\x00"],
    ids=repr,
)
def test_unsafe_keys_are_refused_before_touching_files(
    key: str, stores: SimStores, tmp_path: Path
) -> None:
    assert not is_safe_key(key)
    with pytest.raises(ValueError, match="unsafe store key"):
        stores.ec.get(key)
    with pytest.raises(ValueError, match="unsafe store key"):
        stores.kv.take(key)
    with pytest.raises(ValueError, match="unsafe store key"):
        stores.kv.create(kv_entry(key))
    assert not (tmp_path.parent / "x").exists()


def test_safe_keys() -> None:
    assert is_safe_key("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    assert is_safe_key("img-1_a")


def test_memory_encoder_cache_evicts_least_recently_used() -> None:
    ec = MemoryEncoderCacheStore(capacity=2)
    ec.put(ec_entry("a"))
    ec.put(ec_entry("b"))
    assert ec.get("a") is not None  # a is now the most recent
    ec.put(ec_entry("c"))
    assert ec.get("b") is None
    assert ec.get("a") is not None
    assert ec.get("c") is not None
    with pytest.raises(ValueError, match="capacity"):
        MemoryEncoderCacheStore(capacity=0)


def test_memory_kv_refuses_a_duplicate_handle() -> None:
    kv: KVStore = MemoryKVStore()
    kv.create(kv_entry())
    with pytest.raises(ValueError, match="already exists"):
        kv.create(kv_entry())


@pytest.mark.parametrize(
    "content",
    ["[1, 2]", '{"handle": "h1"}', '{"handle": 5, "producer": "p"}'],
    ids=["not-an-object", "missing-fields", "wrong-type"],
)
def test_a_foreign_file_in_the_kv_directory_is_an_error(content: str, tmp_path: Path) -> None:
    kv = DirectoryKVStore(tmp_path)
    (tmp_path / "h1").write_text(content)
    with pytest.raises(ValueError, match="store"):
        kv.peek("h1")


def test_reprs_name_the_backend(tmp_path: Path) -> None:
    assert "capacity=" in repr(MemoryEncoderCacheStore())
    assert repr(MemoryKVStore()) == "MemoryKVStore(handles=0)"
    assert "DirectoryKVStore(" in repr(DirectoryKVStore(tmp_path))
    assert "DirectoryEncoderCacheStore(" in repr(DirectoryEncoderCacheStore(tmp_path))
