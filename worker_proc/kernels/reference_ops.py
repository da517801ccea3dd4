"""`ReferenceOps`: the `KernelOps` interface composed from the pure-torch reference functions.

Correct on every device and the ground truth the other implementations are checked against; the
deterministic mode's kernels on CPU. Method contracts: `worker_proc.kernels.interface`. The SSM pool
is read and written through `state_codec` (float32, bfloat16 or int8 storage).
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker_proc.kernels import reference as ref
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.composed import ComposedSteps
from worker_proc.kernels.gdn_ops import GdnMethods, ReferenceGdn
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.kda_ops import KdaMethods
from worker_proc.kernels.segments import PerSegment
from worker_proc.kernels.selective_scan import SelectiveScanMethods
from worker_proc.kernels.state_codec import StatePool


class ReferenceOps(PerSegment, ComposedSteps, GdnMethods, KdaMethods, SelectiveScanMethods):
    """Pure-torch ops over pool slots; correct on every device, fast on none.

    `batch_invariant`: decode attention runs request by request with exactly the computation a
    request gets alone, so a request's logits do not depend on what it is batched with (the
    deterministic mode). Otherwise decode attention is one padded batched computation.
    `gdn`: the gated-delta backend (worker_proc.kernels.gdn_ops; the pure-torch one by default).
    """

    name = "reference"

    def __init__(self, batch_invariant: bool = True, gdn: object | None = None) -> None:
        self.batch_invariant = batch_invariant
        self.gdn = gdn or ReferenceGdn()  # type: ignore[assignment]

    def conv_prefill(self, x: Tensor, conv_pool: Tensor, slot: int, weight: Tensor, bias: Tensor | None,
                     silu: bool = True) -> Tensor:  # fmt: skip
        out, new_state = ref.causal_conv1d(x, conv_pool[slot], weight, bias, silu)
        conv_pool[slot].copy_(new_state)
        return out

    def conv_decode(self, x: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor, bias: Tensor | None,
                    silu: bool = True) -> Tensor:  # fmt: skip
        out, new_state = ref.causal_conv1d_step(x, conv_pool.index_select(0, slots), weight, bias, silu)
        conv_pool.index_copy_(0, slots, new_state.to(conv_pool.dtype))
        return out

    def ssd_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                    slot: int) -> Tensor:  # fmt: skip
        dt = ref.discretize_dt(dt, p.dt_bias, p.dt_limit)
        y, final = ref.ssd_chunk_scan(x, dt, p.a, b, c, p.d, p.chunk_size, codec.load(ssm_pool, slot))
        codec.store(final, ssm_pool, slot)
        return y

    def ssd_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                   slots: Tensor) -> Tensor:  # fmt: skip
        dt = ref.discretize_dt(dt, p.dt_bias, p.dt_limit)
        y, new_state = ref.ssd_state_step(codec.load(ssm_pool, slots), x, dt, p.a, b, c, p.d)
        codec.store(new_state, ssm_pool, slots)
        return y

    def attn_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, start_pos: int,
                     scale: float) -> Tensor:  # fmt: skip
        k = k_pool.index_select(0, kv_idx)
        v = v_pool.index_select(0, kv_idx)
        return ref.attention_prefill(q, k, v, start_pos, scale)

    def attn_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, lengths: Tensor,
                    scale: float) -> Tensor:  # fmt: skip
        if self.batch_invariant:
            out = torch.empty_like(q)
            for b, n in enumerate(lengths.tolist()):
                idx = kv_idx[b, :n]
                out[b : b + 1] = ref.attention_prefill(q[b : b + 1], k_pool[idx], v_pool[idx], n - 1, scale)
            return out
        k = k_pool[kv_idx]
        v = v_pool[kv_idx]
        return ref.attention_decode(q, k, v, lengths, scale)
