"""`FastOps`: the default CPU kernels, pure torch, written for throughput instead of batch invariance.

Same interface and the same mathematics as `ReferenceOps` (which stays the ground truth and the
deterministic mode's kernels); results agree with it to float32 rounding (tests: <= 1e-5 relative on
the kernel level, <= 1e-4 on logits against transformers). What differs, and why it is faster:
- The SSD chunk scan computes C·Bᵀ once per group, not per head (Granite: 48 heads share 1 group),
  uses a chunk no longer than the segment (a 32-token resume does not pay for a 256-token chunk) and
  at most `SCAN_CHUNK` (the quadratic intra-chunk part stays small on a CPU), and takes the decay
  between positions as a difference of cumulative sums instead of a masked [Q, Q] cumsum.
- The decode state update reads and writes each request's pool row in place (`mul_`, `addcmul_`,
  one matvec) instead of gathering every state, building temporaries and scattering them back: a
  Granite-350M state is 786 KB per layer and request, so at 32 decoding requests the state traffic
  rivals the weights.
- Decode attention is one padded batched computation over the decode group; prefill attention (and
  one request's decode) needs no mask and reads runs of KV slots in place, merging parts of the
  context by their log-sum-exps (`context_parts`).
Rules that must hold: every op reads and writes the pools only at the slots it is given; slots of
one decode call are distinct; recurrent math is float32 whatever the model dtype and whatever the
SSM pool stores (`state_codec`: decoded to float32 before the update, encoded after).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from worker_proc.kernels import reference as ref
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.reference_ops import ReferenceOps
from worker_proc.kernels.segments import Spans, batchable, pack, unpack
from worker_proc.kernels.state_codec import StatePool

SCAN_CHUNK = 64
"""Longest chunk of the CPU scan: intra-chunk work grows with the chunk, state passing shrinks."""
EXP_FLOOR = -87.0
"""Arguments of the scan's exponentials are clamped to at least this: below it exp underflows (to a
denormal or 0) and torch's CPU exp takes a slow path, 10x slower over a scan's decay matrix; the clamp
changes a result by at most exp(-87) ~ 1.6e-38, masked (acausal) entries included."""
CONTEXT_RUN = 256
"""Shortest run of consecutive KV slots that CPU attention reads in place (`context_parts`); each run
read so costs one more attention call, the slots of shorter runs are copied."""


def _grouped(t: torch.Tensor, groups: int, dim: int = 1) -> torch.Tensor:
    """Split the head dimension `dim` (H) into (G, H/G): heads of one group are contiguous, as
    `repeat_interleave` of the groups lays them out."""
    return t.unflatten(dim, (groups, t.shape[dim] // groups))


def ssd_scan_fast(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, chunk_size: int,
                  initial_state: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`reference.ssd_chunk_scan` (same arguments and results, float32 rounding aside)."""
    y, final = ssd_scan_batched(x[None], dt[None], a, b[None], c[None], d, chunk_size, initial_state[None])
    return y[0], final[0]


