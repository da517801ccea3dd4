"""Pure-torch reference kernels (CPU tests, and the fallback on any device).

These are the ground truth that faster kernels (Triton on CUDA)
are checked against; the model never calls this module directly, only `worker_proc.kernels`.

Shape letters: L = tokens of one request in this step, Bt = requests in a decode batch,
H = Mamba heads, P = Mamba head dim, G = Mamba groups, N = state size, Cd = conv channels,
K = conv kernel width, S = pool slots (slot 0 = padding), h = query heads, kvh = KV heads,
d = attention head dim. All recurrent math runs in float32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + dt_bias) clamped to `dt_limit`, in float32. dt: [..., H], dt_bias: [H]."""
    out = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        out = out.clamp(min=lo, max=hi)
    return out


# ------------------------------------------------------------------------------ conv1d
def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU (the conv alone when not `silu`) over one request's tokens,
    continuing from `conv_state`.

    x: [L, Cd]; conv_state: [Cd, K-1] (the K-1 inputs before x, oldest first; zeros for a fresh
    request); weight: [Cd, K]; bias: [Cd] or None.
    Returns (out [L, Cd] in x's dtype, new_state [Cd, K-1] = the last K-1 inputs).
    """
    length = x.shape[0]
    k = weight.shape[-1]
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [Cd, K-1+L]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0]
    out = out[:, -length:].t()
    out = F.silu(out) if silu else out
    return out.to(x.dtype), window[:, window.shape[-1] - (k - 1) :]


def causal_conv1d_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, batched. x: [Bt, Cd]; conv_state: [Bt, Cd, K-1]; `silu` as in `causal_conv1d`.
    Returns (out [Bt, Cd], new_state [Bt, Cd, K-1])."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [Bt, Cd, K]
    out = (window.to(weight.dtype) * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    if not silu:
        return out.to(x.dtype), window[:, :, 1:]
    # SiLU in float64, rounded: float32 SIMD and scalar tails differ in the last bit, and where a
    # request's channels fall relative to the tail depends on Bt unless Cd is a multiple of the vector
    return F.silu(out.double()).to(x.dtype), window[:, :, 1:]


# ------------------------------------------------------------------------------ SSD
def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a: [..., Q] -> [..., Q, Q] with out[i, j] = sum(a[j+1..i]) for j <= i, -inf above."""
    q = a.shape[-1]
    x = a[..., None].expand(*a.shape, q)
    strict = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0).cumsum(dim=-2)
    keep = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=0)
    return x.masked_fill(~keep, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD (Mamba2) scan over one request's tokens.

    x: [L, H, P]; dt: [L, H] already discretized (see `discretize_dt`); a: [H] (negative, = -exp(A_log));
    b, c: [L, G, N]; d: [H]; initial_state: [H, P, N] (state after the previous token).
    Returns (y [L, H, P] float32 including the D skip term, final_state [H, P, N] float32).
    Chunks start at the first token of `x`; the result does not depend on `chunk_size`
    beyond rounding, so resuming a prompt mid-chunk is exact.
    """
    length, heads, _ = x.shape
    groups = b.shape[1]
    x = x.float()
    dt = dt.float()
    b = b.float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
    c = c.float().repeat_interleave(heads // groups, dim=1)
    skip = x * d.float()[None, :, None]
    pad = (-length) % chunk_size
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))
    da = F.pad(dt * a.float()[None], (0, 0, 0, pad))  # padded steps: decay 1, input 0
    b = F.pad(b, (0, 0, 0, 0, 0, pad))
    c = F.pad(c, (0, 0, 0, 0, 0, pad))
    n_chunks = (length + pad) // chunk_size
    xdt, b, c = (t.reshape(n_chunks, chunk_size, *t.shape[1:]) for t in (xdt, b, c))
    da = da.reshape(n_chunks, chunk_size, heads).permute(0, 2, 1)  # [nc, H, Q]
    da_cum = da.cumsum(dim=-1)
    # intra-chunk ("diagonal") outputs
    decay = torch.exp(_segsum(da))  # [nc, H, Q(l), Q(s)]
    scores = torch.einsum("clhn,cshn->chls", c, b) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # per-chunk input contribution to the state at the chunk end
    to_end = torch.exp(da_cum[..., -1:] - da_cum)  # [nc, H, Q]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", b, to_end, xdt)
    # inter-chunk recurrence, sequential over chunks
    chunk_decay = torch.exp(da_cum[..., -1])  # [nc, H]
    state = initial_state.float()
    starts = []
    for i in range(n_chunks):
        starts.append(state)
        state = state * chunk_decay[i][:, None, None] + chunk_states[i]
    start_states = torch.stack(starts)  # [nc, H, P, N]
    y = y + torch.einsum("clhn,chpn->clhp", c, start_states) * torch.exp(da_cum).permute(0, 2, 1)[..., None]
    y = y.reshape(n_chunks * chunk_size, heads, -1)[:length] + skip
    return y, state


def ssd_chunk_scan_with_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor,
    state_positions: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`ssd_chunk_scan` that also returns the state after each of `state_positions` tokens
    (0 < pos <= L, increasing), by scanning segment by segment. Returns (y, final, states)."""
    ys, states = [], []
    state, prev = initial_state, 0
    for pos in [*state_positions, x.shape[0]]:
        if pos < prev or pos > x.shape[0]:
            raise ValueError(f"state position {pos} out of order or beyond {x.shape[0]} tokens")
        if pos > prev:
            seg = slice(prev, pos)
            y, state = ssd_chunk_scan(x[seg], dt[seg], a, b[seg], c[seg], d, chunk_size, state)
            ys.append(y)
        states.append(state.float())
        prev = pos
    return torch.cat(ys), state.float(), states[:-1]


def ssd_state_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, batched. state: [Bt, H, P, N] fp32; x: [Bt, H, P];
    dt: [Bt, H] discretized; a, d: [H]; b, c: [Bt, G, N].
    Returns (y [Bt, H, P] float32, new_state [Bt, H, P, N] float32)."""
    heads = x.shape[1]
    groups = b.shape[1]
    x = x.float()
    b = b.float().repeat_interleave(heads // groups, dim=1)  # [Bt, H, N]
    c = c.float().repeat_interleave(heads // groups, dim=1)
    decay = torch.exp(dt * a.float()[None])  # [Bt, H]
    new_state = state.float() * decay[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    # a plain row reduction (not a batched GEMM) keeps each request's result independent of Bt
    y = (new_state * c[:, :, None, :]).sum(-1) + x * d.float()[None, :, None]
    return y, new_state


# ------------------------------------------------------------------------------ attention
def attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float
) -> torch.Tensor:
    """Causal attention of one request's new tokens over its whole KV.

    q: [L, h, d] (queries at positions start_pos..start_pos+L-1); k, v: [start_pos+L, kvh, d]
    (gathered from the pool, positions 0..start_pos+L-1). h must be a multiple of kvh; query head
    i reads KV head i // (h // kvh). Returns [L, h, d] in q's dtype; softmax in float32.
    """
    length, heads, dim = q.shape
    total, kv_heads, _ = k.shape
    g = heads // kv_heads
    qf = q.float().view(length, kv_heads, g, dim).permute(1, 2, 0, 3)  # [kvh, g, L, d]
    kf = k.float().permute(1, 0, 2)  # [kvh, T, d]
    vf = v.float().permute(1, 0, 2)
    scores = torch.einsum("kgld,ktd->kglt", qf, kf) * scale
    if length > 1:  # a single query (decode) sees every key: no mask needed
        qpos = torch.arange(length, device=q.device)[:, None] + start_pos
        kpos = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.einsum("kglt,ktd->kgld", scores.softmax(dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(length, heads, dim).to(q.dtype)


def attention_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per request over padded KV, batched.

    q: [Bt, h, d]; k, v: [Bt, T, kvh, d] (row b valid for the first lengths[b] entries; the query
    sits at position lengths[b]-1); lengths: [Bt] int64. Returns [Bt, h, d] in q's dtype.
    """
    batch, heads, dim = q.shape
    total, kv_heads = k.shape[1], k.shape[2]
    g = heads // kv_heads
    qf = q.float().view(batch, kv_heads, g, dim)
    scores = torch.einsum("bkgd,btkd->bkgt", qf, k.float()) * scale
    valid = torch.arange(total, device=q.device)[None, :] < lengths[:, None]  # [Bt, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    vf = v.float().masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bkgt,btkd->bkgd", scores.softmax(dim=-1), vf)
    return out.reshape(batch, heads, dim).to(q.dtype)
