"""Mamba1's selective scan behind `KernelOps` (`selective_scan_prefill`, `selective_scan_decode`).

The recurrence, per channel c of d_inner and state index n, with dt discretized as softplus(dt + dt_bias):
    state[c, n] = exp(dt[c] * a[c, n]) * state[c, n] + dt[c] * x[c] * B[n]
    y[c]        = sum_n state[c, n] * C[n] + d[c] * x[c]
(a = -exp(A_log) [d_inner, N]; B and C are shared by every channel of a token). `selective_scan` runs it
over one request's tokens from a given state, `selective_state_step` advances a batch of requests by one
token. `SelectiveScanMethods` is the `KernelOps` form every kernel set mixes in: it reads and writes the
recurrent-state pool only at the slots it is given, through `state_codec` (float32, bfloat16 or int8
storage; the recurrence runs on the decoded float32 state and the result is encoded once per call).
Results are independent of the batch a request is in: every reduction is a row's own (over N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SelectiveScanParams
from worker_proc.kernels.state_codec import StatePool

SCAN_BLOCK = 64
"""Tokens whose discretized decays and inputs ([tokens, d_inner, N] each) are made at once in a prefill
scan: the temporaries stay bounded (a 7B model's d_inner * N is 131k values per token)."""


def discretize(dt: Tensor, dt_bias: Tensor) -> Tensor:
    """softplus(dt + dt_bias) in float32 (taken in float64 and rounded: float32 SIMD and scalar tails differ
    in the last bit, which would make a token's values depend on the batch's size). dt: [..., D]."""
    return F.softplus((dt.float() + dt_bias.float()).double()).float()


def selective_scan(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor,
                   state: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One request's tokens: x [L, D], dt [L, D] discretized, a [D, N], b, c [L, N], d [D], state [D, N]
    (after the token before x). Returns (y [L, D] float32 with the d skip, the state after the last token)."""
    xf, af, bf, cf = x.float(), a.float(), b.float(), c.float()
    state = state.float()
    ys = []
    for start in range(0, x.shape[0], SCAN_BLOCK):
        rows = slice(start, start + SCAN_BLOCK)
        decay = torch.exp(dt[rows, :, None] * af)  # [Q, D, N]
        inputs = (dt[rows] * xf[rows])[..., None] * bf[rows, None, :]  # [Q, D, N]
        for t in range(decay.shape[0]):
            state = state * decay[t] + inputs[t]
            ys.append((state * cf[start + t]).sum(-1))
    return torch.stack(ys) + xf * d.float(), state


def selective_state_step(state: Tensor, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor,
                         d: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One token per request: state [Bt, D, N] float32, x, dt [Bt, D] (dt discretized), a [D, N],
    b, c [Bt, N], d [D]. Returns (y [Bt, D] float32, new state [Bt, D, N] float32)."""
    xf = x.float()
    new_state = state * torch.exp(dt[..., None] * a.float()) + (dt * xf)[..., None] * b.float()[:, None, :]
    y = (new_state * c.float()[:, None, :]).sum(-1) + xf * d.float()
    return y, new_state


class SelectiveScanMethods:
    """The `KernelOps` selective-scan methods in pure torch (contracts: worker_proc.kernels.interface)."""

    def selective_scan_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                               state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        y, final = selective_scan(x, discretize(dt, p.dt_bias), p.a, b, c, p.d, codec.load(state_pool, slot))
        codec.store(final, state_pool, slot)
        return y

    def selective_scan_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                              state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        y, new_state = selective_state_step(codec.load(state_pool, slots), x, discretize(dt, p.dt_bias), p.a, b, c,
                                            p.d)  # fmt: skip
        codec.store(new_state, state_pool, slots)
        return y
