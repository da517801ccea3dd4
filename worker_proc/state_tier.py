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
  rank's pools) before it writes any slot; an entry that is missing, damaged or of another layout
  fails the load as a whole (the scheduler then computes the prefix).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from shared.config import ServerArgs
from shared.messages import ForwardBatch, StoreLoad, StoreStats, StoreWrite
from shared.model_info import read_config_json
from shared.state_store import DirectoryStore, StateStore, StoreError, StoreNamespace, config_fingerprint
from shared.state_store.keys import canonical_json
from worker_proc.pools import StatePools
from worker_proc.weight_files import weight_files

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
    """The meta of this rank's entries: a KV block (K and V of every attention layer, `block` tokens)
    and a state (every state tensor of one slot). An entry is loaded only when its meta is exactly
    this rank's."""

    kv_meta: bytes
    kv_bytes: int
    state_meta: bytes
    state_bytes: int

    @staticmethod
    def of(pools: StatePools, block: int) -> EntryLayout:
        k = pools.k
        kv_shape = [2, k.shape[0], block, *k.shape[2:]]
        kv_bytes = 2 * k.shape[0] * block * k[0, 0].numel() * k.element_size()
        tensors = [[name, list(t.shape[:1]) + list(t.shape[2:]), str(t.dtype).removeprefix("torch.")]
                   for name, t in pools.states.items()]
        state_bytes = sum(t[:, 0].numel() * t.element_size() for t in pools.states.values())
        kv_meta = canonical_json({"kind": "kv", "shape": kv_shape, "dtype": str(k.dtype).removeprefix("torch.")})
        return EntryLayout(kv_meta, kv_bytes, canonical_json({"kind": "state", "tensors": tensors}), state_bytes)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class _Job:
    """One write's bytes, copied out of the pools: [(key, meta, payload)]."""

    entries: list[tuple[str, bytes, torch.Tensor]]
    nbytes: int


