"""Triton attention over slot-indexed KV (paged, page size 1): decode (split-K) and varlen prefill.

Same semantics as `reference.attention_decode` /
`attention_prefill` after gathering K/V through the slot lists: query head i reads KV head
i // (h // kvh), scores are scaled by `scale`, softmax (online, flash style) in float32, output in
q's dtype. K/V of the step's own tokens must already be in the pool (the model writes them first).

Decode: one program per (request, KV head, split of `split_size` keys) handles every query head of
that KV head (GQA packing: the group is padded to 16 rows so tl.dot can use tensor cores); with
several splits the partial (max, sum, acc) triples are merged in order by `_attn_merge_kernel`.
A request whose length is 0 gets zeros (the reference would give NaN; the runtime never sends one).
Prefill: one program per (query block, request, query head) over the causal window
[0, start_pos + row] of that request's KV slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_proc.kernels.triton.common import dot_precision, mma


@triton.jit
def _online_block(q, k, v, valid, m, l_sum, acc, scale, DOT_PREC: tl.constexpr):
    """One flash-attention step: fold keys/values k, v [BLOCK_T, D] (valid [R, BLOCK_T]) into (m, l, acc)."""
    s = mma(q, tl.trans(k), DOT_PREC) * scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet
    p = tl.where(valid, tl.exp(s - m_safe[:, None]), 0.0)
    alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC)
    return m_new, l_sum, acc


@triton.jit
def _attn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    len_ptr,
    out_ptr,
    part_ptr,
    ml_ptr,
    heads,
    group,
    head_dim,
    split_size,
    num_splits,
    scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ib,
    stride_it,
    stride_ob,
    stride_oh,
    stride_od,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (rows, kv heads, splits). SPLIT: write fp32 partials to part/ml instead of the output."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(len_ptr + b)
    lo = sp * split_size
    hi = tl.minimum(lo + split_size, length)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    qh = kh * group + offs_g
    mask_g = offs_g < group
    mask_d = offs_d < head_dim
    q = tl.load(
        q_ptr + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < hi
        slot = tl.load(idx_ptr + b * stride_ib + offs_t * stride_it, mask=mask_t, other=0).to(tl.int64)
        kv_mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kh * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kh * stride_vh + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        valid = mask_g[:, None] & mask_t[None, :]
        m, l_sum, acc = _online_block(q, k.to(q.dtype), v.to(q.dtype), valid, m, l_sum, acc, scale, DOT_PREC)
    if SPLIT:
        row = (b * heads + qh) * num_splits + sp  # [BLOCK_G] index into [Bt, h, splits]
        tl.store(part_ptr + row[:, None] * head_dim + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
        tl.store(ml_ptr + row * 2, m, mask=mask_g)
        tl.store(ml_ptr + row * 2 + 1, l_sum, mask=mask_g)
    else:
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + qh[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )


@triton.jit
def _attn_merge_kernel(
    part_ptr, ml_ptr, len_ptr, out_ptr, heads, head_dim, num_splits, split_size,
    stride_ob, stride_oh, stride_od,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (rows, query heads): merge the (m, l, acc) of the splits holding keys into the output.
    Sequential over those splits in a fixed order: the result does not depend on the batch."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    n = tl.minimum((tl.load(len_ptr + b) + split_size - 1) // split_size, num_splits)
    base = (b * heads + h) * num_splits
    m_max = float("-inf")
    for i in range(0, n):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (base + i) * 2))
    total = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, n):
        w = tl.exp(tl.load(ml_ptr + (base + i) * 2) - m_max)  # every merged split holds keys: m is finite
        total += tl.load(ml_ptr + (base + i) * 2 + 1) * w
        acc += tl.load(part_ptr + (base + i) * head_dim + offs_d, mask=mask_d, other=0.0) * w
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask_d
    )


@triton.jit
def _attn_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    cu_q_ptr,
    cu_kv_ptr,
    out_ptr,
    group,
    head_dim,
    scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (query blocks of the longest request, requests, query heads)."""
    req = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    length = tl.load(cu_q_ptr + req + 1) - q_start
    kv_start = tl.load(cu_kv_ptr + req)
    start_pos = tl.load(cu_kv_ptr + req + 1) - kv_start - length  # cached prefix tokens
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < length:
        kh = h // group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < length
        mask_d = offs_d < head_dim
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        qpos = start_pos + offs_m
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        hi = start_pos + tl.minimum(m0 + BLOCK_M, length)  # keys the last row of this block sees
        for t0 in range(0, hi, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            mask_t = offs_t < hi
            slot = tl.load(idx_ptr + kv_start + offs_t, mask=mask_t, other=0).to(tl.int64)
            kv_mask = mask_t[:, None] & mask_d[None, :]
            k = tl.load(
                k_ptr + slot[:, None] * stride_ks + kh * stride_kh + offs_d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            )
            v = tl.load(
                v_ptr + slot[:, None] * stride_vs + kh * stride_vh + offs_d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            )
            valid = mask_m[:, None] & mask_t[None, :] & (offs_t[None, :] <= qpos[:, None])
            m, l_sum, acc = _online_block(q, k.to(q.dtype), v.to(q.dtype), valid, m, l_sum, acc, scale, DOT_PREC)
        out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def attn_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_idx: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    split_size: int = 256,
) -> torch.Tensor:
    """q: [Bt, h, d]; k_pool, v_pool: [S, kvh, d]; kv_idx: [Bt, T] int slots (entries past lengths[b]
    are ignored); lengths: [Bt] int. Returns [Bt, h, d] in q's dtype.

    Keys are split into fixed `split_size` ranges (split-K, one program each, merged in order), so
    how a request's keys are cut and summed never depends on the rest of the batch: a request's
    output is bitwise the same alone or batched (batch invariance, as the CPU reference path has)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_t = 64 if head_dim <= 64 else 32
    splits = triton.cdiv(max(kv_idx.shape[1], 1), split_size)
    part = ml = out  # placeholders when not split (never dereferenced)
    if splits > 1:
        part = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _attn_decode_kernel[(batch, kv_heads, splits)](
        q,
        k_pool,
        v_pool,
        kv_idx,
        lengths,
        out,
        part,
        ml,
        heads,
        group,
        head_dim,
        split_size,
        splits,
        float(scale),
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *kv_idx.stride(),
        *out.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        SPLIT=splits > 1,
        DOT_PREC=dot_precision(q.dtype),
    )
    if splits > 1:
        _attn_merge_kernel[(batch, heads)](
            part, ml, lengths, out, heads, head_dim, splits, split_size, *out.stride(), BLOCK_D=block_d
        )
    return out


def attn_prefill_varlen(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_idx: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over each request's whole KV.

    q: [Tq, h, d] (request r's new tokens are rows cu_q[r]..cu_q[r+1]); kv_idx: [sum of KV lengths]
    int slots, request r's positions 0.. at entries cu_kv[r]..cu_kv[r+1] (its cached prefix length is
    the KV length minus its new tokens); cu_q, cu_kv: [B+1] int32; max_len >= every request's new
    tokens. Returns [Tq, h, d] in q's dtype.
    """
    total, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    out = torch.empty_like(q)
    batch = cu_q.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    block_m, block_t = (64, 64) if head_dim <= 64 else (64, 32)
    _attn_prefill_kernel[(triton.cdiv(max_len, block_m), batch, heads)](
        q,
        k_pool,
        v_pool,
        kv_idx,
        cu_q,
        cu_kv,
        out,
        heads // kv_heads,
        head_dim,
        float(scale),
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *out.stride(),
        BLOCK_M=block_m,
        BLOCK_T=block_t,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PREC=dot_precision(q.dtype),
        num_warps=8 if head_dim > 64 else 4,  # 4 warps spill registers with 128-wide heads (ptxas -v, sm_90)
    )
    return out
