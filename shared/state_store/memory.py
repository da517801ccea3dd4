"""`MemoryStore`: the in-process reference backend (an LRU dict within `capacity_bytes`), for tests of
the tier logic and the shape a host-memory tier takes. Owned by whichever thread set creates it.

Rules: an entry's size is len(meta) + len(payload); the store copies what it is given, so a caller may
reuse its buffers; the module rules of `store.py` hold.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from shared.state_store.keys import check_key
from shared.state_store.store import Buffer, StoredEntry

logger = logging.getLogger(__name__)


class MemoryStore:
    """key -> StoredEntry, least recently used first; `_size` is the sum of the entries' sizes."""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[str, StoredEntry] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def size_bytes(self) -> int:
        return self._size

    @staticmethod
    def _bytes(entry: StoredEntry) -> int:
        return len(entry.meta) + len(entry.payload)

    def put(self, key: str, payload: Buffer, meta: Buffer = b"") -> None:
        check_key(key)
        entry = StoredEntry(meta=bytes(meta), payload=bytes(payload))
        size = self._bytes(entry)
        with self._lock:
            self._drop(key)
            if size > self._capacity:
                logger.debug("entry %s of %d bytes exceeds the capacity %d: not stored", key, size, self._capacity)
                return
            while self._size + size > self._capacity:
                victim = next(iter(self._entries))
                self._drop(victim)
            self._entries[key] = entry
            self._size += size

    def _drop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._size -= self._bytes(entry)
        return True

    def get(self, key: str) -> StoredEntry | None:
        check_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def contains(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return self._drop(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> int:
        with self._lock:
            removed = len(self._entries)
            self._entries.clear()
            self._size = 0
            return removed

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(self._bytes(e) for e in self._entries.values())
            assert total == self._size, f"entries hold {total} bytes, size_bytes says {self._size}"
            assert self._size <= self._capacity, f"size {self._size} > capacity {self._capacity}"
            for key in self._entries:
                check_key(key)
