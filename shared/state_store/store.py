"""The interface every state-store backend implements, and what its callers may rely on.

Rules for every backend:
- Keys are 64 lowercase hex characters (`keys.check_key`); any other key is a ValueError.
- `get` never returns bad data: a missing, damaged or foreign entry is None. It raises StoreError only
  when the store itself cannot be read (an I/O error). `contains` is a hint: `get` may still answer
  None (another process may remove an entry at any time); `get` is the authority.
- `put` stores the entry or raises `StoreError`, which means the store is unreachable or cannot be
  written: the caller degrades to memory-only. An entry larger than the whole capacity is not stored
  and not an error (`put` leaves no entry under its key; `contains` is then False); eviction of
  least-recently used entries (put and got count as use, `contains` does not) makes room for the rest.
- Overwriting a key replaces its entry. `keys()` lists what the instance holds, least recently used
  first; `size_bytes <= capacity_bytes` whenever no call is in flight. `clear()` removes every entry
  of the store (its namespace's, whoever wrote them) and returns how many.
- Backends are thread-safe: one thread may put while another gets.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

Buffer = bytes | bytearray | memoryview


class StoreError(Exception):
    """The store is unreachable or cannot be written (full disk, I/O error, removed root)."""


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One entry as stored: the caller's description of the payload (`meta`) and the payload."""

    meta: bytes
    payload: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.meta, bytes) or not isinstance(self.payload, bytes):
            raise TypeError("StoredEntry holds bytes")


@runtime_checkable
class StateStore(Protocol):
    """A bounded key -> (meta, payload) store; see the module rules."""

    @property
    def size_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    def put(self, key: str, payload: Buffer, meta: Buffer = b"") -> None: ...

    def get(self, key: str) -> StoredEntry | None: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def clear(self) -> int: ...

    def check_integrity(self) -> None: ...
