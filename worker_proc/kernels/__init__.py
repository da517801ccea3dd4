"""Kernel dispatch: the only kernel entry points the model calls.

Owned by the worker runtime. Every op reads and writes the state pools *by slot* so a fused
device kernel (Triton on CUDA, added later) can replace the reference composition without any
change in model code: `get_ops(device)` picks the implementation once, the model keeps the
returned object. Shapes use the letters documented in `worker_proc.kernels.reference`; pool
tensors are one layer's view (`[S, ...]`, S = slots + 1, slot 0 = padding).
"""

from __future__ import annotations

import os

import torch

from worker_proc.kernels import reference as ref


class ReferenceOps:
    """Pure-torch ops over pool slots; correct on every device, fast on none.

    `batch_invariant`: decode attention runs request by request with exactly the computation a
    request gets alone, so a request's logits do not depend on what it is batched with (CPU
    default: tests compare batched serving with single-request references token for token).
    Otherwise decode attention is one padded batched computation (faster, equal to ~1e-6).
    """

    name = "reference"

    def __init__(self, batch_invariant: bool = True) -> None:
        self.batch_invariant = batch_invariant

    def conv_prefill(
        self, x: torch.Tensor, conv_pool: torch.Tensor, slot: int, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [L, Cd] -> SiLU(causal conv) [L, Cd]; conv_pool: [S, Cd, K-1], row `slot` advanced."""
        out, new_state = ref.causal_conv1d(x, conv_pool[slot], weight, bias)
        conv_pool[slot].copy_(new_state)
        return out

    def conv_decode(
        self,
        x: torch.Tensor,
        conv_pool: torch.Tensor,
        slots: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [Bt, Cd], slots: [Bt] int64 (distinct) -> [Bt, Cd]; rows `slots` advanced by one."""
        out, new_state = ref.causal_conv1d_step(x, conv_pool.index_select(0, slots), weight, bias)
        conv_pool.index_copy_(0, slots, new_state.to(conv_pool.dtype))
        return out

    def ssd_prefill(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        chunk_size: int,
        ssm_pool: torch.Tensor,
        slot: int,
    ) -> torch.Tensor:
        """x: [L, H, P]; dt: [L, H] raw (bias, softplus and clamp applied here); a, d, dt_bias: [H];
        b, c: [L, G, N]; ssm_pool: [S, H, P, N] fp32, row `slot` advanced. Returns y [L, H, P] fp32."""
        dt = ref.discretize_dt(dt, dt_bias, dt_limit)
        y, final = ref.ssd_chunk_scan(x, dt, a, b, c, d, chunk_size, ssm_pool[slot])
        ssm_pool[slot].copy_(final)
        return y

    def ssd_decode(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        ssm_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """x: [Bt, H, P]; dt: [Bt, H] raw; b, c: [Bt, G, N]; slots: [Bt] int64 (distinct).
        Returns y [Bt, H, P] fp32; rows `slots` of ssm_pool advanced by one token."""
        dt = ref.discretize_dt(dt, dt_bias, dt_limit)
        y, new_state = ref.ssd_state_step(ssm_pool.index_select(0, slots), x, dt, a, b, c, d)
        ssm_pool.index_copy_(0, slots, new_state)
        return y

    def attn_prefill(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_idx: torch.Tensor,
        start_pos: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [L, h, d]; k_pool, v_pool: [S, kvh, d] (this step's K/V already written);
        kv_idx: [start_pos + L] int64 slots of positions 0.. ; returns [L, h, d]."""
        k = k_pool.index_select(0, kv_idx)
        v = v_pool.index_select(0, kv_idx)
        return ref.attention_prefill(q, k, v, start_pos, scale)

    def attn_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_idx: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [Bt, h, d]; kv_idx: [Bt, T] int64 slots, padded with 0 past lengths[b]; returns [Bt, h, d]."""
        if self.batch_invariant:
            out = torch.empty_like(q)
            for b, n in enumerate(lengths.tolist()):
                idx = kv_idx[b, :n]
                out[b : b + 1] = ref.attention_prefill(q[b : b + 1], k_pool[idx], v_pool[idx], n - 1, scale)
            return out
        k = k_pool[kv_idx]
        v = v_pool[kv_idx]
        return ref.attention_decode(q, k, v, lengths, scale)


KernelOps = ReferenceOps
"""The interface every implementation provides (the reference defines it)."""


def get_ops(device: torch.device | str, force: str | None = None) -> KernelOps:
    """The kernel implementation for `device`: Triton kernels for CUDA tensors, the reference
    elsewhere (batch invariant on CPU). `force`, or else the HYSSM_KERNELS environment variable
    ("reference" | "triton"), overrides the choice for debugging."""
    from worker_proc.kernels.triton_select import select_ops

    return select_ops(device, force if force is not None else os.environ.get("HYSSM_KERNELS"))


__all__ = ["KernelOps", "ReferenceOps", "get_ops"]
