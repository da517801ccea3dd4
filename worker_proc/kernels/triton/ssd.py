"""Triton chunked SSD (Mamba2) scan over a ragged batch with per-request initial/final state in the pool.

Same math as `reference.ssd_chunk_scan` (dt discretized
here: softplus(dt + dt_bias), clamped), split into four launches over the chunks of a `ChunkPlan`:

1. `_dt_cumsum`: discretized dt and the within-chunk cumulative sum of dt * A, per head and token.
2. `_chunk_state`: each chunk's own contribution to the state at its end (x^T . (decay * dt * B)).
3. `_state_pass`: per request, sequential over its chunks: replaces each chunk's contribution by the
   state at the chunk's start, reading the initial state from the pool slot and writing the final
   state back to it (each state element is read and written by the same thread: no barrier needed).
4. `_chunk_scan`: outputs y = intra-chunk (causal, decayed C.B) + C . start state + D * x.

Accumulation is float32; matmul operands are the input dtype (bf16/fp16 tensor cores), fp32 inputs
use exact ("ieee") dots so fp32 results match the reference to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker_proc.kernels.triton.chunk_plan import FINAL, ChunkPlan
from worker_proc.kernels.triton.common import dot_precision, mma, pow2, softplus_clamp


@triton.jit
def _dt_cumsum_kernel(
    dt_ptr,
    dt_bias_ptr,
    a_ptr,
    cstart_ptr,
    clen_ptr,
    dt_out_ptr,
    cs_out_ptr,
    heads,
    total,
    dt_lo,
    dt_hi,
    stride_dtt,
    stride_dth,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (chunks, head blocks). Writes dt_out, cs_out: [H, T] float32."""
    chunk = tl.program_id(0)
    start = tl.load(cstart_ptr + chunk)
    length = tl.load(clen_ptr + chunk)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < heads
    mask = (offs_q < length)[:, None] & mask_h[None, :]
    rows = (start + offs_q).to(tl.int64)
    raw = tl.load(dt_ptr + rows[:, None] * stride_dtt + offs_h[None, :] * stride_dth, mask=mask, other=0.0)
    bias = tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt = softplus_clamp(raw.to(tl.float32) + bias[None, :], dt_lo, dt_hi)
    dt = tl.where(mask, dt, 0.0)
    cs = tl.cumsum(dt * a[None, :], axis=0)
    out = offs_h[None, :].to(tl.int64) * total + rows[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask)
    tl.store(cs_out_ptr + out, cs, mask=mask)


