"""`KernelOps`: the one interface between the model and its kernels; the shape contracts live here.

Every implementation (`ReferenceOps`, `FastOps`, `TritonOps`) provides these methods with exactly
these semantics; the model calls nothing else. Rules that hold for every method:
- Pools are one layer's view `[S, ...]` (S = slots + 1; slot 0 is padding) and are read and
  written *by slot*, in place; an op touches no slot it was not given.
- Slots of one decode call are distinct. Recurrent math (conv state aside) runs in float32
  whatever the model dtype. The recurrent-state pools (`ssm_pool`, `state_pool`) are a
  `state_codec.StatePool`: float32 (the default), bfloat16 or int8 with per-row scales
  (`--mamba-ssm-dtype`); an op reads them with `state_codec.load`, updates in float32 and writes
  with `state_codec.store`, once per call and slot, never accumulating in the storage type.
Shape letters are those of `worker_proc.kernels.reference`: L tokens of one request, Bt requests of
a decode group, H Mamba heads, P head dim, G groups, N state size, Cd conv channels, K conv width,
h query heads, kvh KV heads, d attention head dim; for the gated delta rule (Gated DeltaNet layers)
Hv value heads, Dk key dim, Dv value dim; for its per-channel form (Kimi Delta Attention) H heads; for Mamba1's
selective scan D channels (d_inner) and N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from worker_proc.kernels.state_codec import StatePool

Spans = tuple[tuple[int, int], ...]
"""(length, state slot) of each prefill segment of a step, in row order; lengths >= 1, slots distinct."""
AttnSpans = tuple[tuple[int, int, Tensor], ...]
"""(length, start_pos, kv_idx [start_pos + length] int64) of each prefill segment, in row order."""


@dataclass(frozen=True)
class SsdParams:
    """One Mamba layer's scan constants: a = -exp(A_log) [H] float32 (negative), the D skip [H],
    dt_bias [H], the (min, max) clamp of the discretized dt, the checkpoint's `mamba_chunk_size`."""

    a: torch.Tensor
    d: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float]
    chunk_size: int


@dataclass(frozen=True)
class SelectiveScanParams:
    """One Mamba1 layer's scan constants (this rank's channels): a = -exp(A_log) [D, N] float32 (negative),
    the D skip [D], dt_proj's bias [D] (added to dt before the softplus)."""

    a: torch.Tensor
    d: torch.Tensor
    dt_bias: torch.Tensor


class GateNorm(Protocol):
    """A Mamba2 gated RMSNorm over whole groups of a rank's channels (worker_proc.model.layers.GatedRMSNorm):
    `groups` groups of `weight`'s channels, each normalised on its own."""

    weight: torch.Tensor
    groups: int
    eps: float
    before_gate: bool

    def __call__(self, y: Tensor, z: Tensor) -> Tensor: ...


RMS_WEIGHTINGS = ("model_dtype", "float32", "unit_offset")
"""How a residual-stream RMSNorm applies its weight to n = x / rms(x) (float32 statistics), in transformers'
rounding: `model_dtype`: weight * n rounded to the dtype first (RMSNorm); `float32`: weight * n in float32,
rounded once (Nemotron-H); `unit_offset`: (1 + weight) * n in float32, rounded once (Qwen3-Next / Qwen3.5)."""


class ResidualNorm(Protocol):
    """A residual-stream (or q/k) RMSNorm module (worker_proc.model.layers.make_norm): `weighting` is one
    of RMS_WEIGHTINGS."""

    weight: torch.Tensor
    eps: float
    weighting: str

    def __call__(self, x: Tensor) -> Tensor: ...


