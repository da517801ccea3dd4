"""Triton Mamba1 selective scan over slot-indexed per-channel SSM states: prefill segments and decode rows
alike (a decode row is a segment of one token).

Same math as worker_proc.kernels.selective_scan, with dt discretized in the kernel (softplus(dt + dt_bias)):

    state[slot, c] <- state[slot, c] * exp(dt[c] * A[c]) + dt[c] * x[c] * B
    y[c] = state[slot, c] . C + D[c] * x[c]

One program owns a block of channels of one segment and walks its tokens in order, the block's [channels, N]
state held in registers: loaded once from the pool and stored once after the segment's last token. Rules that
must hold: the pool is float32 (the caller decodes a bfloat16 or int8 one, `state_codec.run_on_float32`);
segments' slots are distinct, so no two programs touch the same state row; a segment whose slot is 0
(padding) gets outputs computed from the zero padding state and never writes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_proc.kernels.triton.common import softplus_clamp


@triton.jit
def _selective_scan_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_bias_ptr,
    pool_ptr,
    start_ptr,
    length_ptr,
    slot_ptr,
    y_ptr,
    channels,
    dstate,
    stride_xt,
    stride_dtt,
    stride_bt,
    stride_ct,
    stride_ps,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (segments, channel blocks). x, dt: [T, D] (unit channel stride); b, c: [T, N] (unit stride); a [D, N],
    pool [S, D, N] contiguous float32; y [T, D] float32, contiguous."""
    seg = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < channels
    mask_n = offs_n < dstate
    mask = mask_d[:, None] & mask_n[None, :]
    start = tl.load(start_ptr + seg).to(tl.int64)
    length = tl.load(length_ptr + seg)
    slot = tl.load(slot_ptr + seg).to(tl.int64)
    a = tl.load(a_ptr + offs_d[:, None] * dstate + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    ptrs = pool_ptr + slot * stride_ps + offs_d[:, None] * dstate + offs_n[None, :]
    state = tl.load(ptrs, mask=mask, other=0.0)
    for i in range(length):
        t = start + i
        x = tl.load(x_ptr + t * stride_xt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        raw = tl.load(dt_ptr + t * stride_dtt + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        dt = softplus_clamp(raw + bias, 0.0, float("inf"))
        bb = tl.load(b_ptr + t * stride_bt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + t * stride_ct + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        state = state * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(state * cc[None, :], axis=1) + d * x
        tl.store(y_ptr + t * channels + offs_d, y, mask=mask_d)
    if slot != 0:  # slot 0 is padding: never written
        tl.store(ptrs, state, mask=mask)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, starts: torch.Tensor,
                   lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Segments i = rows [starts[i], starts[i] + lengths[i]) advancing slots[i] (int tensors on the device).
    x, dt: [T, D] (dt raw); b, c: [T, N]; a: [D, N] float32; d, dt_bias: [D]; pool: [S, D, N] float32.
    Returns y [T, D] float32 with the D skip; the segments' slots advanced in place."""
    rows, channels = x.shape
    dstate = b.shape[1]
    y = torch.empty((rows, channels), dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    x, dt, b, c = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, b, c))
    block_n = triton.next_power_of_2(dstate)
    block_d = max(1, min(64, 2048 // block_n))
    grid = (slots.shape[0], triton.cdiv(channels, block_d))
    _selective_scan_kernel[grid](
        x, dt, a.contiguous(), b, c, d, dt_bias, pool, starts, lengths, slots, y, channels, dstate,
        x.stride(0), dt.stride(0), b.stride(0), c.stride(0), pool.stride(0), BLOCK_D=block_d, BLOCK_N=block_n,
    )  # fmt: skip
    return y
