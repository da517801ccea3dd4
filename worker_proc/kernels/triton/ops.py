"""`TritonOps`: the `KernelOps` interface (worker_proc.kernels.interface) implemented with Triton.

Every method has exactly the signature and semantics the interface states (pools are one layer's
view `[S, ...]`, updated in place; slot 0 is padding). The single-request prefill methods call the
varlen kernels of `triton_conv`, `triton_ssd` and `triton_attention` with a batch of one, and the
`*_prefill_many` methods with every segment of the step in one call.

No Mamba or attention case falls back to the reference; the gated delta rule (Gated DeltaNet
layers) runs flash-linear-attention's kernels when `fla` imports, else the pure-torch ones
(worker_proc.kernels.gdn_ops); their conv is `conv_prefill` / `conv_decode` here. Requirements
beyond the reference's (checked, ValueError): the SSM pool keeps each head's [P, N] state
contiguous (true of `StatePools`). Kernels launch on
the current CUDA device: a worker on `cuda:N` must `torch.cuda.set_device(N)` first. Every op is
batch invariant (a request's result is bitwise the same alone or batched), and decode rows whose
slot is 0 (padding) are computed from the zero padding state but never written back. The Mamba
kernels read and write a float32 SSM pool; a bfloat16 or int8 pool (`--mamba-ssm-dtype`) is decoded
into a float32 scratch pool of the call's slots before the kernel and encoded back after it
(`state_codec.run_on_float32`), so the kernels themselves only ever see float32 states. Mamba1's
selective scan (prefill segments and decode rows) is `triton/selective_scan.py`'s one kernel.
Importing this module imports triton: on a CPU-only machine set TRITON_INTERPRET=1 first.
"""

from __future__ import annotations

from functools import partial
from itertools import accumulate

import torch
from torch import Tensor

from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.composed import ComposedSteps
from worker_proc.kernels.gdn_ops import GdnMethods, ReferenceGdn
from worker_proc.kernels.interface import AttnSpans, SelectiveScanParams, Spans, SsdParams
from worker_proc.kernels.kda_ops import KdaMethods
from worker_proc.kernels.segments import PerSegment
from worker_proc.kernels.state_codec import StatePool
from worker_proc.kernels.triton import attention as triton_attention
from worker_proc.kernels.triton import conv as triton_conv
from worker_proc.kernels.triton import selective_scan as triton_selective_scan
from worker_proc.kernels.triton import ssd as triton_ssd
from worker_proc.kernels.triton import ssd_step as triton_ssd_step
from worker_proc.kernels.triton.chunk_plan import plan_chunks

__all__ = ["TritonOps"]


