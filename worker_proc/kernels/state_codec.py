"""How a recurrent-state pool stores its float32 states: the one place that decodes and encodes them.

Owns the storage formats of the recurrent-state pools (Mamba `ssm`, Gated DeltaNet `gdn_state`;
`--mamba-ssm-dtype`); every kernel backend (reference, fast, gated delta, Triton) reads a pool's
rows with `load` and writes them with `store`, and computes in float32 between the two:
- float32: the pool is a plain float32 tensor; `load` and `store` are the index_select /
  index_copy_ the kernels always did, and kernels may update its rows in place (`is_float32`);
- bfloat16: a plain bfloat16 tensor; `load` widens, `store` rounds to nearest (the update itself,
  and every accumulation inside it, stays float32);
- int8: a `QuantizedPool`, int8 values [S, H, a, b] plus one float32 scale per (slot, head, row)
  [S, H, a]. `store` quantises each row of b values symmetrically (scale = amax / 127, values
  round(x / scale) in [-127, 127]; an all-zero row gets scale 0 and decodes to zeros); `load` is
  values * scale. A row, not a whole head: the states are heavy-tailed across a head's rows, and one
  scale per head leaves the small rows few levels.

Rules that hold: the per-head state is the last two dims (Mamba [P, N], GDN [Dk, Dv]; Mamba1's pool is
[S, d_inner, N], one row per channel, its scales [S, d_inner]); a `store`
given a tensor of slots never leaves padding slot 0 non-zero in a non-float32 pool (rows for slot 0,
such as the Triton kernels' padding rows, are dropped); `load` of a stored state is `decode(encode(x))`
exactly, so copying a slot's values and scales (`StatePools.copy_state`) moves a state losslessly.
Kernels that update a float32 pool in place run on a float32 scratch copy otherwise (`run_on_float32`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, get_args

import torch
from torch import Tensor

from shared.config import StateDtype

STATE_DTYPES: tuple[str, ...] = get_args(StateDtype)
"""The `--mamba-ssm-dtype` values (shared.config.ServerArgs.mamba_ssm_dtype)."""
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
"""The element type a state pool holds for each state dtype."""
QMAX = 127.0
"""Largest int8 magnitude used: symmetric, so -128 never occurs."""

T = TypeVar("T")


@dataclass(frozen=True)
class QuantizedPool:
    """One layer's int8 recurrent-state pool: `values` [S, H, a, b] int8 and `scale` [S, H, a] float32.
    Views of `StatePools.states` (the state tensor and its `*_scale` tensor); never copies."""

    values: Tensor
    scale: Tensor


StatePool = Tensor | QuantizedPool
"""What a kernel gets as its `ssm_pool` / `state_pool`: a float32 or bfloat16 tensor, or an int8 pool."""


def storage_dtype(state_dtype: str) -> torch.dtype:
    """The element type of a pool of `state_dtype`; ValueError naming the choices for another name."""
    if state_dtype not in STORAGE:
        raise ValueError(f"unknown recurrent-state dtype {state_dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
    return STORAGE[state_dtype]


def is_float32(pool: StatePool) -> bool:
    """A plain float32 pool: kernels may read and update its rows in place."""
    return isinstance(pool, Tensor) and pool.dtype == torch.float32


def state_shape(pool: StatePool) -> tuple[int, ...]:
    """The pool's shape [S, H, a, b], whatever its storage."""
    return tuple((pool.values if isinstance(pool, QuantizedPool) else pool).shape)


def quantize(state: Tensor) -> tuple[Tensor, Tensor]:
    """float32 states [..., H, a, b] -> (int8 values of the same shape, float32 scales [..., H, a]).
    Symmetric per row: scale = amax / 127; an all-zero row has scale 0 and values 0. No clamp is
    needed: |x| <= amax, so |x * fl(127 / amax)| < 127.5 and rounds to at most 127."""
    state = state.float()
    amax = state.abs().amax(dim=-1)
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    values = state.mul(inv[..., None]).round_().to(torch.int8)
    return values, amax / QMAX


def dequantize(values: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """int8 values [..., H, a, b] and scales [..., H, a] -> float32 states (into `out` when given)."""
    return torch.mul(values, scale[..., None], out=out) if out is not None else values * scale[..., None]


def load(pool: StatePool, slots: Tensor | int) -> Tensor:
    """The float32 states of `slots` (an int: one row [H, a, b], a view for a float32 pool; a 1-D
    index tensor: [B, H, a, b], a copy)."""
    if isinstance(pool, QuantizedPool):
        if isinstance(slots, int):
            return dequantize(pool.values[slots], pool.scale[slots])
        return dequantize(pool.values.index_select(0, slots), pool.scale.index_select(0, slots))
    rows = pool[slots] if isinstance(slots, int) else pool.index_select(0, slots)
    return rows.float()


def store(state: Tensor, pool: StatePool, slots: Tensor | int) -> None:
    """Write float32 `state` (shaped as `load` returns it) into `slots` of `pool`, encoded."""
    if isinstance(pool, QuantizedPool):
        values, scale = quantize(state)
        _write(pool.values, slots, values)
        _write(pool.scale, slots, scale)
        if not isinstance(slots, int):
            pool.values[0].zero_()
            pool.scale[0].zero_()
        return
    _write(pool, slots, state.to(pool.dtype))
    if pool.dtype != torch.float32 and not isinstance(slots, int):
        pool[0].zero_()


def _write(pool: Tensor, slots: Tensor | int, rows: Tensor) -> None:
    if isinstance(slots, int):
        pool[slots].copy_(rows)
    else:
        pool.index_copy_(0, slots, rows)


def run_on_float32(pool: StatePool, slots: Tensor, kernel: Callable[[Tensor, Tensor], T]) -> T:
    """Run `kernel(scratch, local_slots)` for a kernel that reads and updates a float32 pool in place:
    `scratch` [B + 1, H, a, b] float32 holds the states of `slots` at rows 1..B (row 0 zero, the
    padding row), `local_slots` is 1..B; afterwards rows 1..B are stored back into `slots` of `pool`
    (slot 0 entries dropped). Returns the kernel's result."""
    values = pool.values if isinstance(pool, QuantizedPool) else pool
    scratch = torch.empty((slots.shape[0] + 1, *values.shape[1:]), dtype=torch.float32, device=values.device)
    scratch[0].zero_()
    if isinstance(pool, QuantizedPool):
        dequantize(pool.values.index_select(0, slots), pool.scale.index_select(0, slots), out=scratch[1:])
    else:
        scratch[1:].copy_(pool.index_select(0, slots))
    local = torch.arange(1, slots.shape[0] + 1, dtype=slots.dtype, device=slots.device)
    out = kernel(scratch, local)
    store(scratch[1:], pool, slots)
    return out


def slot_tensor(slot: int, device: torch.device) -> Tensor:
    """A one-element int64 index of `slot` (for `run_on_float32` with a single-request kernel)."""
    return torch.tensor([slot], dtype=torch.int64, device=device)
