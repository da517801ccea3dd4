"""Triton single-token selective state update (Mamba2 decode) over slot-indexed SSM state.

Same math as `reference.ssd_state_step` with dt
discretized in the kernel (softplus(dt + dt_bias), clamped):

    state[slot, h] <- state[slot, h] * exp(dt * A[h]) + dt * x[h, :, None] * B[g(h), None, :]
    y[h] = state[slot, h] . C[g(h)] + D[h] * x[h]

Rules that must hold: each state element is loaded and stored by the same thread (same tile shape),
so the in-place update needs no barrier; rows whose slot is 0 (padding) get an output computed from
the zero padding state and never write it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_proc.kernels.triton.common import softplus_clamp


@triton.jit
def _ssd_step_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_bias_ptr,
    pool_ptr,
    slot_ptr,
    y_ptr,
    heads,
    head_dim,
    dstate,
    heads_per_group,
    dt_lo,
    dt_hi,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_dtb,
    stride_dth,
    stride_bb,
    stride_bg,
    stride_bn,
    stride_cb,
    stride_cg,
    stride_cn,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_pn,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (rows, heads, P blocks). y: [Bt, H, P] float32, contiguous."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < dstate
    g = h // heads_per_group
    slot = tl.load(slot_ptr + row).to(tl.int64)
    raw = tl.load(dt_ptr + row * stride_dtb + h * stride_dth).to(tl.float32)
    dt = softplus_clamp(raw + tl.load(dt_bias_ptr + h).to(tl.float32), dt_lo, dt_hi)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + row * stride_xb + h * stride_xh + offs_p * stride_xp, mask=mask_p, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + row * stride_bb + g * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)
    cc = tl.load(c_ptr + row * stride_cb + g * stride_cg + offs_n * stride_cn, mask=mask_n, other=0.0).to(tl.float32)
    ptrs = pool_ptr + slot * stride_ps + h * stride_ph + offs_p[:, None] * stride_pp + offs_n[None, :] * stride_pn
    mask = mask_p[:, None] & mask_n[None, :]
    state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    state = state * decay + (dt * x)[:, None] * bb[None, :]
    y = tl.sum(state * cc[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + (row * heads + h) * head_dim + offs_p, y, mask=mask_p)
    if slot != 0:  # slot 0 is padding: never written
        tl.store(ptrs, state, mask=mask)


def ssd_step(
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
    """One token per row. x: [Bt, H, P]; dt: [Bt, H] raw; a, d, dt_bias: [H]; b, c: [Bt, G, N];
    ssm_pool: [S, H, P, N] float32; slots: [Bt] int (distinct; 0 = padding row, not written).
    Returns y [Bt, H, P] float32; rows `slots` of ssm_pool advanced by one token in place."""
    batch, heads, head_dim = x.shape
    groups, dstate = b.shape[1], b.shape[2]
    y = torch.empty((batch, heads, head_dim), dtype=torch.float32, device=x.device)
    if batch == 0:
        return y
    block_n = triton.next_power_of_2(dstate)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssd_step_kernel[grid](
        x,
        dt,
        a,
        b,
        c,
        d,
        dt_bias,
        ssm_pool,
        slots,
        y,
        heads,
        head_dim,
        dstate,
        heads // groups,
        float(dt_limit[0]),
        float(dt_limit[1]),
        *x.stride(),
        *dt.stride(),
        *b.stride(),
        *c.stride(),
        *ssm_pool.stride(),
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )
    return y
