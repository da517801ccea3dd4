"""`NativeOps`: `FastOps` with a Mamba layer's decode step (conv + scan), its prefill conv and scan over
every segment, its gated norm, the residual norms, the gated MLP activation, decode attention and prefill
attention in the fused CPU kernels of `scan_ops.cpp`, `norm_ops.cpp`, `attn_ops.cpp` and
`prefill_attn_ops.cpp` (one call each per layer instead of tens of dispatched ops); Mamba1's selective scan
prefill over every segment in `selective_scan_ops.cpp`; `NativeGdn`, the gated delta rule's decode step, and
`NativeKda`, Kimi Delta Attention's per-channel rule (decode step and prefill), in `delta_ops.cpp`.

Same interface and mathematics as `FastOps` (checked against `ReferenceOps` by the kernel tests);
not batch invariant. The recurrent state is read and written in its storage (float32, bfloat16 or int8,
state_codec's encodings) once per call. Where a fused kernel does not hold its inputs (float64 tensors,
a non-unit-stride row) the `FastOps` method runs instead. Only constructed after
`worker_proc.kernels.native.load()` returned True.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker_proc.host.memory import zeros
from worker_proc.kernels.fast import FastOps
from worker_proc.kernels.gdn_ops import FastGdn
from worker_proc.kernels.interface import RMS_WEIGHTINGS, GateNorm, ResidualNorm, SelectiveScanParams, Spans, SsdParams
from worker_proc.kernels.kda_ops import ReferenceKda, each_segment
from worker_proc.kernels.state_codec import QuantizedPool, StatePool

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PREFILL_HEAD_WIDTH = 64  # prefill_attn_ops.cpp: head widths it takes are multiples of this
PREFILL_KEY_BLOCK = 64  # prefill_attn_ops.cpp: the context is packed in blocks of this many keys


class NativeOps(FastOps):
    name = "native"

    def __init__(self, gdn: object | None = None) -> None:
        super().__init__(gdn)
        self._f32_copies: dict[int, tuple[Tensor, int, Tensor]] = {}
        self._attn_workspace = torch.empty(0)

    def _f32(self, t: Tensor) -> Tensor:
        """`t` in float32, converted once per version of it: the scan constants and gate norm weights every
        step reads (the kernels would convert a reduced-precision one on each call)."""
        if t.dtype == torch.float32:
            return t
        hit = self._f32_copies.get(id(t))
        if hit is None or hit[0] is not t or hit[1] != t._version:
            hit = self._f32_copies[id(t)] = (t, t._version, t.float())
        return hit[2]

    def mamba_decode(self, xbc: Tensor, dt: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                     bias: Tensor | None, p: SsdParams, ssm_pool: StatePool, groups: int,
                     head_group: Tensor | None) -> Tensor:  # fmt: skip
        if not (xbc.dtype in _MODEL_DTYPES and xbc.dtype == conv_pool.dtype == weight.dtype
                and xbc.stride(-1) == 1 and dt.stride(-1) == 1):  # fmt: skip
            return super().mamba_decode(xbc, dt, conv_pool, slots, weight, bias, p, ssm_pool, groups, head_group)
        lo, hi = p.dt_limit
        return torch.ops.hyssm_cpu.mamba_decode(xbc, dt, conv_pool, *_pool_args(ssm_pool), slots, weight, bias, p.a,
                                                self._f32(p.d), self._f32(p.dt_bias), head_group, lo, hi,
                                                groups)  # fmt: skip

    @staticmethod
    def _fused_conv(x: Tensor, conv_pool: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
        """Whether the fused prefill conv holds these inputs (with or without its SiLU)."""
        return (x.dtype in _MODEL_DTYPES and x.dtype == conv_pool.dtype == weight.dtype and x.stride(-1) == 1
                and (bias is None or bias.dtype == x.dtype))  # fmt: skip

    def conv_prefill(self, x: Tensor, conv_pool: Tensor, slot: int, weight: Tensor, bias: Tensor | None,
                     silu: bool = True) -> Tensor:  # fmt: skip
        if not self._fused_conv(x, conv_pool, weight, bias):
            return super().conv_prefill(x, conv_pool, slot, weight, bias, silu)
        return self.conv_prefill_many(x, conv_pool, ((x.shape[0], slot),), weight, bias, silu)

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None, silu: bool = True) -> Tensor:  # fmt: skip
        """Every segment in one call, each continuing from its own window (no padding)."""
        if not self._fused_conv(x, conv_pool, weight, bias):
            return super().conv_prefill_many(x, conv_pool, spans, weight, bias, silu)
        lengths, slots = [length for length, _ in spans], [slot for _, slot in spans]
        return torch.ops.hyssm_cpu.conv_prefill(x, conv_pool, lengths, slots, weight, bias, silu)

    def short_conv_decode(self, bcx: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                          bias: Tensor | None) -> Tensor:  # fmt: skip
        """B * x, the window, the conv and the product with C in one pass (`short_conv_ops.cpp`)."""
        if not (bcx.dim() == 2 and bcx.dtype in _MODEL_DTYPES and bcx.dtype == conv_pool.dtype == weight.dtype
                and bcx.stride(-1) == 1 and conv_pool.is_contiguous()
                and (bias is None or bias.dtype == bcx.dtype)):  # fmt: skip
            return super().short_conv_decode(bcx, conv_pool, slots, weight, bias)
        return torch.ops.hyssm_cpu.short_conv_decode(bcx, conv_pool, slots, weight.contiguous(), bias)

    def ssd_prefill(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                    slot: int) -> Tensor:  # fmt: skip
        return self.ssd_prefill_many(x, dt, b, c, p, ssm_pool, ((x.shape[0], slot),))

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        """The scan token by token, every segment in one call (no chunking, no padding)."""
        if not (x.dtype in _MODEL_DTYPES and x.dtype == dt.dtype == b.dtype == c.dtype
                and x.shape[1] % b.shape[1] == 0):  # fmt: skip
            return super().ssd_prefill_many(x, dt, b, c, p, ssm_pool, spans)
        lo, hi = p.dt_limit
        lengths, slots = [length for length, _ in spans], [slot for _, slot in spans]
        return torch.ops.hyssm_cpu.ssd_prefill(x, dt, b, c, *_pool_args(ssm_pool), lengths, slots, p.a,
                                               self._f32(p.d), self._f32(p.dt_bias), lo, hi)  # fmt: skip

    def _selective_scan(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                        state_pool: StatePool, slots: Tensor, lengths: list[int]) -> Tensor:  # fmt: skip
        """One call of `selective_scan_ops.cpp` (its inputs as contiguous float32, the pool as [S, D, 1, N])."""
        pool, scale = _pool_args(state_pool)
        inputs = [t.float().contiguous() for t in (x, dt, b, c)]
        consts = [self._f32(t).contiguous() for t in (p.a, p.d, p.dt_bias)]
        return torch.ops.hyssm_cpu.selective_scan(*inputs, *consts, pool.unsqueeze(2),
                                                  None if scale is None else scale.unsqueeze(2), slots, lengths)

    def selective_scan_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                                    state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        """Every segment in one call. The decode step stays the pure-torch one (SelectiveScanMethods): on a
        [2048, 16] state per layer the kernel's one-token mode measured slower than torch's (0.17 against
        0.12 ms at one request, 1.41 against 0.82 ms at eight, one thread), its prefill faster (27 against
        44 ms for 256 tokens)."""
        slots = torch.tensor([slot for _, slot in spans], dtype=torch.int64)
        return self._selective_scan(x, dt, b, c, p, state_pool, slots, [length for length, _ in spans])

    def gate_norm(self, y: Tensor, z: Tensor, norm: GateNorm | None, out_dtype: torch.dtype | None = None) -> Tensor:
        """The kernel writes `out_dtype` itself when it is z's (the float32 result rounded as `.to` rounds)."""
        if z.dtype not in _MODEL_DTYPES or z.stride(-1) != 1 or out_dtype not in (None, torch.float32, z.dtype):
            return super().gate_norm(y, z, norm, out_dtype)
        y = y.contiguous()
        rounded = out_dtype is not None and out_dtype != torch.float32
        if norm is None:
            return torch.ops.hyssm_cpu.gated_rms_norm(y, z, None, 1, 0.0, False, rounded)
        return torch.ops.hyssm_cpu.gated_rms_norm(y, z, self._f32(norm.weight), norm.groups, norm.eps,
                                                  norm.before_gate, rounded)  # fmt: skip

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        if not (gate.dim() == up.dim() == 2 and gate.stride(-1) == up.stride(-1) == 1
                and gate.dtype in _MODEL_DTYPES and gate.dtype == up.dtype and gate.shape == up.shape):  # fmt: skip
            return super().silu_mul(gate, up)
        return torch.ops.hyssm_cpu.silu_mul(gate, up)

    def attn_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, lengths: Tensor,
                    scale: float) -> Tensor:  # fmt: skip
        """Every request of the group in one call, each over exactly its own slots (no gathered copy of its
        keys, no padding to the longest context)."""
        if not (q.dim() == 3 and q.dtype in _MODEL_DTYPES and q.dtype == k_pool.dtype == v_pool.dtype
                and k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()):  # fmt: skip
            return super().attn_decode(q, k_pool, v_pool, kv_idx, lengths, scale)
        return torch.ops.hyssm_cpu.attn_decode(q, k_pool, v_pool, kv_idx, lengths, scale)

    def attn_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_idx: Tensor, start_pos: int,
                     scale: float) -> Tensor:  # fmt: skip
        """The chunk's queries over exactly its context's slots in one call (no gathered copy, no merge of
        parts). The context is packed into a workspace kept between calls: one mapping with room for every
        slot of the pool, made once, whose pages become resident as contexts first reach them (a
        workspace regrown for each longer context left the freed smaller ones resident in the heap)."""
        d = q.shape[-1]
        if not (q.dim() == 3 and q.dtype in _MODEL_DTYPES and q.dtype == k_pool.dtype == v_pool.dtype
                and k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
                and d % PREFILL_HEAD_WIDTH == 0):  # fmt: skip
            return super().attn_prefill(q, k_pool, v_pool, kv_idx, start_pos, scale)
        padded = -(-kv_idx.numel() // PREFILL_KEY_BLOCK) * PREFILL_KEY_BLOCK
        need = 2 * k_pool.shape[1] * padded * d
        if self._attn_workspace.numel() < need:
            slots = -(-k_pool.shape[0] // PREFILL_KEY_BLOCK) * PREFILL_KEY_BLOCK
            room = max(need, 2 * k_pool.shape[1] * slots * d)
            try:
                self._attn_workspace = zeros((room,), torch.float32, "cpu")
            except OSError:  # a host that commits address space up front refused the pool-sized mapping
                self._attn_workspace = torch.empty(need, dtype=torch.float32)
        return torch.ops.hyssm_cpu.attn_prefill(q, k_pool, v_pool, kv_idx, start_pos, scale, self._attn_workspace)

    def rms_norm(self, norm: ResidualNorm, x: Tensor) -> Tensor:
        """A reduced-precision model's norm in one call (its module takes eight); a float32 `RMSNorm` stays
        torch's one call, whose sum of squares is transformers' own to the last bit."""
        if not _native_norm(norm, x):
            return super().rms_norm(norm, x)
        return torch.ops.hyssm_cpu.rms_norm(x, norm.weight, norm.eps, RMS_WEIGHTINGS.index(norm.weighting))

    def add_rms_norm(self, norm: ResidualNorm, h: Tensor, y: Tensor, multiplier: float) -> tuple[Tensor, Tensor]:
        """The add and the norm in one pass where the norm is the fused kernel's (`rms_norm`)."""
        if not (_native_norm(norm, h) and y.dtype == h.dtype and y.shape == h.shape and y.stride(-1) == 1):
            return super().add_rms_norm(norm, h, y, multiplier)
        return torch.ops.hyssm_cpu.add_rms_norm(h, y, multiplier, norm.weight, norm.eps,
                                                RMS_WEIGHTINGS.index(norm.weighting))


class NativeGdn(FastGdn):
    """`FastGdn` whose decode step is one call of `delta_ops.cpp` for every row: the slots are read from their
    tensor in the kernel, not into Python, so a decode step that holds Gated DeltaNet layers can be
    replayed (worker_proc.runtime.step_replay). Rows whose q, k, g or beta are not float32, or whose v is not in a
    model dtype, take `FastGdn.step`."""

    name = "native"

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        if not (q.dtype == k.dtype == g.dtype == beta.dtype == torch.float32 and v.dtype in _MODEL_DTYPES):
            return super().step(q, k, v, g, beta, scale, state_pool, slots)
        return torch.ops.hyssm_cpu.gdn_decode(q, k, v, g, beta, scale, *_pool_args(state_pool), slots)


class NativeKda(ReferenceKda):
    """Kimi Delta Attention in `delta_ops.cpp`: every prefill span of a call in one kernel call, each segment
    token by token from its slot's state (no chunks, no padding), and every decode row in one call, the slots
    read from their tensor in the kernel (replayable, as `NativeGdn`'s). Each slot's state is read in its storage
    and written back once per call. Inputs the kernel does not hold (q, k, g or beta not float32, v not in a
    model dtype) take `ReferenceKda`'s. Not bitwise the reference: a prefill agrees with its chunked form, and a
    decode step with its batched one, to float32 rounding.

    Faster than `ReferenceKda` at every shape measured (benchmarks/bench_kda.py, medians on a shared two-core
    EPYC with AVX-512, float32 state): decode at 32 heads of Dk = Dv = 128 for 1 / 8 / 32 sequences
    1.2 / 132 / 675 ms -> 0.08 / 11 / 20 ms, at Kimi's test shape (4 heads of 16) 0.12 -> 0.02 ms; prefill of
    64 / 256 / 1024 tokens at 32 heads of 128 414 / 1384 / 4336 ms -> 10 / 22 / 152 ms."""

    name = "native"

    def prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                     state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        if not _kda_holds(q, k, v, g, beta):
            return each_segment(super().chunked, q, k, v, g, beta, scale, state_pool, spans)
        slots = torch.tensor([slot for _, slot in spans], dtype=torch.int64)
        return torch.ops.hyssm_cpu.kda_rule(q, k, v, g, beta, scale, *_pool_args(state_pool), slots,
                                            [length for length, _ in spans])  # fmt: skip

    def chunked(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                state_pool: StatePool, slot: int) -> Tensor:  # fmt: skip
        return self.prefill_many(q, k, v, g, beta, scale, state_pool, ((q.shape[0], slot),))

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             state_pool: StatePool, slots: Tensor) -> Tensor:  # fmt: skip
        if not _kda_holds(q, k, v, g, beta):
            return super().step(q, k, v, g, beta, scale, state_pool, slots)
        return torch.ops.hyssm_cpu.kda_rule(q, k, v, g, beta, scale, *_pool_args(state_pool), slots, [])


def _kda_holds(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> bool:
    """`kda_rule` holds these inputs: q, k, g and beta float32, v in a model dtype."""
    return q.dtype == k.dtype == g.dtype == beta.dtype == torch.float32 and v.dtype in _MODEL_DTYPES


def _native_norm(norm: ResidualNorm, x: Tensor) -> bool:
    """`rms_norm`'s kernel holds this norm of x: [T, width] unit-stride rows in a model dtype, the weight in
    it, and not a float32 `RMSNorm` (torch's call stays)."""
    return (x.dim() == 2 and x.stride(-1) == 1 and x.dtype in _MODEL_DTYPES and norm.weight.dtype == x.dtype
            and not (x.dtype == torch.float32 and norm.weighting == "model_dtype"))


def _pool_args(pool: StatePool) -> tuple[Tensor, Tensor | None]:
    """A state pool as the fused kernels take it: its values, and the scales of an int8 one."""
    return (pool.values, pool.scale) if isinstance(pool, QuantizedPool) else (pool, None)
