"""Host memory of a worker process: what the load allocates lives in mappings of its own
(`map_load_blocks`), freed blocks of the steps stay in the heap for the next step
(`keep_freed_memory`), what load left free goes back once (`shared.heap.release_free_heap`), the
pools take pages as their slots are first written (`zeros`), the weights lie on 2 MiB pages where the
kernel offers transparent huge pages (`weight_tensor`), and oneDNN's primitive caches hold a bounded
number of entries (`bound_onednn_caches`).

glibc's malloc serves a block above its mmap threshold with a fresh mapping and returns the top of
the heap to the kernel once more than its trim threshold is free. A step's temporaries are megabytes
each and freed at the step's end, so by default every step faults their pages in again, zeroed by the
kernel: measured 20,000-45,000 page faults in one step of 32 prompts of 128 tokens on the built-in
model (a fifth of its time). `keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB)
and the trim threshold to 1 GiB: the process's resident memory then stays at its peak (which is what
the pools are sized against), and a step reuses the previous step's pages.

The load comes first, under a low mmap threshold: its weights, the dense copies that packed ones
replace and the execution plan's timing copies are each a mapping, which goes back to the kernel
whole when freed. Loaded into the heap instead, they left holes of hundreds of MiB there (released
by `release_free_heap`, yet inside the heap): the steps' temporaries then landed in a different hole
from one step to the next, and each hole they touched became resident again, so the worker's
memory grew by the holes' size over a long prompt instead of by its temporaries' peak.

The execution plan is measured once the weights are loaded, under the steps' policy, since what it
measures is the steps' speed: timed under the load's policy, every temporary above 64 KiB was a fresh
mapping faulted in on each call, which no step pays, and a product with large temporaries (an int8
product quantizing its rows in Python) was timed at several times its serving cost. The weight copies
it makes are blocks of the load, each its own mapping (`blocks_mapped`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from shared.heap import release_free_heap

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest accepted mmap threshold on 64-bit systems; larger blocks are still mapped."""
TRIM_THRESHOLD_BYTES = 1 << 30


