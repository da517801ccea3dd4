"""Damaged, foreign and unwritable entries of a DirectoryStore: each is detected, logged, removed and
answered None (a failed write: StoreError and no temporary file), and the store goes on working."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.state_store import DirectoryStore, StoredEntry, StoreError
from shared.state_store.entry_file import HEADER_SIZE, TMP_PREFIX
from tests.state_store.common import key, namespace

CAPACITY = 10 * (HEADER_SIZE + 1000)
PAYLOAD = bytes(range(256)) * 4


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 7)


def flip(offset: int) -> Callable[[str], None]:
    def damage(path: str) -> None:
        data = bytearray(Path(path).read_bytes())
        data[offset] ^= 0x40
        Path(path).write_bytes(bytes(data))
    return damage


def set_version(version: int) -> Callable[[str], None]:
    """Another format version under a header that is otherwise whole (its own checksum matches)."""
    def damage(path: str) -> None:
        data = bytearray(Path(path).read_bytes())
        struct.pack_into("<I", data, 8, version)
        struct.pack_into("<I", data, HEADER_SIZE - 4, zlib.crc32(bytes(data[:HEADER_SIZE - 4])))
        Path(path).write_bytes(bytes(data))
    return damage


DAMAGES: dict[str, tuple[Callable[[str], None], str]] = {
    "truncated": (truncate, "the header says"),
    "payload byte": (flip(HEADER_SIZE + 4 + 500), "payload checksum mismatch"),
    "meta byte": (flip(HEADER_SIZE + 1), "payload checksum mismatch"),
    "header length byte": (flip(80), "header checksum mismatch"),
    "header key byte": (flip(50), "header checksum mismatch"),
    "magic": (flip(0), "bad magic"),
    "older version": (set_version(0), "format version 0"),
    "newer version": (set_version(7), "format version 7"),
    "empty file": (lambda path: os.truncate(path, 0), "truncated header"),
}


def filled(root: Path) -> DirectoryStore:
    store = DirectoryStore(root, CAPACITY, namespace())
    for n in range(3):
        store.put(key(n), PAYLOAD, meta=b"meta")
    return store


def still_works(store: DirectoryStore, damaged: str) -> None:
    assert damaged not in store.keys()
    assert not os.path.exists(store.path(damaged))
    assert store.get(key(2)) == StoredEntry(b"meta", PAYLOAD)
    store.put(key(9), PAYLOAD)
    assert store.get(key(9)) == StoredEntry(b"", PAYLOAD)
    store.check_integrity()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_entry_is_none_on_get(damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = filled(tmp_path)
    apply, reason = DAMAGES[damage]
    apply(store.path(key(1)))
    with caplog.at_level(logging.WARNING, logger="shared.state_store"):
        assert store.get(key(1)) is None
        assert store.get(key(1)) is None  # gone: the second get has nothing to report
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and key(1) in messages[0] and reason in messages[0]
    still_works(store, key(1))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_header_is_removed_by_the_scan(damage: str, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    store = filled(tmp_path)
    apply, reason = DAMAGES[damage]
    apply(store.path(key(1)))
    with caplog.at_level(logging.WARNING, logger="shared.state_store"):
        again = DirectoryStore(tmp_path, CAPACITY, namespace())
    if "checksum mismatch" in reason and "header" not in reason:
        assert sorted(again.keys()) == sorted([key(0), key(1), key(2)])  # headers only: the get finds it
        assert again.get(key(1)) is None
    else:
        assert sorted(again.keys()) == sorted([key(0), key(2)])
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1
    still_works(again, key(1))


def test_a_file_under_another_keys_name_is_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = filled(tmp_path)
    os.makedirs(os.path.dirname(store.path(key(7))), exist_ok=True)
    os.rename(store.path(key(1)), store.path(key(7)))
    with caplog.at_level(logging.WARNING, logger="shared.state_store"):
        assert store.get(key(7)) is None
        assert store.get(key(1)) is None
    assert len([r for r in caplog.records if f"names key {key(1)}" in r.getMessage()]) == 1
    assert not os.path.exists(store.path(key(7)))
    still_works(store, key(1))


def test_an_entry_of_another_namespace_is_none(tmp_path: Path) -> None:
    store = filled(tmp_path)
    other = DirectoryStore(tmp_path, CAPACITY, namespace(tp_rank=1))
    other.put(key(5), PAYLOAD)
    os.makedirs(os.path.dirname(store.path(key(5))), exist_ok=True)
    shutil.copy(other.path(key(5)), store.path(key(5)))
    assert store.get(key(5)) is None and not os.path.exists(store.path(key(5)))
    assert other.get(key(5)) == StoredEntry(b"", PAYLOAD)


def test_a_foreign_namespace_folder_is_never_read_or_touched(tmp_path: Path) -> None:
    foreign = DirectoryStore(tmp_path, CAPACITY, namespace(weights="rev-2"))
    foreign.put(key(1), PAYLOAD)
    junk = Path(foreign.folder) / key(3)[:2] / key(3)
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"damaged, but not ours")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(foreign.folder).rglob("*") if p.is_file()}
    store = DirectoryStore(tmp_path, CAPACITY, namespace())
    assert store.keys() == [] and store.get(key(1)) is None and store.get(key(3)) is None
    store.put(key(2), PAYLOAD)
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(foreign.folder).rglob("*") if p.is_file()}
    assert after == before


def temp_files(store: DirectoryStore) -> list[Path]:
    return [p for p in Path(store.folder).rglob(f"{TMP_PREFIX}*")]


@pytest.mark.parametrize("call", ["write", "fsync"])
def test_a_full_disk_is_a_store_error_and_leaves_no_temporary_file(call: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = filled(tmp_path)
    real = getattr(os, call)
    calls = []

    def failing(fd: int, *args: object) -> object:
        if TMP_PREFIX in os.readlink(f"/proc/self/fd/{fd}"):
            calls.append(fd)
            if call == "fsync" or len(calls) > 1:  # a write fails after the first one went through
                raise OSError(errno.ENOSPC if call == "write" else errno.EIO, "simulated")
        return real(fd, *args)

    with monkeypatch.context() as patch:
        patch.setattr(os, call, failing)
        with pytest.raises(StoreError):
            store.put(key(5), PAYLOAD, meta=b"meta")
    assert len(calls) == (2 if call == "write" else 1) and temp_files(store) == []
    assert not store.contains(key(5)) and store.get(key(5)) is None and key(5) not in store.keys()
    assert store.get(key(0)) == StoredEntry(b"meta", PAYLOAD)
    still_works(store, key(5))


def test_an_unreadable_store_is_a_store_error_on_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = filled(tmp_path)

    def failing(fd: int) -> os.stat_result:
        raise OSError(errno.EIO, "simulated")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fstat", failing)
        with pytest.raises(StoreError):
            store.get(key(1))
    assert store.get(key(1)) == StoredEntry(b"meta", PAYLOAD)  # an I/O error is not damage: nothing removed
