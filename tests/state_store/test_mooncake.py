"""MooncakeStore against a private Mooncake Store (tests/state_store/mooncake_service.py): the StateStore
contract, values outliving the client that put them, damaged and foreign values, namespaces, the
scheduler's probe, and a master that dies and comes back. Skipped where Mooncake cannot run."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.state_store import StateStore, StoredEntry, StoreError, StoreNamespace
from shared.state_store.entry_file import HEADER_SIZE
from shared.state_store.mooncake import MooncakeProbe, MooncakeStore
from tests.state_store import test_contract as contract
from tests.state_store.common import key, namespace
from tests.state_store.mooncake_service import MooncakeService, free_port, mooncake_bin_dir, mooncake_service

PAYLOAD = contract.PAYLOAD
Factory = Callable[..., MooncakeStore]

# The contract, run here against MooncakeStore (the module's `backend` fixture below).
test_round_trip = contract.test_round_trip
test_least_recently_put_or_got_is_evicted_first = contract.test_least_recently_put_or_got_is_evicted_first
test_overwrite_replaces_the_entry_and_its_size = contract.test_overwrite_replaces_the_entry_and_its_size
test_empty_payload_and_meta = contract.test_empty_payload_and_meta
test_an_entry_larger_than_the_capacity_is_not_stored = contract.test_an_entry_larger_than_the_capacity_is_not_stored
test_buffers_are_copied = contract.test_buffers_are_copied
test_keys_must_be_hex = contract.test_keys_must_be_hex
test_one_thread_puts_while_another_gets = contract.test_one_thread_puts_while_another_gets
test_clear_removes_every_entry = contract.test_clear_removes_every_entry


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeService]:
    with mooncake_service(tmp_path_factory.mktemp("mooncake")) as s:
        yield s


@pytest.fixture
def ns() -> StoreNamespace:
    """A namespace of this test alone (the service is shared by the module's tests)."""
    return namespace(weights=f"rev-{uuid.uuid4().hex}")


@pytest.fixture
def stores(service: MooncakeService, ns: StoreNamespace) -> Iterator[Factory]:
    """MooncakeStore(capacity, namespace=ns, **kwargs) on the service; closed after the test."""
    made: list[MooncakeStore] = []

    def make(capacity: int, namespace: StoreNamespace = ns, **kwargs: object) -> MooncakeStore:
        made.append(MooncakeStore(service.master_address, capacity, namespace, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for store in made:
        store.close()


@pytest.fixture
def backend(stores: Factory) -> tuple[Callable[[int], StateStore], int]:
    return stores, HEADER_SIZE


def capacity(entries: int) -> int:
    return entries * (PAYLOAD + HEADER_SIZE)


def payload(n: int, size: int = PAYLOAD) -> bytes:
    return bytes([n % 256]) * size


def test_entries_outlive_the_client_that_put_them(stores: Factory, service: MooncakeService) -> None:
    first = stores(capacity(4))
    for n in range(3):
        first.put(key(n), payload(n), meta=b"m")
    first.close()  # as a server that stops: the values live in the standalone client's segment
    second = stores(capacity(4))
    assert second.keys() == [] and second.contains(key(0))
    assert second.get(key(2)) == StoredEntry(b"m", payload(2)) and second.get(key(0)) == StoredEntry(b"m", payload(0))
    assert second.keys() == [key(2), key(0)] and second.size_bytes == 2 * (PAYLOAD + 1 + HEADER_SIZE)
    second.check_integrity()


def test_a_damaged_or_foreign_value_is_none_and_removed(stores: Factory, service: MooncakeService) -> None:
    store = stores(capacity(4))
    store.put(key(1), payload(1))
    with service.raw_client() as raw:
        good = raw.get(store.mooncake_key(key(1)))
        flipped = bytearray(good)
        flipped[-1] ^= 1
        damaged = {key(2): b"not an entry", key(3): good, key(4): good[:-1], key(5): bytes(flipped)}
        for k, value in damaged.items():  # garbage, another key's value, truncated, a flipped payload bit
            assert raw.upsert(store.mooncake_key(k), value) == 0
        for k in damaged:
            assert store.contains(k) and store.get(k) is None
            assert raw.is_exist(store.mooncake_key(k)) == 0
        assert store.get(key(1)) == StoredEntry(b"", payload(1))
    assert store.keys() == [key(1)]
    store.check_integrity()


def test_another_namespace_is_invisible(stores: Factory) -> None:
    mine, other = stores(capacity(4)), stores(capacity(4), namespace=namespace(tp_rank=1,
                                                                              weights=f"rev-{uuid.uuid4().hex}"))
    mine.put(key(1), payload(1))
    assert not other.contains(key(1)) and other.get(key(1)) is None
    other.put(key(2), payload(2))
    assert other.clear() == 1
    assert mine.get(key(1)) == StoredEntry(b"", payload(1))


def test_clear_removes_what_another_instance_wrote(stores: Factory) -> None:
    a, b = stores(capacity(4)), stores(capacity(4))
    a.put(key(1), payload(1))
    b.put(key(2), payload(2))
    assert a.clear() == 2
    assert a.get(key(1)) is None and b.get(key(2)) is None and b.keys() == []


def test_the_probe_sees_its_namespace(stores: Factory, service: MooncakeService, ns: StoreNamespace) -> None:
    store = stores(capacity(4))
    store.put(key(1), payload(1))
    probe, other = MooncakeProbe(service.master_address, ns), MooncakeProbe(service.master_address, namespace())
    try:
        assert probe.contains(key(1)) and not probe.contains(key(2)) and not other.contains(key(1))
        assert probe.contains_many([key(1), key(2)]) == [True, False] and probe.contains_many([]) == []
        with pytest.raises(ValueError):
            probe.contains("nope")
    finally:
        probe.close()
        other.close()


def test_several_threads_put_get_and_probe(stores: Factory) -> None:
    store = stores(capacity(16))
    errors: list[BaseException] = []

    def work(first: int) -> None:
        try:
            for n in range(first, first + 60):
                store.put(key(n), payload(n))
                for m in (n, n - 1, n - 30):
                    entry = store.get(key(m))
                    assert entry is None or entry.payload == payload(m)
                store.contains(key(n - 2))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i * 1000,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(store.keys()) == 16 and all(store.get(k) is not None for k in store.keys())
    store.check_integrity()


def test_an_entry_larger_than_the_transfer_buffer_is_an_error(stores: Factory) -> None:
    store = stores(8 << 20, buffer_bytes=1 << 20)
    with pytest.raises(StoreError, match="buffer_bytes"):
        store.put(key(1), bytes(2 << 20))
    store.put(key(2), bytes(512 << 10))
    assert store.get(key(2)) == StoredEntry(b"", bytes(512 << 10))


def test_no_master_is_a_store_error_at_once() -> None:
    mooncake_bin_dir()  # skips without Mooncake
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        MooncakeStore(f"127.0.0.1:{free_port()}", 1 << 20, namespace())
    assert time.monotonic() - t0 < 5


def test_without_mooncake_construction_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as where it is not installed
    with pytest.raises(StoreError) as raised:
        MooncakeStore("127.0.0.1:1", 1 << 20, namespace())
    assert "mooncake-transfer-engine-non-cuda" in str(raised.value) and "libibverbs1" in str(raised.value)


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except StoreError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def test_a_dead_master_is_a_store_error_and_a_restarted_one_serves(tmp_path: Path, ns: StoreNamespace) -> None:
    with mooncake_service(tmp_path) as service:
        store = MooncakeStore(service.master_address, capacity(8), ns)
        probe = MooncakeProbe(service.master_address, ns)
        try:
            store.put(key(1), payload(1))
            assert probe.contains(key(1))
            service.kill_master()
            t0 = time.monotonic()
            with pytest.raises(StoreError):
                store.put(key(2), payload(2))
            with pytest.raises(StoreError):  # the first call to find the master gone may take the client's retries
                store.put(key(3), payload(3))
            first = time.monotonic() - t0
            t0 = time.monotonic()
            with pytest.raises(StoreError):  # now at once
                store.put(key(4), payload(4))
            with pytest.raises(StoreError):
                store.get(key(1))
            with pytest.raises(StoreError):
                store.contains(key(1))
            assert not probe.contains(key(1))
            assert not probe.contains(key(1))
            later = time.monotonic() - t0
            assert first < 15 and later < 6, (first, later)

            service.start_master()  # empty: Mooncake's metadata is in the master's memory
            service.wait_for_segment()
            fresh = MooncakeStore(service.master_address, capacity(8), ns)
            try:
                fresh.put(key(5), payload(5))
                assert fresh.get(key(5)) == StoredEntry(b"", payload(5))
            finally:
                fresh.close()
            eventually(lambda: store.put(key(6), payload(6)) is None)  # the old clients reconnect too
            assert store.get(key(6)) == StoredEntry(b"", payload(6)) and store.get(key(1)) is None
            eventually(lambda: probe.contains(key(6)))  # once its lookup stuck on the dead master returns
        finally:
            store.close()
            probe.close()
