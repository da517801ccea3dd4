"""DirectoryStore beyond the contract: restarts, the layout, the scan, and instances sharing a root."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from shared.state_store import DirectoryStore, StoredEntry, StoreError
from shared.state_store.entry_file import HEADER_SIZE, TMP_PREFIX
from shared.state_store.keys import FORMAT_VERSION
from tests.state_store.common import key, namespace

ENTRY = HEADER_SIZE + 100


def entry_bytes(n: int) -> bytes:
    return bytes([n % 256]) * 100


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_entries_live_in_the_namespace_folder_under_their_key(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    store.put(key(1), entry_bytes(1))
    digest = namespace().digest
    assert files_under(tmp_path) == sorted([f"{digest}/{key(1)[:2]}/{key(1)}", f"{digest}/namespace.json"])
    assert json.loads((tmp_path / digest / "namespace.json").read_text()) == namespace().fields()
    assert os.path.getsize(store.path(key(1))) == ENTRY


def test_a_new_instance_finds_every_entry_in_recency_order(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    for n in range(4):
        store.put(key(n), entry_bytes(n), meta=b"m%d" % n)
    for n, when in ((0, 4), (1, 1), (2, 3), (3, 2)):  # recency as the files record it
        os.utime(store.path(key(n)), ns=(when * 10**9, when * 10**9))
    again = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    assert again.keys() == [key(1), key(3), key(2), key(0)]
    assert again.size_bytes == store.size_bytes
    again.check_integrity()
    assert again.get(key(1)) == StoredEntry(b"m1", entry_bytes(1))
    assert os.stat(again.path(key(1))).st_mtime_ns > 4 * 10**9  # a get is recorded for the next restart
    assert DirectoryStore(tmp_path, 10 * ENTRY, namespace()).keys()[-1] == key(1)


def test_a_restart_with_less_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    for n in range(4):
        store.put(key(n), entry_bytes(n))
        os.utime(store.path(key(n)), ns=(n * 10**9, n * 10**9))
    small = DirectoryStore(tmp_path, 2 * ENTRY, namespace())
    assert small.keys() == [key(2), key(3)]
    assert not os.path.exists(store.path(key(0))) and not os.path.exists(store.path(key(1)))
    small.check_integrity()


def test_the_scan_removes_abandoned_temporary_files_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    store.put(key(1), entry_bytes(1))
    sub = Path(store.path(key(1))).parent
    abandoned = sub / f"{TMP_PREFIX}{key(2)}.1.1.0"
    abandoned.write_bytes(b"half an entry")
    in_use = sub / f"{TMP_PREFIX}{key(3)}.1.1.0"
    in_use.write_bytes(b"being written")
    stranger = sub / "notes.txt"
    stranger.write_bytes(b"not ours")
    with open(in_use, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        with caplog.at_level(logging.INFO, logger="shared.state_store"):
            again = DirectoryStore(tmp_path, 10 * ENTRY, namespace(), scan_log_every=2)
    assert not abandoned.exists() and in_use.exists() and stranger.exists()
    assert again.keys() == [key(1)]
    assert "interrupted write" in caplog.text and "scanned 2 files" in caplog.text


def test_a_second_instance_reads_what_the_first_wrote(tmp_path: Path) -> None:
    first = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    second = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    first.put(key(1), entry_bytes(1), meta=b"m")
    assert second.keys() == [] and second.contains(key(1))
    assert second.get(key(1)) == StoredEntry(b"m", entry_bytes(1))  # read though it was not indexed
    assert second.keys() == [key(1)] and second.size_bytes == ENTRY + 1
    second.check_integrity()
    assert DirectoryStore(tmp_path, 10 * ENTRY, namespace()).keys() == [key(1)]


def test_an_entry_evicted_by_another_instance_is_none(tmp_path: Path) -> None:
    first = DirectoryStore(tmp_path, 2 * ENTRY, namespace())
    second = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    first.put(key(1), entry_bytes(1))
    first.put(key(2), entry_bytes(2))
    assert second.get(key(1)) is not None and second.get(key(2)) is not None
    first.put(key(3), entry_bytes(3))  # evicts key(1), which the second instance indexed
    assert second.contains(key(2)) and not second.contains(key(1))
    assert second.get(key(1)) is None
    first.delete(key(2))
    assert second.get(key(2)) is None
    assert second.keys() == [] and second.size_bytes == 0
    second.check_integrity()


def test_a_get_of_an_unindexed_entry_keeps_the_capacity(tmp_path: Path) -> None:
    big = DirectoryStore(tmp_path, 10 * ENTRY, namespace())
    small = DirectoryStore(tmp_path, 2 * ENTRY, namespace())
    for n in range(3):
        big.put(key(n), entry_bytes(n))
        assert small.get(key(n)) is not None
    assert small.keys() == [key(1), key(2)] and small.size_bytes == 2 * ENTRY
    small.check_integrity()


def test_a_removed_root_is_a_store_error(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "store", 10 * ENTRY, namespace())
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(StoreError):
        store.put(key(1), entry_bytes(1))
    assert not (tmp_path / "store").exists()  # never silently recreated
    assert store.get(key(1)) is None and store.keys() == []


def test_an_unusable_root_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError):
        DirectoryStore(tmp_path / "file", ENTRY, namespace())


def test_a_namespace_of_another_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        DirectoryStore(tmp_path, ENTRY, namespace(format_version=FORMAT_VERSION + 1))
