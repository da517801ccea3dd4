"""The persistent state store: content-addressed entries (a prefix block's KV pages and recurrent-state
checkpoint, serialized by the caller) that any process can read back and that survive restarts and
crashes. Pure Python, no torch. The worker writes and loads entries (worker_proc/state/store_tier.py), the
scheduler decides which (scheduler_proc/store_tier.py). Backends: a directory, and Mooncake Store
(`mooncake.py`, imported only when used); `backends.py` picks one from the flags."""

from shared.state_store.directory import DirectoryProbe, DirectoryStore
from shared.state_store.keys import FORMAT_VERSION, StoreNamespace, block_key, chain_keys, config_fingerprint, root_key
from shared.state_store.memory import MemoryStore
from shared.state_store.store import StateStore, StoredEntry, StoreError

__all__ = [
    "FORMAT_VERSION",
    "DirectoryProbe",
    "DirectoryStore",
    "MemoryStore",
    "StateStore",
    "StoreError",
    "StoreNamespace",
    "StoredEntry",
    "block_key",
    "chain_keys",
    "config_fingerprint",
    "root_key",
]