def ssd_scan_batched(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, chunk_size: int,
                     initial_state: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`ssd_scan_fast` over S sequences at once: x [S, L, H, P], dt [S, L, H] (discretized), b, c [S, L, G, N],
    initial_state [S, H, P, N] -> (y [S, L, H, P], final [S, H, P, N]). A shorter sequence is padded at its
    end with dt = 0 (and anything else): a zero step neither decays nor feeds the state, so its final state
    and its real rows are those of the unpadded scan."""
    seqs, length, heads, p = x.shape
    groups, n = b.shape[2], b.shape[3]
    q = max(1, min(chunk_size, SCAN_CHUNK, length))
    pad = (-length) % q
    nc = (length + pad) // q
    x = x.float()
    dt = dt.float()
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(seqs, nc, q, heads, p)
    da = F.pad(dt * a.float(), (0, 0, 0, pad)).view(seqs, nc, q, heads).transpose(2, 3)  # [S, nc, H, Q]
    bf = F.pad(b.float(), (0, 0, 0, 0, 0, pad)).view(seqs, nc, q, groups, n).transpose(2, 3)  # [S, nc, G, Q, N]
    cf = F.pad(c.float(), (0, 0, 0, 0, 0, pad)).view(seqs, nc, q, groups, n).transpose(2, 3)
    cum = da.cumsum(dim=-1)  # [S, nc, H, Q]
    # intra-chunk: y[l] = sum_{s<=l} (C_l·B_s) exp(cum_l - cum_s) xdt_s
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = _exp((cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, EXP_FLOOR))  # [S, nc, H, Q, Q]
    cb = cf @ bf.transpose(-1, -2)  # [S, nc, G, Q, Q]
    scores = _grouped(decay, groups, 2) * cb[:, :, :, None]  # [S, nc, G, H/G, Q, Q]
    xh = _grouped(xdt.transpose(2, 3), groups, 2)  # [S, nc, G, H/G, Q, P]
    y = scores @ xh  # [S, nc, G, H/G, Q, P]
    # each chunk's own contribution to the state at its end: sum_s exp(cum_end - cum_s) xdt_s ⊗ B_s
    to_end = _exp(cum[..., -1:] - cum)  # [S, nc, H, Q]
    weighted = xh * _grouped(to_end[..., None], groups, 2)  # [S, nc, G, H/G, Q, P]
    chunk_states = weighted.transpose(-1, -2) @ bf[:, :, :, None]  # [S, nc, G, H/G, P, N]
    chunk_decay = _exp(cum[..., -1].clone())  # [S, nc, H]
    state = _grouped(initial_state.float(), groups, 1)  # [S, G, H/G, P, N]
    starts = []
    for i in range(nc):
        starts.append(state)
        state = state * _grouped(chunk_decay[:, i, :, None, None], groups, 1) + chunk_states[:, i]
    start_states = torch.stack(starts, dim=1)  # [S, nc, G, H/G, P, N]
    # contribution of the state entering each chunk: exp(cum_l) C_l · state
    y_in = (cf[:, :, :, None] @ start_states.transpose(-1, -2)) * _grouped(_exp(cum.clone())[..., None], groups, 2)
    y = (y + y_in).reshape(seqs, nc, heads, q, p).transpose(2, 3).reshape(seqs, nc * q, heads, p)[:, :length]
    return y + x * d.float()[:, None], state.reshape(seqs, heads, p, n)


def pool_rows(pool: Tensor, idx: Tensor) -> Tensor:
    """Rows `idx` of a KV pool: a view when they are one ascending run of slots, else a copy."""
    n = idx.numel()
    if n > 1 and int(idx[-1]) - int(idx[0]) == n - 1 and bool((idx.diff() == 1).all()):
        return pool.narrow(0, int(idx[0]), n)
    return pool.index_select(0, idx)


def context_parts(k_pool: Tensor, v_pool: Tensor, idx: Tensor) -> list[tuple[Tensor, Tensor]]:
    """A context's keys and values (slots `idx`) in parts whose attention results merge by log-sum-exp:
    each ascending run of at least CONTEXT_RUN slots (or the whole context, when it is one run) is a view
    of the pools, the slots of all shorter runs are gathered into one part. A long context is rarely one
    run (decode slots of other requests and cached prefixes interleave), and gathering it whole would
    copy it per layer and step."""
    n = idx.numel()
    starts = torch.cat([idx.new_zeros(1), (idx.diff() != 1).nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], idx.new_full((1,), n)])
    long = ((ends - starts) >= min(CONTEXT_RUN, n)).nonzero().flatten().tolist()
    parts = []
    rest = torch.ones(n, dtype=torch.bool) if long else None
    for run in long:
        lo, hi = int(starts[run]), int(ends[run])
        parts.append((k_pool.narrow(0, int(idx[lo]), hi - lo), v_pool.narrow(0, int(idx[lo]), hi - lo)))
        rest[lo:hi] = False
    scattered = idx if rest is None else idx[rest]
    if scattered.numel():
        parts.append((k_pool.index_select(0, scattered), v_pool.index_select(0, scattered)))
    return parts


def _merged(results: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Attention over a context from its parts' (output [1, H, L, d], log-sum-exp [1, H, L]); float32
    when there is more than one part."""
    if len(results) == 1:
        return results[0][0]
    lse = torch.stack([r[1] for r in results])
    weights = (lse - lse.amax(0)).exp_()[..., None]  # [P, 1, H, L, 1]
    out = results[0][0].float() * weights[0]
    for i in range(1, len(results)):
        out.addcmul_(results[i][0].float(), weights[i])
    return out.div_(weights.sum(0))


def _flash_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """CPU flash attention ([1, H, L, d] queries, grouped keys) and each query's log-sum-exp of its
    scores, [1, H, L] float32; `causal` aligns query i with key i."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _exp(t: Tensor) -> Tensor:
    """exp of a temporary, in place, its argument clamped to EXP_FLOOR."""
    return t.clamp_(min=EXP_FLOOR).exp_()


class FastOps(ReferenceOps):
    """Throughput kernels for CPU (see module doc); `batch_invariant` is always False."""

    name = "fast"

    def __init__(self, gdn: object | None = None) -> None:
        super().__init__(batch_invariant=False, gdn=gdn)

    def conv_decode(self, x: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor, bias: Tensor | None,
                    silu: bool = True) -> Tensor:  # fmt: skip
        """The reference's step with the float32 SiLU (its float64 one is for batch invariance) and no casts."""
        if not x.dtype == conv_pool.dtype == weight.dtype == torch.float32:
            return super().conv_decode(x, conv_pool, slots, weight, bias, silu)
        window = torch.cat([conv_pool.index_select(0, slots), x[:, :, None]], dim=-1)  # [Bt, Cd, K]
        conv_pool.index_copy_(0, slots, window[:, :, 1:])
        out = (window * weight).sum(-1)
        out = out if bias is None else out.add_(bias)
        return F.silu(out) if silu else out

    def ssd_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                    slot: int) -> Tensor:  # fmt: skip
        dt = ref.discretize_dt(dt, p.dt_bias, p.dt_limit)
        y, final = ssd_scan_fast(x, dt, p.a, b, c, p.d, p.chunk_size, codec.load(ssm_pool, slot))
        codec.store(final, ssm_pool, slot)
        return y

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None, silu: bool = True) -> Tensor:  # fmt: skip
        """One depthwise conv over the segments padded to the longest (`batchable`), else one call each."""
        lengths = [length for length, _ in spans]
        if not batchable(lengths) or not x.dtype == conv_pool.dtype == weight.dtype:
            return super().conv_prefill_many(x, conv_pool, spans, weight, bias, silu)
        slots = torch.tensor([slot for _, slot in spans], dtype=torch.int64, device=x.device)
        k = weight.shape[-1]
        window = torch.cat([conv_pool.index_select(0, slots), pack(x, lengths).transpose(1, 2)], dim=-1)
        out = F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0])  # [S, Cd, longest]
        out = F.silu(out) if silu else out
        # each segment's new state: its last K-1 inputs, window positions [length, length + K - 1)
        last = torch.tensor(lengths, device=x.device)[:, None] + torch.arange(k - 1, device=x.device)
        conv_pool.index_copy_(0, slots, window.gather(2, last[:, None, :].expand(-1, window.shape[1], -1)))
        return unpack(out.transpose(1, 2), lengths)

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        """One batched scan over the segments padded to the longest (`batchable`), else one call each."""
        lengths = [length for length, _ in spans]
        if not batchable(lengths):
            return super().ssd_prefill_many(x, dt, b, c, p, ssm_pool, spans)
        slots = torch.tensor([slot for _, slot in spans], dtype=torch.int64, device=x.device)
        dt = ref.discretize_dt(dt, p.dt_bias, p.dt_limit)  # before padding: padded steps must be dt = 0
        y, final = ssd_scan_batched(pack(x, lengths), pack(dt, lengths), p.a, pack(b, lengths), pack(c, lengths),
                                    p.d, p.chunk_size, codec.load(ssm_pool, slots))  # fmt: skip
        codec.store(final, ssm_pool, slots)
        return unpack(y, lengths)

    def ssd_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                   slots: Tensor) -> Tensor:  # fmt: skip
        """Each request's pool row is advanced in place: state = state * exp(dt A) + (dt x) ⊗ B, so the
        state's traffic is one read and one write (gathering the group's states into a batch and scattering
        them back was no faster even for a 32 KB state, and copies a large one twice). A bfloat16 or int8
        pool is advanced the same way on a float32 copy of the group's rows (`state_codec.run_on_float32`)."""
        if not codec.is_float32(ssm_pool):
            return codec.run_on_float32(ssm_pool, slots, partial(self.ssd_decode, x, dt, b, c, p))
        heads, groups = x.shape[1], b.shape[1]
        bt, n = x.shape[0], b.shape[2]
        xf = x.float()
        dt = ref.discretize_dt(dt, p.dt_bias, p.dt_limit)  # [Bt, H]
        decay = torch.exp(dt * p.a)[..., None, None]  # [Bt, H, 1, 1]
        dtx = _grouped((dt[..., None] * xf)[..., None], groups)  # [Bt, G, H/G, P, 1]
        bf = b.float()[:, :, None, None, :]  # [Bt, G, 1, 1, N]
        cf = c.float()[..., None]  # [Bt, G, N, 1]
        y = torch.empty(bt, groups, heads // groups * x.shape[2], 1, dtype=torch.float32, device=x.device)
        for i, slot in enumerate(slots.tolist()):
            row = ssm_pool[slot]  # [H, P, N] view of the pool row
            row.mul_(decay[i])
            _grouped(row, groups, 0).addcmul_(dtx[i], bf[i])
            # one matrix-vector product per group: [(H/G) * P, N] @ [N, 1]
            torch.matmul(row.view(groups, -1, n), cf[i], out=y[i])
        return torch.addcmul(y.view(bt, heads, x.shape[2]), xf, p.d.float()[None, :, None])

    def attn_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, start_pos: int,
                     scale: float) -> Tensor:  # fmt: skip
        """Causal attention of `q` (positions start_pos..) over its context, without a mask: the queries
        attend to the cached part of the context in full, a view of the pool where it is a run of slots
        (`context_parts`), and to their own keys causally; the parts merge by their log-sum-exps. A
        [queries, context] mask would be built and converted per layer and chunk, its cost and size
        growing with the context (16 MiB at 16k positions)."""
        qt = q.transpose(0, 1)[None].to(k_pool.dtype)  # [1, H, L, d]
        own = [pool_rows(pool, kv_idx[start_pos:]).transpose(0, 1)[None] for pool in (k_pool, v_pool)]
        results = [_flash_with_lse(qt, own[0], own[1], causal=True, scale=scale)]
        if start_pos > 0:
            results += [_flash_with_lse(qt, k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=False,
                                        scale=scale)  # fmt: skip
                        for k, v in context_parts(k_pool, v_pool, kv_idx[:start_pos])]
        return _merged(results)[0].transpose(0, 1).to(q.dtype)

    def attn_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, lengths: Tensor,
                    scale: float) -> Tensor:  # fmt: skip
        """One request: attention over its context's parts (`context_parts`, no copy of its runs of
        slots); several: one padded SDPA over the group, positions past lengths[b] masked out."""
        if kv_idx.shape[0] == 1:
            qt = q[:, :, None].to(k_pool.dtype)  # [1, H, 1, d]
            parts = context_parts(k_pool, v_pool, kv_idx[0, : int(lengths[0])])
            results = [_flash_with_lse(qt, k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=False,
                                       scale=scale)  # fmt: skip
                       for k, v in parts]
            return _merged(results)[0, :, 0][None].to(q.dtype)
        k = k_pool[kv_idx].transpose(1, 2)  # [Bt, kvh, T, d]
        v = v_pool[kv_idx].transpose(1, 2)
        valid = torch.arange(kv_idx.shape[1], device=q.device)[None, :] < lengths[:, None]  # [Bt, T]
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(k.dtype), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out[:, :, 0].to(q.dtype)