def _index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Small int32 metadata tensor on `device` (one host-to-device copy, no sync)."""
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


class TritonOps(PerSegment, ComposedSteps, GdnMethods, KdaMethods):
    """Fused Triton kernels over pool slots (CUDA; CPU only under TRITON_INTERPRET=1). Stateless but
    for `gdn`, the gated-delta backend (flash-linear-attention when installed, see gdn_ops)."""

    name = "triton"
    batch_invariant = True

    def __init__(self, gdn: object | None = None) -> None:
        self.gdn = gdn or ReferenceGdn()  # type: ignore[assignment]

    def conv_prefill(self, x: Tensor, conv_pool: Tensor, slot: int, weight: Tensor, bias: Tensor | None,
                     silu: bool = True) -> Tensor:  # fmt: skip
        length = x.shape[0]
        meta = _index_tensor([0, length, slot], x.device)
        return triton_conv.conv_prefill_varlen(x, meta[:2], length, conv_pool, meta[2:], weight, bias, silu)

    def conv_decode(self, x: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor, bias: Tensor | None,
                    silu: bool = True) -> Tensor:  # fmt: skip
        return triton_conv.conv_decode(x, conv_pool, slots, weight, bias, silu)

    def ssd_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                    slot: int) -> Tensor:  # fmt: skip
        if not codec.is_float32(ssm_pool):
            return codec.run_on_float32(ssm_pool, codec.slot_tensor(slot, x.device),
                                        lambda rows, _local: self.ssd_prefill(x, dt, b, c, p, rows, 1))  # fmt: skip
        plan = plan_chunks([x.shape[0]], p.chunk_size)
        slots = _index_tensor([slot], x.device)
        y, _ = triton_ssd.ssd_scan_varlen(x, dt, p.a, b, c, p.d, p.dt_bias, p.dt_limit, plan, ssm_pool, slots)
        return y

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None, silu: bool = True) -> Tensor:  # fmt: skip
        """Every segment in one varlen call."""
        lengths = [length for length, _ in spans]
        meta = _index_tensor([0, *accumulate(lengths), *(slot for _, slot in spans)], x.device)
        cu, slots = meta[: len(spans) + 1], meta[len(spans) + 1 :]
        return triton_conv.conv_prefill_varlen(x, cu, max(lengths), conv_pool, slots, weight, bias, silu)

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        """Every segment in one varlen scan."""
        slots = [slot for _, slot in spans]
        if not codec.is_float32(ssm_pool):
            local = tuple((length, i + 1) for i, (length, _) in enumerate(spans))
            return codec.run_on_float32(ssm_pool, torch.tensor(slots, dtype=torch.int64, device=x.device),
                                        lambda rows, _local: self.ssd_prefill_many(x, dt, b, c, p, rows, local))
        plan = plan_chunks([length for length, _ in spans], p.chunk_size)
        y, _ = triton_ssd.ssd_scan_varlen(x, dt, p.a, b, c, p.d, p.dt_bias, p.dt_limit, plan, ssm_pool,
                                          _index_tensor(slots, x.device))  # fmt: skip
        return y

    def ssd_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                   slots: Tensor) -> Tensor:  # fmt: skip
        if not codec.is_float32(ssm_pool):
            return codec.run_on_float32(ssm_pool, slots, partial(self.ssd_decode, x, dt, b, c, p))
        return triton_ssd_step.ssd_step(x, dt, p.a, b, c, p.d, p.dt_bias, p.dt_limit, ssm_pool, slots)

    def selective_scan_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                               state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        return self.selective_scan_prefill_many(x, dt, b, c, p, state_pool, ((x.shape[0], slot),))

    def selective_scan_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                                    state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        lengths = [length for length, _ in spans]
        starts = _index_tensor(list(accumulate([0, *lengths[:-1]])), x.device)
        slots = torch.tensor([slot for _, slot in spans], dtype=torch.int64).to(x.device, non_blocking=True)
        return self._selective_scan(x, dt, b, c, p, state_pool, starts, _index_tensor(lengths, x.device), slots)

    def selective_scan_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                              state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
        return self._selective_scan(x, dt, b, c, p, state_pool, rows, torch.ones_like(rows), slots)

    @staticmethod
    def _selective_scan(x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams, state_pool: StatePool,
                        starts: Tensor, lengths: Tensor, slots: Tensor) -> Tensor:  # fmt: skip
        """The kernel over segments (starts, lengths, slots); a bfloat16 or int8 pool through a float32 copy."""

        def scan(pool: Tensor, rows: Tensor) -> Tensor:
            return triton_selective_scan.selective_scan(x, dt, p.a, b, c, p.d, p.dt_bias, pool, starts, lengths, rows)

        if codec.is_float32(state_pool):
            return scan(state_pool, slots)
        return codec.run_on_float32(state_pool, slots, scan)

    def attn_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, start_pos: int,
                     scale: float) -> Tensor:  # fmt: skip
        length = q.shape[0]
        if kv_idx.shape[0] != start_pos + length:
            raise ValueError(f"kv_idx has {kv_idx.shape[0]} slots for start_pos {start_pos} + {length} tokens")
        cu = _index_tensor([0, length, 0, start_pos + length], q.device)
        return triton_attention.attn_prefill_varlen(q, k_pool, v_pool, kv_idx, cu[:2], cu[2:], length, scale)

    def attn_prefill_many(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, spans: AttnSpans,
                          scale: float) -> Tensor:  # fmt: skip
        """Every segment in one varlen call."""
        for length, start, kv_idx in spans:
            if kv_idx.shape[0] != start + length:
                raise ValueError(f"kv_idx has {kv_idx.shape[0]} slots for start_pos {start} + {length} tokens")
        lengths = [length for length, _, _ in spans]
        cu = _index_tensor([0, *accumulate(lengths), 0, *accumulate(s + n for n, s, _ in spans)], q.device)
        kv_idx = torch.cat([kv_idx for _, _, kv_idx in spans])
        return triton_attention.attn_prefill_varlen(q, k_pool, v_pool, kv_idx, cu[: len(spans) + 1],
                                                    cu[len(spans) + 1 :], max(lengths), scale)  # fmt: skip

    def attn_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, lengths: Tensor,
                    scale: float) -> Tensor:  # fmt: skip
        return triton_attention.attn_decode(q, k_pool, v_pool, kv_idx, lengths, scale)