class KernelOps(Protocol):
    name: str
    batch_invariant: bool
    """True when a request's results are bitwise the same alone or batched with any others."""

    def conv_prefill(self, x: Tensor, conv_pool: Tensor, slot: int, weight: Tensor, bias: Tensor | None,
                     silu: bool = True) -> Tensor:  # fmt: skip
        """x: [L, Cd] -> SiLU(causal conv) [L, Cd] (the conv alone when not `silu`: a short convolution's);
        conv_pool: [S, Cd, K-1], row `slot` advanced."""
        ...

    def conv_decode(self, x: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor, bias: Tensor | None,
                    silu: bool = True) -> Tensor:  # fmt: skip
        """x: [Bt, Cd], slots: [Bt] int64 (distinct) -> [Bt, Cd] (`silu` as in `conv_prefill`); rows
        `slots` advanced by one."""
        ...

    def short_conv_decode(self, bcx: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                          bias: Tensor | None) -> Tensor:  # fmt: skip
        """LFM2's gated short convolution for one token per slot: bcx [Bt, 3 * Cd] = [B | C | x] (in_proj's
        output) -> C * conv(B * x) [Bt, Cd], `conv_decode` without SiLU on B * x; rows `slots` advanced by one."""
        ...

    def ssd_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                    slot: int) -> Tensor:  # fmt: skip
        """x: [L, H, P]; dt: [L, H] raw (p.dt_bias, softplus and p.dt_limit applied here); b, c: [L, G, N];
        ssm_pool: [S, H, P, N], row `slot` advanced. Returns y [L, H, P] fp32. The result does not
        depend on p.chunk_size beyond rounding."""
        ...

    def ssd_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                   slots: Tensor) -> Tensor:  # fmt: skip
        """x: [Bt, H, P]; dt: [Bt, H] raw; b, c: [Bt, G, N]; slots: [Bt] int64 (distinct).
        Returns y [Bt, H, P] fp32; rows `slots` of ssm_pool advanced by one token."""
        ...

    def mamba_decode(self, xbc: Tensor, dt: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                     bias: Tensor | None, p: SsdParams, ssm_pool: StatePool, groups: int,
                     head_group: Tensor | None) -> Tensor:  # fmt: skip
        """`conv_decode` then `ssd_decode` of one Mamba layer: xbc [Bt, Cd] = x [H * P] | B | C [groups * N
        each] (H, P, N: ssm_pool's), dt [Bt, H] raw. `head_group` [H] int64: the B/C group each head reads
        (None: heads spread evenly, H / groups to a group). Returns y [Bt, H, P] fp32; rows `slots` of both
        pools advanced by one token."""
        ...

    def rms_norm(self, norm: ResidualNorm, x: Tensor) -> Tensor:
        """`norm(x)`: x [T, width] in the model dtype -> [T, width] in it."""
        ...

    def add_rms_norm(self, norm: ResidualNorm, h: Tensor, y: Tensor, multiplier: float) -> tuple[Tensor, Tensor]:
        """A sublayer's output added to the residual stream and the next norm: (h', `rms_norm(norm, h')`)
        with h' = h + y, or torch.add(h, y, alpha=multiplier)'s sum (the multiplier rounded to the
        model dtype first); h, y [T, width] in the model dtype."""
        ...

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        """A gated MLP's activation: silu(gate) * up of gate, up [T, I] (model dtype; the halves of one fused
        product or two products) -> [T, I]."""
        ...

    def gate_norm(self, y: Tensor, z: Tensor, norm: GateNorm | None, out_dtype: torch.dtype | None = None) -> Tensor:
        """A Mamba layer's gate on its scan output: `norm(y, z)`, or y * silu(z) without a norm. y [T, I] fp32,
        z [T, I] in the model dtype. Returns [T, I] fp32, or that result rounded once to `out_dtype`."""
        ...

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None, silu: bool = True) -> Tensor:  # fmt: skip
        """`conv_prefill` of several requests at once: x: [sum of lengths, Cd], the segments' rows
        concatenated; spans: (length, slot) of each, in order (worker_proc.kernels.segments). Returns
        [sum of lengths, Cd]; every span's slot advanced past its segment."""
        ...

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        """`ssd_prefill` of several requests at once, the rows of `spans` concatenated as in
        `conv_prefill_many`. Returns y [sum of lengths, H, P] fp32."""
        ...

    def attn_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, start_pos: int,
                     scale: float) -> Tensor:  # fmt: skip
        """q: [L, h, d]; k_pool, v_pool: [S, kvh, d] (this step's K/V already written);
        kv_idx: [start_pos + L] int64 slots of positions 0.. ; returns [L, h, d] (causal)."""
        ...

    def attn_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, lengths: Tensor,
                    scale: float) -> Tensor:  # fmt: skip
        """q: [Bt, h, d]; kv_idx: [Bt, T] int64 slots, padded with 0 past lengths[b]; returns [Bt, h, d]."""
        ...

    def attn_prefill_many(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, spans: AttnSpans,
                          scale: float) -> Tensor:  # fmt: skip
        """`attn_prefill` of several requests at once: q [sum of lengths, h, d], the segments' rows
        concatenated; spans: (length, start_pos, kv_idx) of each, in order. Returns [sum of lengths, h, d]."""
        ...

    def gdn_prefill(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        """The gated delta rule over one request (worker_proc.kernels.gated_delta states it): q, k:
        [L, Hv, Dk] L2-normalised, one per value head, q multiplied by `scale` here; v: [L, Hv, Dv];
        g: [L, Hv] log decay (<= 0); beta: [L, Hv]; state_pool: [S, Hv, Dk, Dv], row `slot`
        advanced. Returns o [L, Hv, Dv] fp32, independent of the kernel's chunking beyond rounding."""
        ...

    def gdn_prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        """`gdn_prefill` of several requests at once, the rows of `spans` concatenated as in
        `conv_prefill_many`. Returns o [sum of lengths, Hv, Dv] fp32; every span's slot advanced."""
        ...

    def gdn_decode(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        """One token per request: q, k: [Bt, Hv, Dk]; v: [Bt, Hv, Dv]; g, beta: [Bt, Hv]; slots: [Bt]
        int64 (distinct). Returns o [Bt, Hv, Dv] fp32; rows `slots` of state_pool advanced by one."""
        ...

    def kda_prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        """The per-channel gated delta rule (worker_proc.kernels.kimi_delta states it) over several
        requests' rows concatenated as in `conv_prefill_many`: q, k: [sum of lengths, H, Dk]
        L2-normalised, q multiplied by `scale` here; v: [.., H, Dv]; g: [.., H, Dk] log decay (<= 0);
        beta: [.., H]; state_pool: [S, H, Dk, Dv]. Returns o [sum of lengths, H, Dv] fp32; every span's
        slot advanced, independent of the kernel's chunking beyond rounding."""
        ...

    def kda_decode(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        """One token per request: q, k, g: [Bt, H, Dk]; v: [Bt, H, Dv]; beta: [Bt, H]; slots: [Bt] int64
        (distinct). Returns o [Bt, H, Dv] fp32; rows `slots` of state_pool advanced by one."""
        ...

    def selective_scan_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                               state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        """Mamba1's selective scan over one request (worker_proc.kernels.selective_scan states it): x [L, D]
        (the conv output); dt [L, D] raw (p.dt_bias and softplus applied here); b, c [L, N]; state_pool
        [S, D, N], row `slot` advanced. Returns y [L, D] fp32 with the D skip (not gated)."""
        ...

    def selective_scan_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                                    state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        """`selective_scan_prefill` of several requests at once, the rows of `spans` concatenated as in
        `conv_prefill_many`. Returns y [sum of lengths, D] fp32; every span's slot advanced."""
        ...

    def selective_scan_decode(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                              state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        """One token per request: x, dt [Bt, D]; b, c [Bt, N]; slots [Bt] int64 (distinct). Returns y [Bt, D]
        fp32; rows `slots` of state_pool advanced by one."""
        ...
