"""Triton causal depthwise conv1d + SiLU (or without it: `SILU`) over slot-indexed conv state (prefill,
varlen; decode).

Semantics are those of
`worker_proc.kernels.reference.causal_conv1d` / `causal_conv1d_step`: the conv state of a slot holds
the K-1 inputs before the next token, oldest first. Accumulation is float32 whatever the input dtype
(the reference convolves in the weight dtype; both are identical in float32).

Rules that must hold:
- The prefill output kernel only *reads* the pool; the final state is written by a second launch
  (same stream, so ordered after every read of the initial state). One launch could not do both:
  another program of the same request might still read the initial state being overwritten.
- A program that overwrites pool elements has loaded everything it needs first (debug_barrier
  between the loads and the stores, since a state element is read by one thread and written by
  another).
- Slot 0 is padding: decode rows whose slot is 0 compute an output from the (zero) padding state
  and never write it back. Prefill requests must use slots >= 1 (checked by the callers' batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr,
    out_ptr,
    pool_ptr,
    w_ptr,
    bias_ptr,
    cu_ptr,
    slot_ptr,
    channels,
    stride_xt,
    stride_xc,
    stride_ot,
    stride_oc,
    stride_ps,
    stride_pc,
    stride_pk,
    stride_wc,
    stride_wk,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (requests, token blocks of the longest request, channel blocks). Reads only."""
    req = tl.program_id(0)
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    l0 = tl.program_id(1) * BLOCK_L
    if l0 < length:
        slot = tl.load(slot_ptr + req).to(tl.int64)
        offs_l = l0 + tl.arange(0, BLOCK_L)
        offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_l = offs_l < length
        mask_c = offs_c < channels
        acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(K):
            pos = offs_l - (K - 1) + k  # input position feeding tap k; < 0 reads the carried state
            in_x = mask_l & (pos >= 0)
            in_state = mask_l & (pos < 0)
            xv = tl.load(
                x_ptr + (start + pos).to(tl.int64)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                mask=in_x[:, None] & mask_c[None, :],
                other=0.0,
            ).to(tl.float32)
            sv = tl.load(
                pool_ptr + slot * stride_ps + offs_c[None, :] * stride_pc + (pos + K - 1)[:, None] * stride_pk,
                mask=in_state[:, None] & mask_c[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=mask_c, other=0.0).to(tl.float32)
            acc += (xv + sv) * w[None, :]
        y = acc
        if SILU:
            y = acc / (1.0 + tl.exp(-acc))
        tl.store(
            out_ptr + (start + offs_l).to(tl.int64)[:, None] * stride_ot + offs_c[None, :] * stride_oc,
            y.to(out_ptr.dtype.element_ty),
            mask=mask_l[:, None] & mask_c[None, :],
        )


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr,
    pool_ptr,
    cu_ptr,
    slot_ptr,
    channels,
    stride_xt,
    stride_xc,
    stride_ps,
    stride_pc,
    stride_pk,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (requests, channel blocks): new state = the last K-1 inputs of (old state ++ x)."""
    req = tl.program_id(0)
    start = tl.load(cu_ptr + req)
    length = tl.load(cu_ptr + req + 1) - start
    slot = tl.load(slot_ptr + req).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < channels
    mask_k = offs_k < KM1
    pos = length - KM1 + offs_k  # position in x of new state column k; < 0 -> old column length + k
    from_x = mask_k & (pos >= 0)
    from_state = mask_k & (pos < 0)
    xv = tl.load(
        x_ptr + (start + pos).to(tl.int64)[None, :] * stride_xt + offs_c[:, None] * stride_xc,
        mask=mask_c[:, None] & from_x[None, :],
        other=0.0,
    )
    base = pool_ptr + slot * stride_ps + offs_c[:, None] * stride_pc
    sv = tl.load(base + (length + offs_k)[None, :] * stride_pk, mask=mask_c[:, None] & from_state[None, :], other=0.0)
    new = xv.to(pool_ptr.dtype.element_ty) + sv
    tl.debug_barrier()  # every old column is loaded before any is overwritten
    tl.store(base + offs_k[None, :] * stride_pk, new, mask=mask_c[:, None] & mask_k[None, :])


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    out_ptr,
    pool_ptr,
    w_ptr,
    bias_ptr,
    slot_ptr,
    channels,
    stride_xb,
    stride_xc,
    stride_ob,
    stride_oc,
    stride_ps,
    stride_pc,
    stride_pk,
    stride_wc,
    stride_wk,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (batch rows, channel blocks): one token per row against its slot's conv state."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < channels
    mask_ck = mask_c[:, None] & (offs_k < KM1)[None, :]
    base = pool_ptr + slot * stride_ps + offs_c[:, None] * stride_pc
    state = tl.load(base + offs_k[None, :] * stride_pk, mask=mask_ck, other=0.0)
    x = tl.load(x_ptr + row * stride_xb + offs_c * stride_xc, mask=mask_c, other=0.0)
    w_state = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :] * stride_wk, mask=mask_ck, other=0.0)
    w_last = tl.load(w_ptr + offs_c * stride_wc + KM1 * stride_wk, mask=mask_c, other=0.0)
    acc = tl.sum(state.to(tl.float32) * w_state.to(tl.float32), axis=1) + x.to(tl.float32) * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    y = acc
    if SILU:
        y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + row * stride_ob + offs_c * stride_oc, y.to(out_ptr.dtype.element_ty), mask=mask_c)
    if slot != 0:  # slot 0 is padding: never written
        # shift left by one: column k takes old column k+1, the last column takes x
        nxt = tl.load(base + (offs_k + 1)[None, :] * stride_pk, mask=mask_ck & (offs_k + 1 < KM1)[None, :], other=0.0)
        is_last = (offs_k == KM1 - 1)[None, :]
        new = tl.where(is_last, x.to(pool_ptr.dtype.element_ty)[:, None], nxt)
        tl.debug_barrier()  # every old column is loaded before any is overwritten
        tl.store(base + offs_k[None, :] * stride_pk, new, mask=mask_ck)


def conv_prefill_varlen(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Causal conv1d + SiLU (the conv alone when not `silu`) over a ragged batch, each request
    continuing from its slot's state.

    x: [T, Cd] (requests' tokens concatenated; any strides); cu_seqlens: [B+1] int32 on x's device
    (request r owns rows cu[r]..cu[r+1]); max_len >= every request's length; conv_pool: [S, Cd, K-1];
    slots: [B] int (distinct, >= 1); weight: [Cd, K]; bias: [Cd] or None.
    Returns out [T, Cd] in x's dtype; conv_pool rows `slots` hold each request's last K-1 inputs.
    """
    total, channels = x.shape
    k = weight.shape[-1]
    batch = slots.shape[0]
    out = torch.empty((total, channels), dtype=x.dtype, device=x.device)
    if total == 0 or batch == 0:
        return out
    block_l, block_c = 32, 64
    grid = (batch, triton.cdiv(max_len, block_l), triton.cdiv(channels, block_c))
    _conv_prefill_out_kernel[grid](
        x,
        out,
        conv_pool,
        weight,
        bias if bias is not None else weight,
        cu_seqlens,
        slots,
        channels,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        conv_pool.stride(0),
        conv_pool.stride(1),
        conv_pool.stride(2),
        weight.stride(0),
        weight.stride(1),
        K=k,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_L=block_l,
        BLOCK_C=block_c,
    )
    if k > 1:
        block_c = 128
        _conv_prefill_state_kernel[(batch, triton.cdiv(channels, block_c))](
            x,
            conv_pool,
            cu_seqlens,
            slots,
            channels,
            x.stride(0),
            x.stride(1),
            conv_pool.stride(0),
            conv_pool.stride(1),
            conv_pool.stride(2),
            KM1=k - 1,
            BLOCK_K=triton.next_power_of_2(k - 1),
            BLOCK_C=block_c,
        )
    return out


def conv_decode(
    x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """One token per row (`silu` as in `conv_prefill_varlen`). x: [Bt, Cd]; slots: [Bt] int (distinct;
    0 = padding row, state not written).
    Returns out [Bt, Cd] in x's dtype; conv_pool rows `slots` advanced by one token in place."""
    batch, channels = x.shape
    k = weight.shape[-1]
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    if k < 2:
        raise ValueError("conv_decode needs a conv kernel width >= 2")
    block_c = 128
    _conv_decode_kernel[(batch, triton.cdiv(channels, block_c))](
        x,
        out,
        conv_pool,
        weight,
        bias if bias is not None else weight,
        slots,
        channels,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        conv_pool.stride(0),
        conv_pool.stride(1),
        conv_pool.stride(2),
        weight.stride(0),
        weight.stride(1),
        KM1=k - 1,
        BLOCK_K=triton.next_power_of_2(k - 1),
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_C=block_c,
    )
    return out
