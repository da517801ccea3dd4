"""The StateStore contract, run against every backend: round trips, LRU order, capacity, overwrite,
empty entries, entries larger than the capacity (not stored, not an error), thread safety."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.state_store import DirectoryStore, MemoryStore, StateStore, StoredEntry
from shared.state_store.entry_file import HEADER_SIZE
from tests.state_store.common import key, namespace

Factory = Callable[[int], StateStore]
PAYLOAD = 100


@pytest.fixture(params=["memory", "directory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Factory, int]:
    """(a factory of stores of a given capacity, the bytes an entry takes beyond meta + payload)."""
    if request.param == "memory":
        return MemoryStore, 0
    return (lambda capacity: DirectoryStore(tmp_path, capacity, namespace())), HEADER_SIZE


def stores_for(backend: tuple[Factory, int], entries: int) -> StateStore:
    factory, overhead = backend
    return factory(entries * (PAYLOAD + overhead))


def payload(n: int, size: int = PAYLOAD) -> bytes:
    return bytes([n % 256]) * size


def test_round_trip(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 4)
    assert isinstance(store, StateStore)
    store.put(key(1), payload(1, 90), meta=b"layout-v1")
    assert store.get(key(1)) == StoredEntry(meta=b"layout-v1", payload=payload(1, 90))
    assert store.contains(key(1)) and not store.contains(key(2))
    assert store.get(key(2)) is None
    assert store.keys() == [key(1)] and store.size_bytes == 99 + backend[1]
    store.check_integrity()
    assert store.delete(key(1)) and not store.delete(key(1))
    assert store.get(key(1)) is None and store.keys() == [] and store.size_bytes == 0
    store.check_integrity()


def test_least_recently_put_or_got_is_evicted_first(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 3)
    for n in (1, 2, 3):
        store.put(key(n), payload(n))
    assert store.get(key(1)) is not None
    assert store.contains(key(2))  # a probe, not a use
    store.put(key(4), payload(4))
    assert store.keys() == [key(3), key(1), key(4)]
    assert store.get(key(2)) is None and not store.contains(key(2))
    assert store.size_bytes == store.capacity_bytes
    store.check_integrity()


def test_overwrite_replaces_the_entry_and_its_size(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 3)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))
    store.put(key(1), payload(9, 40), meta=b"m")
    assert store.get(key(1)) == StoredEntry(meta=b"m", payload=payload(9, 40))
    assert store.keys() == [key(2), key(1)]
    assert store.size_bytes == PAYLOAD + 41 + 2 * backend[1]
    store.check_integrity()


def test_empty_payload_and_meta(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 1)
    store.put(key(1), b"")
    assert store.get(key(1)) == StoredEntry(meta=b"", payload=b"")
    assert store.size_bytes == backend[1]
    store.check_integrity()


def test_an_entry_larger_than_the_capacity_is_not_stored(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 2)
    store.put(key(1), payload(1))
    store.put(key(2), payload(2, 10))
    store.put(key(2), payload(2, 3 * PAYLOAD))  # no error; the old entry of the key is gone too
    assert not store.contains(key(2)) and store.get(key(2)) is None
    assert store.keys() == [key(1)] and store.get(key(1)) == StoredEntry(b"", payload(1))
    store.check_integrity()


def test_buffers_are_copied(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 2)
    data, meta = bytearray(payload(1)), bytearray(b"meta")
    store.put(key(1), memoryview(data), meta=meta)
    data[:] = payload(2)
    meta[:] = b"xxxx"
    assert store.get(key(1)) == StoredEntry(b"meta", payload(1))


def test_keys_must_be_hex(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 1)
    for bad in ("../etc", key(1).upper(), key(1)[:-1], ""):
        with pytest.raises(ValueError):
            store.put(bad, b"x")
        with pytest.raises(ValueError):
            store.get(bad)


def test_one_thread_puts_while_another_gets(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 8)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for n in range(200):
                store.put(key(n), payload(n))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    seen = 0
    while thread.is_alive() or seen == 0:
        for n in range(200):
            entry = store.get(key(n))
            if entry is not None:
                assert entry.payload == payload(n)
                seen += 1
    thread.join()
    assert not errors and seen
    # a get counts as use, so an entry the reader got while the writer evicted it may outlive a later
    # put: the store is full, holds the last put, and every entry it holds reads back whole
    kept = store.keys()
    assert len(kept) == 8 and key(199) in kept
    assert all(store.get(k) is not None for k in kept)
    store.check_integrity()


def test_clear_removes_every_entry(backend: tuple[Factory, int]) -> None:
    store = stores_for(backend, 4)
    for n in range(3):
        store.put(key(n), payload(n))
    assert store.clear() == 3
    assert store.keys() == [] and store.size_bytes == 0
    assert all(store.get(key(n)) is None and not store.contains(key(n)) for n in range(3))
    store.put(key(9), payload(9))
    assert store.get(key(9)) is not None
    store.check_integrity()


def test_directory_clear_removes_what_another_instance_wrote(tmp_path: Path) -> None:
    capacity = 4 * (PAYLOAD + HEADER_SIZE)
    a, b = DirectoryStore(tmp_path, capacity, namespace()), DirectoryStore(tmp_path, capacity, namespace())
    a.put(key(1), payload(1))
    b.put(key(2), payload(2))
    other = DirectoryStore(tmp_path, capacity, namespace(tp_rank=1))
    other.put(key(3), payload(3))
    assert a.clear() == 2
    assert b.get(key(2)) is None and a.get(key(1)) is None
    assert other.get(key(3)) is not None  # another namespace's folder is never touched
