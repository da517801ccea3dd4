"""Floating-point hygiene of a worker process: no subnormal (denormal) float reaches the CPU's arithmetic.

x86 cores compute with a subnormal operand or result through a microcode assist that is tens to a
hundred times slower than the ordinary path. Trained weights and the recurrent scans produce such
values (a decay exp(-x) of a long segment times a small activation): the products over them then
dominate a step. The rule: a worker sets flush-to-zero and denormals-are-zero (`flush_denormals`)
before it runs any parallel region, so the OpenMP threads it starts inherit the mode, and checks
that every thread has it; stored weights that are subnormal are set to zero at load
(`flush_subnormal_`). A thread created before the mode was set keeps its own mode: a process that
ran parallel torch work first (a test runner) may see `flush_denormals` report False, and logs it.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

PROBE_ELEMENTS = 1 << 20
"""Enough elements that an elementwise product is split across every intra-op thread."""


FLOAT_BITS = {  # dtype -> (integer view, mantissa bits, exponent mask)
    torch.float64: (torch.int64, 52, 0x7FF),
    torch.float32: (torch.int32, 23, 0xFF),
    torch.bfloat16: (torch.int16, 7, 0xFF),
    torch.float16: (torch.int16, 10, 0x1F),
}


FLUSH_BLOCK_ELEMENTS = 1 << 20
"""`flush_subnormal_` reads a weight this many elements at a time: its bit tests make several temporaries
the size of what they read, which for a whole embedding would be hundreds of megabytes at load."""


def subnormal_mask(t: torch.Tensor) -> torch.Tensor:
    """Which elements are subnormal, read from their bits: with denormals-are-zero on, a float
    comparison would see them as zero."""
    view, mantissa_bits, exponent_mask = FLOAT_BITS[t.dtype]
    bits = t.contiguous().view(view)
    exponent = (bits >> mantissa_bits) & exponent_mask
    return (exponent == 0) & ((bits & ((1 << mantissa_bits) - 1)) != 0)


def subnormal_count(t: torch.Tensor) -> int:
    """How many elements of a tensor are subnormal (0 for dtypes without them here)."""
    if t.dtype not in FLOAT_BITS or t.numel() == 0:
        return 0
    return int(subnormal_mask(t).sum())


def flush_denormals() -> bool:
    """Set FTZ/DAZ on this thread and check it holds on every intra-op thread (`denormals_flushed`).
    False where the CPU cannot flush or some thread does not (see the module doc). The mode is the
    whole process's: a worker process or an in-process benchmark sets it, a library user's process is
    left as it is."""
    return torch.set_flush_denormal(True) and denormals_flushed()


def denormals_flushed() -> bool:
    """Whether a product whose exact result is subnormal, computed on every intra-op thread, comes
    out zero everywhere."""
    small = torch.full((PROBE_ELEMENTS,), 1e-30)
    return subnormal_count(small * small.new_full((), 1e-10)) == 0


def flush_subnormal_(module: torch.nn.Module) -> int:
    """Set every subnormal element of the module's floating parameters and buffers to zero (what DAZ
    would read them as). Returns how many there were."""
    total = 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type != "cpu" or t.dtype not in FLOAT_BITS or t.numel() == 0:
                continue
            parts = [t]
            if t.is_contiguous():  # a block's temporaries, not a whole tensor's
                flat = t.view(-1)
                parts = [flat[i:i + FLUSH_BLOCK_ELEMENTS] for i in range(0, flat.numel(), FLUSH_BLOCK_ELEMENTS)]
            for part in parts:
                mask = subnormal_mask(part)
                n = int(mask.sum())
                if n:
                    part.masked_fill_(mask.view(part.shape), 0.0)
                    total += n
    return total
