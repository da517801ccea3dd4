"""`KernelOps`: the one interface between the model and its kernels; the shape contracts live here.

Every implementation (`ReferenceOps`, `FastOps`, `TritonOps`) provides these methods with exactly
these semantics; the model calls nothing else. Rules that hold for every method:
- Pools are one layer's view `[S, ...]` (S = slots + 1; slot 0 is padding) and are read and
  written *by slot*, in place; an op touches no slot it was not given.
- Slots of one decode call are distinct. Recurrent math (conv state aside) runs in float32
  whatever the model dtype; the SSM pool is float32.
Shape letters are those of `worker_proc.kernels.reference`: L tokens of one request, Bt requests of
a decode group, H Mamba heads, P head dim, G groups, N state size, Cd conv channels, K conv width,
h query heads, kvh KV heads, d attention head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KernelOps(Protocol):
    name: str
    batch_invariant: bool
    """True when a request's results are bitwise the same alone or batched with any others."""

    def conv_prefill(
        self, x: torch.Tensor, conv_pool: torch.Tensor, slot: int, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [L, Cd] -> SiLU(causal conv) [L, Cd]; conv_pool: [S, Cd, K-1], row `slot` advanced."""
        ...

    def conv_decode(
        self, x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [Bt, Cd], slots: [Bt] int64 (distinct) -> [Bt, Cd]; rows `slots` advanced by one."""
        ...

    def ssd_prefill(
        self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], chunk_size: int,
        ssm_pool: torch.Tensor, slot: int,
    ) -> torch.Tensor:
        """x: [L, H, P]; dt: [L, H] raw (bias, softplus and clamp applied here); a, d, dt_bias: [H];
        b, c: [L, G, N]; ssm_pool: [S, H, P, N] fp32, row `slot` advanced. Returns y [L, H, P] fp32.
        `chunk_size` is the checkpoint's; the result does not depend on it beyond rounding."""
        ...

    def ssd_decode(
        self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], ssm_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """x: [Bt, H, P]; dt: [Bt, H] raw; b, c: [Bt, G, N]; slots: [Bt] int64 (distinct).
        Returns y [Bt, H, P] fp32; rows `slots` of ssm_pool advanced by one token."""
        ...

    def attn_prefill(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
        start_pos: int, scale: float,
    ) -> torch.Tensor:
        """q: [L, h, d]; k_pool, v_pool: [S, kvh, d] (this step's K/V already written);
        kv_idx: [start_pos + L] int64 slots of positions 0.. ; returns [L, h, d] (causal)."""
        ...

    def attn_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
        lengths: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """q: [Bt, h, d]; kv_idx: [Bt, T] int64 slots, padded with 0 past lengths[b]; returns [Bt, h, d]."""
        ...
