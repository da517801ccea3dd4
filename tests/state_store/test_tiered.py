"""TieredStore: host memory in front of the persistent store, one StateStore to its callers."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import ServerArgs
from shared.state_store import DirectoryStore, MemoryStore, StoredEntry, StoreError
from shared.state_store.backends import open_store
from shared.state_store.tiered import TieredStore
from tests.state_store.common import key, namespace


class Refusing(MemoryStore):
    def put(self, key: str, payload: object, meta: object = b"") -> None:  # type: ignore[override]
        raise StoreError("disk full")


def test_writes_go_to_both_and_reads_come_from_the_front_first(tmp_path: Path) -> None:
    front, back = MemoryStore(1 << 20), DirectoryStore(tmp_path, 1 << 20, namespace())
    store = TieredStore(front, back)
    store.put(key(1), b"payload", b"meta")
    assert front.contains(key(1)) and back.contains(key(1))
    back.delete(key(1))  # the front still answers
    assert store.get(key(1)) == StoredEntry(meta=b"meta", payload=b"payload")
    assert store.keys() == [] and store.size_bytes == 0  # the persistent tier is what the store holds
    store.check_integrity()


def test_a_restart_loses_the_front_not_the_entries(tmp_path: Path) -> None:
    TieredStore(MemoryStore(1 << 20), DirectoryStore(tmp_path, 1 << 20, namespace())).put(key(2), b"x" * 64)
    front = MemoryStore(1 << 20)
    store = TieredStore(front, DirectoryStore(tmp_path, 1 << 20, namespace()))
    assert not front.contains(key(2)) and store.contains(key(2))
    assert store.get(key(2)) is not None and front.contains(key(2))  # promoted by the read


def test_a_back_that_refuses_leaves_the_front_unchanged() -> None:
    front = MemoryStore(1 << 20)
    store = TieredStore(front, Refusing(1 << 20))
    with pytest.raises(StoreError):
        store.put(key(3), b"x")
    assert not front.contains(key(3)) and store.get(key(3)) is None


def test_delete_and_clear_act_on_both(tmp_path: Path) -> None:
    front, back = MemoryStore(1 << 20), DirectoryStore(tmp_path, 1 << 20, namespace())
    store = TieredStore(front, back)
    for n in range(3):
        store.put(key(n), b"x")
    assert store.delete(key(0)) and not front.contains(key(0)) and not back.contains(key(0))
    assert store.clear() == 2 and front.keys() == [] and back.keys() == []


def test_hicache_size_puts_host_memory_in_front(tmp_path: Path) -> None:
    plain = open_store(ServerArgs(state_cache_dir=str(tmp_path)), namespace())
    tiered = open_store(ServerArgs(state_cache_dir=str(tmp_path), hicache_size=0.5), namespace())
    assert isinstance(plain, DirectoryStore)
    assert isinstance(tiered, TieredStore) and tiered.front.capacity_bytes == 1 << 29
