"""The state store's writer thread: what a rank copied out of its pools, put into the store in the
background behind a queue bounded in bytes (--state-cache-write-queue-mb).

The thread runs only on a core the steps leave idle (`idle_only`). Owns the queued entries until they
are written (a load reads a queued entry from here) and the rank's `StoreStats`, which the step's
thread updates too under `lock`. Rules: a job that does not fit the
queue is dropped and counted, never waited for; a store error is counted and logged once per outage,
and the next write that works ends it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import StoreStats
from shared.state_store import StateStore, StoreError

logger = logging.getLogger(__name__)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of (CPU) `t` in row-major order, one uint8 tensor. A copy only when `t` is not contiguous,
    made by numpy on the calling thread alone: a torch copy on the writer's thread would start an OpenMP
    thread team of its own beside the steps' one."""
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.ascontiguousarray(t.view(torch.uint8).numpy())).reshape(-1)


def byte_size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class WriteJob:
    """One write's entries, copied out of the pools: [(key, meta, payload)]; a payload may be a view of
    that copy (a block of a gathered prefix), made contiguous bytes by the writer thread."""

    entries: list[tuple[str, bytes, torch.Tensor]]
    nbytes: int


def idle_only() -> None:
    """Run the calling thread only on a core nothing else wants (Linux SCHED_IDLE), else at nice 19: a
    write competing with a step's thread team holds the whole team at its barrier."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (AttributeError, OSError):
            pass


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
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="state-store-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> bool:
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
        """An entry waiting to be written, as (meta, its bytes) (a load reads it from here: what is
        queued is already stored as far as the scheduler knows)."""
        with self._lock:
            queued = self._queued.get(key)
        return None if queued is None else (queued[0], flat_bytes(queued[1]))

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
        idle_only()
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
            self.store.put(key, memoryview(flat_bytes(payload).numpy()), meta)
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
            self.stats.bytes_written += byte_size(payload)
            self.stats.write_seconds.append(time.perf_counter() - t0)
        if was_degraded:
            logger.warning("state store writable again")

    def take_stats(self, size_bytes: int) -> StoreStats:
        """The counters now; the write and load times since the last call move into the copy."""
        with self._lock:
            s = self.stats
            s.size_bytes = size_bytes
            s.queued_bytes = self._pending
            out = StoreStats(**{f: getattr(s, f) for f in s.__struct_fields__})
            out.write_seconds, out.load_seconds = list(s.write_seconds), list(s.load_seconds)
            s.write_seconds.clear()
            s.load_seconds.clear()
            return out