LOAD_MMAP_THRESHOLD_BYTES = 64 << 10
"""Blocks above this size are their own mapping while the model loads (`map_load_blocks`)."""
LOAD_TRIM_THRESHOLD_BYTES = 128 << 10
"""glibc's default trim threshold, which the load keeps."""
HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page of x86-64 (and of arm64 with 4 KiB base pages)."""
WEIGHT_STORAGE = "2 MiB-aligned mappings advised MADV_HUGEPAGE"
"""What `weight_tensor` gives a weight: part of a measured plan's key, since how fast a weight streams
depends on the pages it lies on."""


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt`, looked up once (finding the C library runs `ldconfig`)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def map_load_blocks() -> bool:
    """Before the load: every block above LOAD_MMAP_THRESHOLD_BYTES is a mapping of its own (see the
    module doc), until `keep_freed_memory` applies the steps' policy. Returns False, changing nothing,
    where the C library is not glibc or refuses the setting."""
    mallopt = _mallopt()
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, LOAD_TRIM_THRESHOLD_BYTES))


def keep_freed_memory() -> bool:
    """After the load: apply the steps' policy (see the module doc). Returns False, changing nothing,
    where the C library is not glibc (no `mallopt`) or refuses a setting."""
    mallopt = _mallopt()
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


@contextmanager
def blocks_mapped() -> Iterator[None]:
    """The load's policy for the block (every block above LOAD_MMAP_THRESHOLD_BYTES its own mapping), then
    the steps' again: for the weight copies the execution plan makes once the model is loaded (its timing
    copies and the copies it binds), which must go back to the kernel whole when freed rather than leave
    holes in the heap the steps use. The heap's free pages go back first (`release_free_heap`), so a copy
    does not land in a freed temporary of a timed product. Where the C library is not glibc, only that."""
    release_free_heap()
    mallopt = _mallopt()
    if mallopt is None:
        yield
        return
    mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES)
    mallopt(M_TRIM_THRESHOLD, LOAD_TRIM_THRESHOLD_BYTES)
    try:
        yield
    finally:
        keep_freed_memory()


ONEDNN_CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
"""The two caches of oneDNN primitives a CPU worker fills: PyTorch's ideep LRU and oneDNN's own."""
ONEDNN_CACHE_CAPACITY = 128
"""Entries each cache keeps (both default to 1024). A packed GEMM (worker_proc/linear/kernels.py) creates
one primitive per weight shape and row count, of a size that does not depend on the weight's, and
mixed traffic brings hundreds of distinct prefill row counts: with the defaults a worker's heap grows
for as long as new row counts come (benchmarks/soak.py shows it). The bound must hold every row
bucket decode steps use (they stay hot in the LRU) and stay small enough that what an evicted entry
frees is reused rather than fragmented; a miss costs about one more call of the same GEMM."""
LEAN_ONEDNN_CACHE_CAPACITY = 16
"""Entries under `--single-weight-copy`, whose host wants memory back before speed: measuring the plan
alone leaves each cache full of primitives (each holding its JIT kernels) for row counts and methods
serving never runs; at this bound those few go too, and what serving uses comes back at one primitive's
creation per miss."""


def onednn_cache_capacity(single_weight_copy: bool) -> int:
    """The entries each oneDNN primitive cache keeps, by the worker's memory policy."""
    return LEAN_ONEDNN_CACHE_CAPACITY if single_weight_copy else ONEDNN_CACHE_CAPACITY


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Cap both oneDNN primitive caches at `capacity` entries, unless the environment already sets a
    capacity (kept as it is). oneDNN and ideep read these once, when the process creates its first
    primitive, so this runs before the model is built. Returns the values in effect."""
    for name in ONEDNN_CACHE_VARS:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in ONEDNN_CACHE_VARS}


SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of the CPU's last-level cache as Linux reports it (0 where it does not say)."""
    best = (0, 0)
    try:
        entries = [e for e in os.listdir(cpu_dir) if e.startswith("index")]
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(cpu_dir, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(cpu_dir, entry, "size")) as f:
                size = f.read().strip()
            nbytes = int(size[:-1]) * SIZE_UNITS[size[-1]] if size[-1:] in SIZE_UNITS else int(size)
        except (OSError, ValueError):
            continue
        best = max(best, (level, nbytes))
    return best[1]


def physical_memory_bytes() -> int:
    """The host's memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0



def weight_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a weight the loader fills. One of at least HUGE_PAGE_BYTES is a
    private anonymous mapping whose data start on a 2 MiB boundary, advised for transparent huge pages
    (MADV_HUGEPAGE) before anything is written, so that the load faults it in as 2 MiB pages wherever
    the kernel's THP mode is `madvise` or `always`: a step of few rows streams every weight once, and
    on 4 KiB pages that stream takes a TLB miss every 64 cache lines. A kernel that refuses the advice
    (THP `never`, or none built in) leaves base pages and nothing else changes. Smaller weights, which
    cannot fill a huge page, are `torch.empty`. The tensor keeps its mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    huge, base = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MADV_NOHUGEPAGE", None)
    if huge is not None and base is not None:
        # only the huge pages the weight fills: its last partial one stays on base pages (under THP
        # `always` too), so that resident memory is the weight's bytes, not those rounded up to 2 MiB
        filled = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        try:
            mapping.madvise(huge, start, filled)
            mapping.madvise(base, start + filled, len(mapping) - start - filled)
        except OSError as exc:
            logger.debug("transparent huge pages refused for a weight: %s", exc)
    return raw[start : start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for a pool; on the CPU a private anonymous mapping, which the kernel fills with zeros
    on first access, so that resident memory grows with the slots actually written (the contexts and
    states held), not with the pool's capacity. The tensor keeps the mapping alive. Other devices get
    `torch.zeros`.

    A slot's first write faults its pages in: measured 5-6 ms more than a warm write for a state slot of
    the 350M shape (22 MB), once per slot over the process's life, since a freed slot keeps its pages and
    the scheduler hands the most recently freed slot out first (scheduler_proc.allocators). Advised for
    transparent huge pages the same first write took 20-90 ms (the kernel compacts memory to find them),
    so pools stay on base pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    return raw.view(dtype).view(shape)
