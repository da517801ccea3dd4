"""The worker's side of the state store: what one rank writes to it and loads back from it.

Owns this rank's store backend (`shared/state_store`), its background writer and the entry layout
of its slice of the pools. The scheduler owns every decision (which blocks and states to write, which
to load into which slots, docs/architecture.md "State store"); the rank only moves bytes.

Rules:
- A batch's writes are read from the pools before anything of the batch runs (`StoreTier.serve`
  is called before the step): the slots named hold what the scheduler saw when it built the batch.
  The bytes are copied out at once; serializing and writing them happens on the writer thread.
- The writer's queue is bounded in bytes (--state-cache-write-queue-mb); a write that does not fit is
  dropped and counted, never waited for. A store error is counted and logged once per outage; the
  next write that works ends the outage. No store error ever fails a step.
- A load reads every entry it names and checks its meta (kind, tensor shapes and dtypes of this
  rank's pools) on the loader's thread before any slot is written (`state_loader.py`); an entry that
  is missing, damaged or of another layout fails the load as a whole (the scheduler then computes
  the prefix).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from shared.config import ServerArgs
from shared.messages import ForwardBatch, StoreStats, StoreWrite
from shared.model_info import read_config_json
from shared.state_store import StateStore, StoreError, StoreNamespace, config_fingerprint
from shared.state_store.backends import open_store
from shared.state_store.keys import canonical_json
from worker_proc.loading.weight_files import weight_files
from worker_proc.state.pools import StatePools
from worker_proc.state.store_loader import LoadLayout, StoreLoader
from worker_proc.state.store_writer import StoreWriter, WriteJob, byte_size, flat_bytes

logger = logging.getLogger(__name__)

SAMPLE_WHOLE_BYTES = 256 << 20
SAMPLE_STRIDE = 64 << 20
SAMPLE_BYTES = 1 << 20


def weights_fingerprint(model_dir: str) -> str:
    """sha256 over every weight file's name, size and content: the whole file up to 256 MiB, else
    1 MiB of every 64 MiB and the last MiB (enough to tell two checkpoints apart without reading
    tens of GB at every start)."""
    digest = hashlib.sha256()
    for path in sorted(weight_files(model_dir)):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size};".encode())
        with open(path, "rb") as f:
            if size <= SAMPLE_WHOLE_BYTES:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
                continue
            for offset in [*range(0, size, SAMPLE_STRIDE), max(0, size - SAMPLE_BYTES)]:
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def store_namespace(args: ServerArgs, dtype: torch.dtype, numerics: str, rank: int) -> StoreNamespace:
    """Everything this rank's stored states depend on."""
    model_dir = args.resolved_model_path
    return StoreNamespace(
        model_config=config_fingerprint(read_config_json(model_dir)),
        weights=weights_fingerprint(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        quantization=args.quantization,
        state_dtype=args.mamba_ssm_dtype,
        tp_size=args.tp_size,
        tp_rank=rank,
        numerics=numerics,
    )


@dataclass(frozen=True)
class EntryLayout:
    """The meta of this rank's entries: a KV block ([pools, layers, block, heads, dim]: each of
    `StatePools.kv_pools`, K and V or K alone for MLA, of every attention layer, `block` tokens) and a
    state (every state tensor of one slot). An entry is loaded only when its meta is exactly
    this rank's."""

    kv_meta: bytes
    kv_bytes: int
    state_meta: bytes
    state_bytes: int

    @staticmethod
    def of(pools: StatePools, block: int) -> EntryLayout:
        k, n = pools.k, len(pools.kv_pools)
        kv_shape = [n, k.shape[0], block, *k.shape[2:]]
        kv_bytes = n * block * k[:, :1].numel() * k.element_size()  # 0 without attention layers
        tensors = [[name, list(t.shape[:1]) + list(t.shape[2:]), str(t.dtype).removeprefix("torch.")]
                   for name, t in pools.states.items()]
        state_bytes = sum(t[:, 0].numel() * t.element_size() for t in pools.states.values())
        kv_meta = canonical_json({"kind": "kv", "shape": kv_shape, "dtype": str(k.dtype).removeprefix("torch.")})
        return EntryLayout(kv_meta, kv_bytes, canonical_json({"kind": "state", "tensors": tensors}), state_bytes)


class StoreTier:
    """One rank's store, its writer and its entry layout (see the module rules)."""

    def __init__(self, store: StateStore, pools: StatePools, block: int, queue_bytes: int) -> None:
        self.store = store
        self.pools = pools
        self.block = block
        self.layout = EntryLayout.of(pools, block)
        self.has_kv = pools.k.shape[0] > 0
        self.stats = StoreStats(capacity_bytes=store.capacity_bytes, size_bytes=store.size_bytes)
        self.writer = StoreWriter(store, queue_bytes, self.stats)
        lay = self.layout
        self.loader = StoreLoader(pools, LoadLayout(lay.kv_meta, lay.kv_bytes, lay.state_meta, lay.state_bytes, block),
                                  self._read, self._loaded)

    @staticmethod
    def open(args: ServerArgs, namespace: StoreNamespace, pools: StatePools) -> StoreTier:
        store = open_store(args, namespace)
        logger.info("state store (%s): %d entries, %.1f of %.1f GiB", args.hicache_storage_backend,
                    len(store.keys()), store.size_bytes / 2**30, store.capacity_bytes / 2**30)
        return StoreTier(store, pools, args.state_cache_block_tokens, args.state_cache_write_queue_mb << 20)

    # ------------------------------------------------------------------ one batch
    def serve(self, batch: ForwardBatch) -> None:
        """The batch's writes (copied out now, written in the background), its clear, then its new
        loads (read in the background: `loader.states` / `loader.settle` each step)."""
        for w in batch.store_writes:
            self._write(w)
        if batch.store_clear:
            self.clear()
        for load in batch.store_loads:
            self.loader.submit(load)

    def _loaded(self, seconds: float) -> None:
        with self.writer.lock:
            self.stats.load_seconds.append(seconds)

    def clear(self) -> None:
        """Empty the store: the queued writes finish first, then every entry of this namespace goes."""
        self.writer.flush(600.0)
        removed = self.store.clear()
        logger.info("state store emptied: %d entries removed", removed)

    def _write(self, w: StoreWrite) -> None:
        b, lay, entries = self.block, self.layout, []
        if len(w.kv_slots) != b * len(w.kv_keys):
            raise ValueError(f"a store write of {len(w.kv_keys)} blocks names {len(w.kv_slots)} KV slots")
        if w.kv_keys and self.has_kv:
            k, pools = self.pools.k, self.pools.kv_pools
            slots = torch.tensor(w.kv_slots, dtype=torch.long, device=k.device)
            kv = torch.empty((len(pools), k.shape[0], len(w.kv_slots), *k.shape[2:]), dtype=k.dtype,
                             device=k.device)  # fmt: skip
            for i, pool in enumerate(pools):
                torch.index_select(pool, 1, slots, out=kv[i])
            kv = kv.cpu()  # one copy out of the pools; each block made contiguous on the writer's thread
            for i, key in enumerate(w.kv_keys):
                entries.append((key, lay.kv_meta, kv[:, :, i * b:(i + 1) * b]))
        if w.state_key:
            parts = [flat_bytes(t[:, w.state_slot].cpu()) for t in self.pools.states.values()]
            entries.append((w.state_key, lay.state_meta, torch.cat(parts)))
        if entries:
            self.writer.submit(WriteJob(entries, sum(byte_size(p) for _, _, p in entries)))

    def _read(self, key: str, meta: bytes, nbytes: int) -> torch.Tensor | None:
        if (queued := self.writer.queued(key)) is not None:
            queued_meta, payload = queued
            if queued_meta == meta and payload.numel() == nbytes:
                return payload
        try:
            entry = self.store.get(key)
        except StoreError as e:
            logger.warning("state store read of %s failed: %s", key, e)
            entry = None
        with self.writer.lock:
            if entry is None or entry.meta != meta or len(entry.payload) != nbytes:
                self.stats.read_errors += 1
            else:
                self.stats.entries_read += 1
                self.stats.bytes_read += nbytes
        if entry is None or entry.meta != meta or len(entry.payload) != nbytes:
            if entry is not None:
                logger.warning("state store entry %s has another layout than this rank's pools; not loaded", key)
            return None
        return torch.frombuffer(bytearray(entry.payload), dtype=torch.uint8)

    def take_stats(self) -> StoreStats:
        return self.writer.take_stats(self.store.size_bytes)

    def close(self, timeout: float) -> None:
        """Finish the queued writes (up to `timeout` seconds), then stop the writer."""
        self.loader.close()
        if not self.writer.flush(timeout):
            logger.warning("state store: writes still queued after %.0f s are lost", timeout)
        self.writer.close()


def namespace_json(namespace: StoreNamespace) -> str:
    """The canonical JSON of a namespace's fields (WorkerReady.store_namespace)."""
    return canonical_json(namespace.fields()).decode()
