"""The state store's loads on one rank: entries read and checked on a reader thread while the steps go
on, then copied into their slots by the step's thread.

Owns the loads it was sent until each is settled. The slots a load fills belong to its ticket on the
scheduler's side until the scheduler applies the result that says it is done or failed: nothing else
reads or writes them meanwhile, and this rank writes them only in `settle`, between steps.

Rules:
- A load is one unit: it is done when every entry it names read back whole with this rank's layout,
  and failed as soon as one did not; `states` says, per pending load in the order they were sent,
  0 (still reading), 1 (read) or 2 (failed). The ranks of a TP group agree on these (process.py)
  before `settle` applies the read ones and forgets the failed ones: all ranks apply a load in the
  same step.
- A step that fails drops every pending load (`drop`); the scheduler fails them too.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import StoreLoad
from worker_proc.state.pools import StatePools

logger = logging.getLogger(__name__)

READING, READ, FAILED = 0, 1, 2

ReadEntry = Callable[[str, bytes, int], "torch.Tensor | None"]


@dataclass(frozen=True)
class LoadLayout:
    """What a rank's entries must be: their metas and sizes, and the block size."""

    kv_meta: bytes
    kv_bytes: int
    state_meta: bytes
    state_bytes: int
    block: int


@dataclass
class _Read:
    """A load's entries as read: the KV of the positions it writes [pools, layers, n, heads, dim] (each
    of `StatePools.kv_pools`; None without KV) and the state's bytes (None without a state)."""

    kv: torch.Tensor | None
    state: torch.Tensor | None
    seconds: float


def _nice_thread() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # the steps come first
    except (AttributeError, OSError):
        pass


class StoreLoader:
    """Pending loads and the reader thread (see the module rules)."""

    def __init__(self, pools: StatePools, layout: LoadLayout, read_entry: ReadEntry,
                 on_loaded: Callable[[float], None]) -> None:  # fmt: skip
        self.pools = pools
        self.layout = layout
        self.has_kv = pools.k.shape[0] > 0
        self.read_entry = read_entry
        self.on_loaded = on_loaded
        self.pending: OrderedDict[int, tuple[StoreLoad, cf.Future[_Read | None]]] = OrderedDict()
        self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix="state-store-reader", initializer=_nice_thread)

    def submit(self, load: StoreLoad) -> None:
        if load.load_id in self.pending:
            raise ValueError(f"store load {load.load_id} sent twice")
        self.pending[load.load_id] = (load, self._reader.submit(self._read, load))

    def states(self, wait_s: float = 0.0) -> list[int]:
        """READING / READ / FAILED per pending load in order; with `wait_s`, first wait up to that long
        for one to finish when none has."""
        futures = [f for _, f in self.pending.values()]
        if wait_s > 0 and futures and not any(f.done() for f in futures):
            cf.wait(futures, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        return [READING if not f.done() else READ if f.result() is not None else FAILED for f in futures]

    def settle(self, agreed: list[int]) -> tuple[list[int], list[int]]:
        """Apply the loads every rank read, forget the failed ones; returns (done ids, failed ids)."""
        if len(agreed) != len(self.pending):
            raise ValueError(f"{len(agreed)} load states for {len(self.pending)} pending loads")
        done: list[int] = []
        failed: list[int] = []
        for (load_id, (load, future)), state in zip(list(self.pending.items()), agreed, strict=True):
            if state == READING:
                continue
            del self.pending[load_id]
            read = future.result() if state == READ else None
            if read is None:
                failed.append(load_id)
                continue
            self._apply(load, read)
            done.append(load_id)
        return done, failed

    def drop(self) -> None:
        if self.pending:
            logger.warning("dropping %d pending state store loads (the step failed)", len(self.pending))
        for _, future in self.pending.values():
            future.cancel()
        self.pending.clear()

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the reader thread
    def _read(self, load: StoreLoad) -> _Read | None:
        t0 = time.perf_counter()
        lay = self.layout
        kv = None
        if self.has_kv and load.kv_keys:
            blocks = []
            for key in load.kv_keys:
                data = self.read_entry(key, lay.kv_meta, lay.kv_bytes)
                if data is None:
                    return None
                blocks.append(data)
            k = self.pools.k
            # joined by numpy on this thread alone (a torch op here would start an OpenMP team of its own)
            shape = (len(self.pools.kv_pools), k.shape[0], lay.block, *k.shape[2:-1], k.shape[-1] * k.element_size())
            joined = np.concatenate([blk.numpy().reshape(shape) for blk in blocks], axis=2)
            kv = torch.from_numpy(joined).view(k.dtype)[:, :, load.skip:]
            if kv.shape[2] != len(load.kv_slots):
                logger.error("store load %d: %d positions for %d slots", load.load_id, kv.shape[2], len(load.kv_slots))
                return None
        state = None
        if load.state_key:
            state = self.read_entry(load.state_key, lay.state_meta, lay.state_bytes)
            if state is None:
                return None
        return _Read(kv, state, time.perf_counter() - t0)

    # ------------------------------------------------------------------ the step's thread
    def _apply(self, load: StoreLoad, read: _Read) -> None:
        t0 = time.perf_counter()
        pools = self.pools
        if read.kv is not None:
            slots = torch.tensor(load.kv_slots, dtype=torch.long, device=pools.k.device)
            for pool, part in zip(pools.kv_pools, read.kv, strict=True):
                pool.index_copy_(1, slots, part.to(pool.device))
        if read.state is not None:
            offset = 0
            for t in pools.states.values():
                n = t[:, 0].numel() * t.element_size()
                part = read.state[offset:offset + n].view(t.dtype).view(t[:, 0].shape)
                t[:, load.state_slot].copy_(part.to(t.device))
                offset += n
        self.on_loaded(read.seconds + time.perf_counter() - t0)