@triton.jit
def _chunk_state_kernel(
    x_ptr,
    b_ptr,
    dt_ptr,
    cs_ptr,
    cstart_ptr,
    clen_ptr,
    states_ptr,
    heads,
    total,
    head_dim,
    dstate,
    heads_per_group,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_bt,
    stride_bg,
    stride_bn,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (chunks, heads, P blocks * N blocks). states[c, h] = sum_q x_q^T (exp(cs_end - cs_q) dt_q B_q)."""
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    n_blocks = tl.cdiv(dstate, BLOCK_N)
    offs_p = (tl.program_id(2) // n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(cstart_ptr + chunk)
    length = tl.load(clen_ptr + chunk)
    g = h // heads_per_group
    head_row = h.to(tl.int64) * total
    cs_end = tl.load(cs_ptr + head_row + start + length - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for q0 in range(0, length, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        mask_q = offs_q < length
        rows = (start + offs_q).to(tl.int64)
        xt = tl.load(
            x_ptr + rows[None, :] * stride_xt + h * stride_xh + offs_p[:, None] * stride_xp,
            mask=mask_q[None, :] & (offs_p < head_dim)[:, None],
            other=0.0,
        )
        bb = tl.load(
            b_ptr + rows[:, None] * stride_bt + g * stride_bg + offs_n[None, :] * stride_bn,
            mask=mask_q[:, None] & (offs_n < dstate)[None, :],
            other=0.0,
        )
        dt = tl.load(dt_ptr + head_row + rows, mask=mask_q, other=0.0)
        cs = tl.load(cs_ptr + head_row + rows, mask=mask_q, other=0.0)
        scale = tl.where(mask_q, tl.exp(cs_end - cs) * dt, 0.0)
        xs = (xt.to(tl.float32) * scale[None, :]).to(bb.dtype)
        acc += mma(xs, bb, DOT_PREC)
    out = states_ptr + (chunk.to(tl.int64) * heads + h) * head_dim * dstate
    mask = (offs_p < head_dim)[:, None] & (offs_n < dstate)[None, :]
    tl.store(out + offs_p[:, None] * dstate + offs_n[None, :], acc, mask=mask)


@triton.jit
def _state_pass_kernel(
    states_ptr,
    cs_ptr,
    cstart_ptr,
    clen_ptr,
    req_chunks_ptr,
    pool_ptr,
    slot_ptr,
    heads,
    total,
    state_numel,
    stride_ps,
    stride_ph,
    BLOCK: tl.constexpr,
):
    """Grid (requests, heads, blocks of the flattened [P, N] state). The pool's [P, N] per head must
    be contiguous. Turns states[c] into the state at chunk c's start; pool[slot] <- final state."""
    req = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < state_numel
    slot = tl.load(slot_ptr + req).to(tl.int64)
    pool = pool_ptr + slot * stride_ps + h * stride_ph + offs
    state = tl.load(pool, mask=mask, other=0.0).to(tl.float32)
    c0 = tl.load(req_chunks_ptr + req)
    c1 = tl.load(req_chunks_ptr + req + 1)
    for i in range(0, c1 - c0):
        c = c0 + i  # a tensor in both compiled and interpreted mode (a range variable is not)
        ptr = states_ptr + (c.to(tl.int64) * heads + h) * state_numel + offs
        local = tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, state, mask=mask)
        end = tl.load(cstart_ptr + c) + tl.load(clen_ptr + c) - 1
        state = state * tl.exp(tl.load(cs_ptr + h.to(tl.int64) * total + end)) + local
    tl.store(pool, state, mask=mask)


