"""Giving a process's free heap pages back to the kernel, for every process that frees much at start.

glibc's malloc keeps what a load freed inside its heap (only the heap's top is trimmed, and only past
its trim threshold), so a process whose start-up builds and drops large temporaries (a tokenizer's
parsed vocabulary, a worker's dense weights replaced by packed copies) would hold them resident for
its whole life. Each process package calls `release_free_heap` once, after its load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, looked up once (finding the C library runs `ldconfig`)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc's `malloc_trim(0)`, which also frees whole
    free pages inside the heap, not only at its top). Returns whether any memory was released (False,
    doing nothing, where the C library is not glibc)."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
