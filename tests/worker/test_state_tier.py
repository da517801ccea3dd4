"""A rank's side of the state store on real pools (CPU, and CUDA where there is one): what a write
copies out is what a load puts back, bit for bit, into other slots; a damaged or foreign entry fails
the load and writes nothing; queued writes are readable; the writer's queue bound drops, never waits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from shared.messages import ForwardBatch, StoreLoad, StoreWrite
from shared.state_store import DirectoryStore, MemoryStore, StoreNamespace
from shared.state_store.store import Buffer
from shared.state_store.tiered import TieredStore
from tests.worker.util import fixture_dir
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import StatePools
from worker_proc.state.store_loader import READING
from worker_proc.state.store_tier import StoreTier

BLOCK = 4
KEYS = [f"{i:064x}" for i in range(1, 8)]
STATE_KEY = "f" * 64
NAMESPACE = StoreNamespace(model_config="c" * 64, weights="w", dtype="float32", quantization="", state_dtype="float32",
                           tp_size=1, tp_rank=0)  # fmt: skip

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def pools(device: str, state_dtype: str) -> StatePools:
    cfg = load_config(fixture_dir("nope_groups2"))
    p = StatePools(cfg, kv_slots=40, state_slots=4, dtype=torch.float32, device=device, state_dtype=state_dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for t in (p.k, p.v, *p.states.values()):
        if t.dtype == torch.int8:
            values = torch.randint(-127, 128, t.shape, generator=gen)
        else:
            values = torch.randn(t.shape, generator=gen) * 50
        t.copy_(values.to(t.dtype).to(device))
    for t in (p.k, p.v, *p.states.values()):
        t[:, 0].zero_()  # padding slot
    return p


def settle_all(tier: StoreTier) -> tuple[list[int], list[int]]:
    states = tier.loader.states(wait_s=10.0)
    while READING in states:
        states = tier.loader.states(wait_s=10.0)
    return tier.loader.settle(states)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("host_tier", [False, True], ids=["directory", "host-memory+directory"])
def test_a_load_puts_back_what_a_write_copied_out(tmp_path: Path, device: str, state_dtype: str,
                                                  host_tier: bool) -> None:  # fmt: skip
    """On CUDA the pools are device memory: a write copies to the host, a load back to the device; with
    --hicache-size the host-memory tier answers the load (the directory holds it too)."""
    p = pools(device, state_dtype)
    store = DirectoryStore(tmp_path, 1 << 30, NAMESPACE)
    tier = StoreTier(TieredStore(MemoryStore(1 << 30), store) if host_tier else store, p, BLOCK, 1 << 30)
    src = list(range(1, 13))  # three blocks
    tier.serve(ForwardBatch(step=1, reqs=[], store_writes=[StoreWrite(kv_keys=KEYS[:3], kv_slots=src,
                                                                       state_key=STATE_KEY, state_slot=2)]))
    assert tier.writer.flush(30)
    # load positions 6..11 (skip the first 2 of the second block) into other slots
    dst = list(range(30, 36))
    load = StoreLoad(load_id=7, kv_keys=KEYS[1:3], skip=2, kv_slots=dst, state_key=STATE_KEY, state_slot=3)
    tier.serve(ForwardBatch(step=2, reqs=[], store_loads=[load]))
    assert settle_all(tier) == ([7], [])
    s, d = torch.tensor(src[6:], device=device), torch.tensor(dst, device=device)
    assert torch.equal(p.k[:, d], p.k[:, s]) and torch.equal(p.v[:, d], p.v[:, s])
    for name, t in p.states.items():
        assert torch.equal(t[:, 3], t[:, 2]), name
    assert tier.take_stats().entries_read == 3
    tier.close(5)


def test_damaged_foreign_or_missing_entries_fail_the_load_and_write_nothing(tmp_path: Path) -> None:
    p = pools("cpu", "float32")
    store = DirectoryStore(tmp_path, 1 << 30, NAMESPACE)
    tier = StoreTier(store, p, BLOCK, 1 << 30)
    tier.serve(ForwardBatch(step=1, reqs=[], store_writes=[StoreWrite(kv_keys=KEYS[:2], kv_slots=list(range(1, 9)),
                                                                       state_key=STATE_KEY, state_slot=1)]))
    assert tier.writer.flush(30)
    path = Path(store.path(KEYS[1]))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    store.put(KEYS[2], b"x" * 16, b'{"kind":"kv"}')  # another layout under a key
    before = p.k.clone()
    loads = [StoreLoad(load_id=1, kv_keys=KEYS[:2], skip=0, kv_slots=list(range(20, 28))),
             StoreLoad(load_id=2, kv_keys=[KEYS[2]], skip=0, kv_slots=list(range(28, 32))),
             StoreLoad(load_id=3, kv_keys=[KEYS[5]], skip=0, kv_slots=list(range(32, 36)))]
    tier.serve(ForwardBatch(step=2, reqs=[], store_loads=loads))
    assert settle_all(tier) == ([], [1, 2, 3])
    assert torch.equal(p.k, before)
    assert not path.exists()  # the damaged file was removed when it was read
    tier.close(5)


class HeldStore(MemoryStore):
    """A MemoryStore whose puts wait until `release` is set (a slow disk)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.release = threading.Event()

    def put(self, key: str, payload: Buffer, meta: Buffer = b"") -> None:
        assert self.release.wait(30)
        super().put(key, payload, meta)


def test_a_queued_write_is_readable_and_a_full_queue_drops() -> None:
    p = pools("cpu", "float32")
    store = HeldStore(1 << 30)
    tier = StoreTier(store, p, BLOCK, 1 << 30)
    tier.serve(ForwardBatch(step=1, reqs=[], store_writes=[StoreWrite(kv_keys=KEYS[:1], kv_slots=[1, 2, 3, 4])]))
    assert tier.writer.queued(KEYS[0]) is not None and not store.contains(KEYS[0])
    tier.serve(ForwardBatch(step=2, reqs=[], store_loads=[StoreLoad(load_id=4, kv_keys=KEYS[:1], skip=0,
                                                                    kv_slots=[36, 37, 38, 39])]))
    assert settle_all(tier) == ([4], [])
    assert torch.equal(p.k[:, 36:40], p.k[:, 1:5])
    store.release.set()
    tier.close(5)
    assert store.contains(KEYS[0])
    small = StoreTier(MemoryStore(1 << 30), p, BLOCK, 1)  # a queue of one byte
    small.serve(ForwardBatch(step=1, reqs=[], store_writes=[StoreWrite(kv_keys=KEYS[:1], kv_slots=[1, 2, 3, 4])]))
    assert small.take_stats().write_drops == 1 and small.store.keys() == []
    small.close(5)
