"""Which state store backend a server uses, from its flags: the directory (`--state-cache-dir`, the
default `--hicache-storage-backend file`) or Mooncake Store (`--hicache-storage-backend mooncake` with
`--hicache-storage-backend-extra-config '{"master_server_address": "HOST:PORT", ...}'`).

A worker rank opens the store of its own namespace (`open_store`); the scheduler opens a probe of rank
0's namespace for its lookups (`open_probe`), a hint that never raises (False when it cannot tell).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shared.config import ServerArgs
from shared.state_store.directory import DirectoryProbe, DirectoryStore
from shared.state_store.keys import StoreNamespace
from shared.state_store.memory import MemoryStore
from shared.state_store.store import StateStore
from shared.state_store.tiered import TieredStore

logger = logging.getLogger(__name__)

MOONCAKE_ARGS = {"local_hostname": "local_hostname", "protocol": "protocol", "global_segment_size": "segment_bytes",
                 "local_buffer_size": "buffer_bytes"}
"""--hicache-storage-backend-extra-config keys (SGLang's names) -> MooncakeStore's arguments."""


def capacity_bytes(args: ServerArgs) -> int:
    return int(args.state_cache_size_gb * (1 << 30))


def open_store(args: ServerArgs, namespace: StoreNamespace) -> StateStore:
    """This rank's store, behind `--hicache-size` GiB of host memory when given (`TieredStore`); raises
    StoreError when it cannot be opened."""
    back = _open_back(args, namespace)
    if args.hicache_size > 0:
        return TieredStore(MemoryStore(int(args.hicache_size * (1 << 30))), back)
    return back


def _open_back(args: ServerArgs, namespace: StoreNamespace) -> StateStore:
    if args.hicache_storage_backend == "mooncake":
        from shared.state_store.mooncake import MooncakeStore

        extra = args.store_extra_config()
        kw = {MOONCAKE_ARGS[k]: v for k, v in extra.items() if k in MOONCAKE_ARGS}
        return MooncakeStore(str(extra["master_server_address"]), capacity_bytes(args), namespace, **kw)  # type: ignore[arg-type]
    return DirectoryStore(args.state_cache_dir, capacity_bytes(args), namespace)


def open_probe(args: ServerArgs, namespace: StoreNamespace) -> Callable[[str], bool]:
    """`contains` for the scheduler's lookups in `namespace` (rank 0's); raises StoreError when the
    backend cannot be reached at all."""
    if args.hicache_storage_backend == "mooncake":
        from shared.state_store.mooncake import MooncakeProbe

        extra = args.store_extra_config()
        probe = MooncakeProbe(str(extra["master_server_address"]), namespace,
                              local_hostname=str(extra.get("local_hostname", "127.0.0.1")),
                              protocol=str(extra.get("protocol", "tcp")))
        return probe.contains
    directory = DirectoryProbe(args.state_cache_dir, namespace)

    def contains(key: str) -> bool:
        try:
            return directory.contains(key)
        except OSError as e:
            logger.warning("state store lookup failed: %s", e)
            return False

    return contains