class StoreWriter:
    """The background thread that puts entries into the store, behind a queue bounded in bytes."""

    def __init__(self, store: StateStore, limit_bytes: int, stats: StoreStats) -> None:
        self.store = store
        self.limit = limit_bytes
        self.stats = stats
        self._pending = 0
        self._queued: dict[str, tuple[bytes, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.lock = self._lock  # guards `stats`, which the loads of the step's thread update too
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="state-store-writer", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> bool:
        with self._lock:
            if self._pending + job.nbytes > self.limit:
                self.stats.write_drops += len(job.entries)
                return False
            self._pending += job.nbytes
            for key, meta, payload in job.entries:
                self._queued[key] = (meta, payload)
        self._queue.put(job)
        return True

    def queued(self, key: str) -> tuple[bytes, torch.Tensor] | None:
        """An entry waiting to be written (a load reads it from here: what is queued is already stored
        as far as the scheduler knows)."""
        with self._lock:
            return self._queued.get(key)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done (a graceful shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # the steps come first
        except (AttributeError, OSError):
            pass
        while (job := self._queue.get()) is not None:
            for key, meta, payload in job.entries:
                self._put(key, meta, payload)
                with self._lock:
                    if (queued := self._queued.get(key)) is not None and queued[1] is payload:
                        del self._queued[key]
            with self._lock:
                self._pending -= job.nbytes
                self._idle.notify_all()

    def _put(self, key: str, meta: bytes, payload: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self.store.put(key, memoryview(payload.numpy()), meta)
        except StoreError as e:
            with self._lock:
                self.stats.write_errors += 1
                was_degraded, self.stats.degraded = self.stats.degraded, True
            if not was_degraded:
                logger.warning("state store write failed, serving from memory alone until it works again: %s", e)
            return
        with self._lock:
            was_degraded, self.stats.degraded = self.stats.degraded, False
            self.stats.entries_written += 1
            self.stats.bytes_written += payload.numel()
            self.stats.write_seconds.append(time.perf_counter() - t0)
        if was_degraded:
            logger.warning("state store writable again")

    def take_stats(self, size_bytes: int) -> StoreStats:
        """The counters now; the write and load times since the last call move into the copy."""
        with self._lock:
            s = self.stats
            s.size_bytes = size_bytes
            out = StoreStats(**{f: getattr(s, f) for f in s.__struct_fields__})
            out.write_seconds, out.load_seconds = list(s.write_seconds), list(s.load_seconds)
            s.write_seconds.clear()
            s.load_seconds.clear()
            return out


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

    @staticmethod
    def open(args: ServerArgs, namespace: StoreNamespace, pools: StatePools) -> StoreTier:
        store = DirectoryStore(args.state_cache_dir, int(args.state_cache_size_gb * (1 << 30)), namespace)
        logger.info("state store %s: %d entries, %.1f of %.1f GiB", store.folder, len(store.keys()),
                    store.size_bytes / 2**30, store.capacity_bytes / 2**30)
        return StoreTier(store, pools, args.state_cache_block_tokens, args.state_cache_write_queue_mb << 20)

    # ------------------------------------------------------------------ one batch
    def serve(self, batch: ForwardBatch) -> set[int]:
        """The batch's writes (copied out now, written in the background), then its loads; returns
        the ids of the loads that failed on this rank."""
        for w in batch.store_writes:
            self._write(w)
        if batch.store_clear:
            self.clear()
        return {load.load_id for load in batch.store_loads if not self._load(load)}

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
            slots = torch.tensor(w.kv_slots, dtype=torch.long, device=self.pools.k.device)
            kv = torch.stack((self.pools.k[:, slots], self.pools.v[:, slots])).cpu()
            for i, key in enumerate(w.kv_keys):
                entries.append((key, lay.kv_meta, _flat_bytes(kv[:, :, i * b:(i + 1) * b])))
        if w.state_key:
            parts = [_flat_bytes(t[:, w.state_slot].cpu()) for t in self.pools.states.values()]
            entries.append((w.state_key, lay.state_meta, torch.cat(parts)))
        if entries:
            self.writer.submit(_Job(entries, sum(p.numel() for _, _, p in entries)))

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

    def _load(self, load: StoreLoad) -> bool:
        t0 = time.perf_counter()
        lay, pools = self.layout, self.pools
        blocks: list[torch.Tensor] = []
        if self.has_kv:
            for key in load.kv_keys:
                data = self._read(key, lay.kv_meta, lay.kv_bytes)
                if data is None:
                    return False
                blocks.append(data)
        state = None
        if load.state_key:
            state = self._read(load.state_key, lay.state_meta, lay.state_bytes)
            if state is None:
                return False
        if blocks:
            k = pools.k
            shape = (2, k.shape[0], self.block, *k.shape[2:])
            kv = torch.cat([blk.view(k.dtype).view(shape) for blk in blocks], dim=2)[:, :, load.skip:]
            if kv.shape[2] != len(load.kv_slots):
                raise ValueError(f"store load {load.load_id}: {kv.shape[2]} positions for {len(load.kv_slots)} slots")
            slots = torch.tensor(load.kv_slots, dtype=torch.long, device=k.device)
            k.index_copy_(1, slots, kv[0].to(k.device))
            pools.v.index_copy_(1, slots, kv[1].to(k.device))
        if state is not None:
            offset = 0
            for t in pools.states.values():
                n = t[:, 0].numel() * t.element_size()
                part = state[offset:offset + n].view(t.dtype).view(t[:, 0].shape)
                t[:, load.state_slot].copy_(part.to(t.device))
                offset += n
        with self.writer.lock:
            self.stats.load_seconds.append(time.perf_counter() - t0)
        return True

    def take_stats(self) -> StoreStats:
        return self.writer.take_stats(self.store.size_bytes)

    def close(self, timeout: float) -> None:
        """Finish the queued writes (up to `timeout` seconds), then stop the writer."""
        if not self.writer.flush(timeout):
            logger.warning("state store: writes still queued after %.0f s are lost", timeout)
        self.writer.close()


def namespace_json(namespace: StoreNamespace) -> str:
    """The canonical JSON of a namespace's fields (WorkerReady.store_namespace)."""
    return canonical_json(namespace.fields()).decode()