@triton.jit
def _chunk_scan_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_ptr,
    cs_ptr,
    cstart_ptr,
    clen_ptr,
    states_ptr,
    y_ptr,
    heads,
    total,
    head_dim,
    dstate,
    heads_per_group,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_bt,
    stride_bg,
    stride_bn,
    stride_ct,
    stride_cg,
    stride_cn,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L_BLOCKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (chunks * L_BLOCKS, heads). y rows [l0, l0 + BLOCK_L) of one chunk and head, all of P."""
    chunk = tl.program_id(0) // L_BLOCKS
    l0 = (tl.program_id(0) % L_BLOCKS) * BLOCK_L
    h = tl.program_id(1)
    start = tl.load(cstart_ptr + chunk)
    length = tl.load(clen_ptr + chunk)
    if l0 < length:
        g = h // heads_per_group
        head_row = h.to(tl.int64) * total
        offs_l = l0 + tl.arange(0, BLOCK_L)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_l = offs_l < length
        mask_p = offs_p < head_dim
        mask_n = offs_n < dstate
        rows_l = (start + offs_l).to(tl.int64)
        cc = tl.load(
            c_ptr + rows_l[:, None] * stride_ct + g * stride_cg + offs_n[None, :] * stride_cn,
            mask=mask_l[:, None] & mask_n[None, :],
            other=0.0,
        )
        cs_l = tl.load(cs_ptr + head_row + rows_l, mask=mask_l, other=0.0)
        # contribution of the state at the chunk start: exp(cs_l) * C_l . S^T
        s_ptr = states_ptr + (chunk.to(tl.int64) * heads + h) * head_dim * dstate
        s_t = tl.load(
            s_ptr + offs_n[:, None] + offs_p[None, :] * dstate, mask=mask_n[:, None] & mask_p[None, :], other=0.0
        )
        acc = mma(cc.to(tl.float32), s_t, DOT_PREC) * tl.exp(cs_l)[:, None]
        # intra-chunk causal part over source rows s <= l
        s_end = tl.minimum(l0 + BLOCK_L, length)
        for s0 in range(0, s_end, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            mask_s = offs_s < s_end
            rows_s = (start + offs_s).to(tl.int64)
            bb = tl.load(
                b_ptr + rows_s[:, None] * stride_bt + g * stride_bg + offs_n[None, :] * stride_bn,
                mask=mask_s[:, None] & mask_n[None, :],
                other=0.0,
            )
            cb = mma(cc, tl.trans(bb), DOT_PREC)
            cs_s = tl.load(cs_ptr + head_row + rows_s, mask=mask_s, other=0.0)
            dt_s = tl.load(dt_ptr + head_row + rows_s, mask=mask_s, other=0.0)
            causal = (offs_s[None, :] <= offs_l[:, None]) & mask_s[None, :] & mask_l[:, None]
            decay = tl.exp(tl.minimum(cs_l[:, None] - cs_s[None, :], 0.0))
            w = tl.where(causal, cb * decay * dt_s[None, :], 0.0)
            xs = tl.load(
                x_ptr + rows_s[:, None] * stride_xt + h * stride_xh + offs_p[None, :] * stride_xp,
                mask=mask_s[:, None] & mask_p[None, :],
                other=0.0,
            )
            acc += mma(w.to(xs.dtype), xs, DOT_PREC)
        xl = tl.load(
            x_ptr + rows_l[:, None] * stride_xt + h * stride_xh + offs_p[None, :] * stride_xp,
            mask=mask_l[:, None] & mask_p[None, :],
            other=0.0,
        )
        acc += tl.load(d_ptr + h).to(tl.float32) * xl.to(tl.float32)
        y_rows = (rows_l * heads + h) * head_dim
        tl.store(y_ptr + y_rows[:, None] + offs_p[None, :], acc, mask=mask_l[:, None] & mask_p[None, :])


@dataclass(frozen=True)
class _Scan:
    """Sizes and device-side chunk metadata shared by the four launches of one scan."""

    total: int
    heads: int
    head_dim: int
    dstate: int
    per_group: int  # heads per B/C group
    num_chunks: int
    chunk_size: int
    cstart: torch.Tensor
    clen: torch.Tensor
    req_chunks: torch.Tensor
    prec: str


def ssd_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    plan: ChunkPlan,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of a ragged batch laid out by `plan` (request r owns rows cu[r]..cu[r+1]).

    x: [T, H, P]; dt: [T, H] raw (discretized here); a, d, dt_bias: [H]; b, c: [T, G, N];
    ssm_pool: [S, H, P, N] float32 with each head's [P, N] contiguous; slots: [B] int (distinct, >= 1):
    request r starts from ssm_pool[slots[r]] and its final state is written there.
    Returns (y [T, H, P] float32 including D * x, states [len(plan.state_req), H, P, N] float32 =
    the states at the plan's requested positions).
    """
    total, heads, head_dim = x.shape
    groups, dstate = b.shape[1], b.shape[2]
    if ssm_pool.stride(3) != 1 or ssm_pool.stride(2) != dstate:
        raise ValueError("ssm_pool needs each head's [P, N] state contiguous")
    if total != sum(plan.lengths) or slots.shape[0] != len(plan.lengths):
        raise ValueError(f"plan covers {sum(plan.lengths)} rows of {len(plan.lengths)} requests, got {total} rows")
    cstart, clen, req_chunks = plan.device_tensors(x.device)
    scan = _Scan(
        total, heads, head_dim, dstate, heads // groups, plan.num_chunks, plan.chunk_size,
        cstart, clen, req_chunks, dot_precision(x.dtype),
    )  # fmt: skip
    dt_d, cs = _launch_dt_cumsum(scan, dt, dt_bias, a, dt_limit)
    states = _launch_chunk_state(scan, x, b, dt_d, cs)
    _launch_state_pass(scan, states, cs, ssm_pool, slots)
    y = _launch_chunk_scan(scan, x, b, c, d, dt_d, cs, states)
    return y, _gather_states(plan, states, ssm_pool, slots)


