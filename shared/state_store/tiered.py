"""`TieredStore`: a faster store in front of a larger one, one `StateStore` to its callers.

On CUDA this is host memory (`MemoryStore`, `--hicache-size` GiB) between the device pools and the
persistent store (a directory or Mooncake): a prefix evicted from the GPU comes back from host memory
without touching the disk or the network, and survives a restart through the back store.

Who owns what: the front and the back own their entries; this class owns neither, only the rule that
keeps them consistent. Rules:
- `put` writes the back first, then the front: an entry in the front is always in the back too (as far
  as the back's own eviction allows), so losing the front (a restart) loses nothing stored. A back that
  refuses (`StoreError`) leaves the front unchanged and the error propagates: the caller counts it.
- `get` answers from the front, else from the back, copying what the back answered into the front.
  An answer is whole and checked either way (each backend checks its own).
- `contains` is either's; `delete` and `clear` act on both; `keys` and `size_bytes` are the back's
  (the persistent tier is what the store holds), `capacity_bytes` too.
"""

from __future__ import annotations

import logging

from shared.state_store.store import Buffer, StateStore, StoredEntry

logger = logging.getLogger(__name__)


class TieredStore:
    """`front` (small, fast) in front of `back` (large, persistent); see the module rules."""

    def __init__(self, front: StateStore, back: StateStore) -> None:
        self.front = front
        self.back = back

    @property
    def capacity_bytes(self) -> int:
        return self.back.capacity_bytes

    @property
    def size_bytes(self) -> int:
        return self.back.size_bytes

    def put(self, key: str, payload: Buffer, meta: Buffer = b"") -> None:
        self.back.put(key, payload, meta)
        self.front.put(key, payload, meta)

    def get(self, key: str) -> StoredEntry | None:
        entry = self.front.get(key)
        if entry is not None:
            return entry
        entry = self.back.get(key)
        if entry is not None:
            self.front.put(key, entry.payload, entry.meta)
        return entry

    def contains(self, key: str) -> bool:
        return self.front.contains(key) or self.back.contains(key)

    def delete(self, key: str) -> bool:
        in_front = self.front.delete(key)
        return self.back.delete(key) or in_front

    def keys(self) -> list[str]:
        return self.back.keys()

    def clear(self) -> int:
        self.front.clear()
        return self.back.clear()

    def check_integrity(self) -> None:
        self.front.check_integrity()
        self.back.check_integrity()