def _launch_dt_cumsum(
    s: _Scan, dt: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, dt_limit: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    dt_d = torch.empty((s.heads, s.total), dtype=torch.float32, device=dt.device)
    cs = torch.empty_like(dt_d)
    block_q = pow2(s.chunk_size)
    block_h = max(1, min(pow2(s.heads, 1), 4096 // block_q))
    # fmt: off
    _dt_cumsum_kernel[(s.num_chunks, triton.cdiv(s.heads, block_h))](
        dt, dt_bias, a, s.cstart, s.clen, dt_d, cs, s.heads, s.total, float(dt_limit[0]), float(dt_limit[1]),
        dt.stride(0), dt.stride(1), BLOCK_Q=block_q, BLOCK_H=block_h,
    )
    # fmt: on
    return dt_d, cs


def _launch_chunk_state(
    s: _Scan, x: torch.Tensor, b: torch.Tensor, dt_d: torch.Tensor, cs: torch.Tensor
) -> torch.Tensor:
    states = torch.empty((s.num_chunks, s.heads, s.head_dim, s.dstate), dtype=torch.float32, device=x.device)
    bp, bn = min(pow2(s.head_dim), 64), min(pow2(s.dstate), 64)
    grid = (s.num_chunks, s.heads, triton.cdiv(s.head_dim, bp) * triton.cdiv(s.dstate, bn))
    # fmt: off
    _chunk_state_kernel[grid](
        x, b, dt_d, cs, s.cstart, s.clen, states, s.heads, s.total, s.head_dim, s.dstate, s.per_group,
        *x.stride(), *b.stride(), BLOCK_Q=min(pow2(s.chunk_size), 64), BLOCK_P=bp, BLOCK_N=bn, DOT_PREC=s.prec,
    )
    # fmt: on
    return states


def _launch_state_pass(
    s: _Scan, states: torch.Tensor, cs: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor
) -> None:
    numel = s.head_dim * s.dstate
    block = min(triton.next_power_of_2(numel), 1024)
    # fmt: off
    _state_pass_kernel[(slots.shape[0], s.heads, triton.cdiv(numel, block))](
        states, cs, s.cstart, s.clen, s.req_chunks, ssm_pool, slots, s.heads, s.total, numel,
        ssm_pool.stride(0), ssm_pool.stride(1), BLOCK=block,
    )
    # fmt: on


def _launch_chunk_scan(
    s: _Scan,
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_d: torch.Tensor,
    cs: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    y = torch.empty((s.total, s.heads, s.head_dim), dtype=torch.float32, device=x.device)
    block_l = min(pow2(s.chunk_size), 64)
    l_blocks = triton.cdiv(s.chunk_size, block_l)
    warps = 8 if pow2(s.dstate) * pow2(s.head_dim) >= 8192 else 4  # [64, 128] tiles: no spills with 8 (sm_90)
    # fmt: off
    _chunk_scan_kernel[(s.num_chunks * l_blocks, s.heads)](
        x, b, c, d, dt_d, cs, s.cstart, s.clen, states, y, s.heads, s.total, s.head_dim, s.dstate, s.per_group,
        *x.stride(), *b.stride(), *c.stride(),
        BLOCK_L=block_l, BLOCK_S=block_l, BLOCK_P=pow2(s.head_dim), BLOCK_N=pow2(s.dstate), L_BLOCKS=l_blocks,
        DOT_PREC=s.prec, num_warps=warps,
    )
    # fmt: on
    return y


def _gather_states(plan: ChunkPlan, states: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """States at the plan's requested positions: chunk start states, or the final state in the pool."""
    if not plan.state_req:
        return states.new_empty((0, *states.shape[1:]))
    out = []
    for r, chunk in zip(plan.state_req, plan.state_chunks, strict=True):
        out.append(pool[slots[r]] if chunk == FINAL else states[chunk])
    return torch.stack(out)
