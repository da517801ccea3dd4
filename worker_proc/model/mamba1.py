"""The Mamba1 (selective scan) mixer of Mamba, FalconMamba and Jamba (`mixer.*` / `mamba.*` of a layer).

Per token: in_proj (hidden -> 2 * d_inner, bias with `proj_bias`) splits into x | z; the causal depthwise
conv of width `d_conv` + SiLU over x (bias with `conv_bias`) continues from the layer's conv window;
x_proj (d_inner -> dt_rank + 2 * d_state, no bias) splits into dt | B | C, each RMS-normed when the family
says so (`Mamba1Config.bcdt_norm`: FalconMamba's weightless norms, Jamba's `dt_layernorm` /
`b_layernorm` / `c_layernorm` weights); dt_proj's weight (d_inner x dt_rank) turns dt into one value per
channel, its bias is added inside the scan (softplus(dt + bias)); the selective scan
(worker_proc.kernels.selective_scan) advances the per-channel [d_inner, d_state] state, y = scan + D * x;
out = out_proj(y * silu(z)). The conv window and the SSM state live in the worker's pools (`mamba1_conv`,
`mamba1_ssm`, worker_proc.state.pools), read and advanced in place by state slot; this module owns no state.
Tensor parallelism: every rank holds a contiguous 1/N of the d_inner channels (`mamba1_spec`): their rows of
x and of z in in_proj, their conv channels, x_proj's input columns (row-parallel: dt | B | C are all-reduced,
whole on every rank), dt_proj's output rows and bias, A_log's and D's rows, out_proj's input columns
(row-parallel, all-reduced here). The dt/B/C norm weights are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.kernels.interface import SelectiveScanParams, Spans
from worker_proc.kernels.state_codec import StatePool
from worker_proc.model.batch import DecodeGroup, StepBatch, rows_of
from worker_proc.model.layers import Linear, empty_param
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.model.tp import row_parallel


def mamba1_spec(cfg: HybridConfig, tp: TPInfo, sub: str) -> ShardSpec | None:
    """This rank's slice of a Mamba1 tensor: its d_inner channels of each segment (None: replicated)."""
    inner = cfg.mamba1.d_inner
    width = inner // tp.size
    ch = (tp.rank * width, (tp.rank + 1) * width)
    xz = (ch, (ch[0] + inner, ch[1] + inner))
    table = {"in_proj.weight": (0, xz), "in_proj.bias": (0, xz), "conv1d.weight": (0, (ch,)),
             "conv1d.bias": (0, (ch,)), "x_proj.weight": (1, (ch,)), "dt_proj.weight": (0, (ch,)),
             "dt_proj.bias": (0, (ch,)), "A_log": (0, (ch,)), "D": (0, (ch,)), "out_proj.weight": (1, (ch,))}
    hit = table.get(sub)
    return None if hit is None else ShardSpec(*hit)


class ScanInputNorm(nn.Module):
    """RMS norm of dt, B or C after x_proj: x / rms(x) in float32, rounded to x's dtype, times `weight`
    when the family has one (Jamba; FalconMamba's norms are weightless)."""

    def __init__(self, size: int, eps: float, weighted: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(size, dtype=dtype, device=device) if weighted else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else self.weight * out


class Mamba1Mixer(nn.Module):
    reduced = True  # out_proj is all-reduced here
    state_kind = "mamba1"  # its pools: StatePools.layer_state("mamba1", i)

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        m = cfg.mamba1
        self.cfg = cfg
        self.tp = tp
        self.width = width = m.d_inner // tp.size
        hidden = cfg.hidden_size
        self.in_proj = Linear(hidden, 2 * width, bias=m.proj_bias, dtype=dtype, device=device)
        self.conv1d = nn.Module()
        self.conv1d.weight = empty_param(width, 1, m.d_conv, dtype=dtype, device=device)
        self.conv1d.bias = empty_param(width, dtype=dtype, device=device) if m.conv_bias else None
        self.x_proj = Linear(width, m.dt_rank + 2 * m.d_state, bias=False, dtype=dtype, device=device)
        self.dt_proj = Linear(m.dt_rank, width, bias=True, dtype=dtype, device=device)
        self.A_log = empty_param(width, m.d_state, dtype=dtype, device=device)
        self.D = empty_param(width, dtype=dtype, device=device)
        self.out_proj = Linear(width, hidden, bias=m.proj_bias, dtype=dtype, device=device)
        self.dt_layernorm: ScanInputNorm | None = None
        self.b_layernorm: ScanInputNorm | None = None
        self.c_layernorm: ScanInputNorm | None = None
        if m.bcdt_norm:
            weighted = m.bcdt_norm == "weighted"
            self.dt_layernorm = ScanInputNorm(m.dt_rank, m.norm_eps, weighted, dtype, device)
            self.b_layernorm = ScanInputNorm(m.d_state, m.norm_eps, weighted, dtype, device)
            self.c_layernorm = ScanInputNorm(m.d_state, m.norm_eps, weighted, dtype, device)
        self._a_cache: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else mamba1_spec(self.cfg, self.tp, sub)

    def forward(self, h: torch.Tensor, batch: StepBatch, conv_pool: torch.Tensor, ssm_pool: StatePool,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; conv_pool: [S, d_inner / N, d_conv - 1] and ssm_pool: [S, d_inner / N, d_state] of
        this layer."""
        x, z = self.in_proj(h).split(self.width, dim=-1)

        def decode(group: DecodeGroup, rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_decode((x,), rows, group.state_slots, conv_pool, ssm_pool, ops)

        def prefill(rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_prefill((rows_of(x, rows),), batch.prefill_spans, conv_pool, ssm_pool, ops)

        batch.keep_recurrent_inputs(self, (x,), conv_pool, ssm_pool)
        y = batch.by_group(decode, prefill)
        return row_parallel(ops.gate_norm(y, z, None, h.dtype), self.out_proj, self.tp)

    def _scan_inputs(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output [T, d_inner / N] -> (dt [T, d_inner / N] before its bias, B [T, N], C [T, N])."""
        m = self.cfg.mamba1
        dt, b, c = row_parallel(xc, self.x_proj, self.tp).split([m.dt_rank, m.d_state, m.d_state], dim=-1)
        if self.dt_layernorm is not None and self.b_layernorm is not None and self.c_layernorm is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        return self.dt_proj.matmul(dt), b, c

    def recur_prefill(self, inputs: tuple[torch.Tensor, ...], spans: Spans, conv_pool: torch.Tensor,
                      ssm_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv and scan of prefill segments: `inputs` = (x before the conv,) of every segment's rows, in
        `spans` order, advance each span's slot past its segment; the scan output [rows, d_inner / N] fp32."""
        (x,) = inputs
        xc = ops.conv_prefill_many(x, conv_pool, spans, self.conv1d.weight[:, 0, :], self.conv1d.bias)
        dt, b, c = self._scan_inputs(xc)
        return ops.selective_scan_prefill_many(xc, dt, b, c, self._params(), ssm_pool, spans)

    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, ssm_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv and scan of one token per state slot: `rows` of `inputs` = (x before the conv,) advance
        `slots` by one; the scan output. A forward's decode group, and the replay of a verify slice's
        accepted tokens (worker_proc.spec.verify)."""
        (x,) = inputs
        xc = ops.conv_decode(rows_of(x, rows), conv_pool, slots, self.conv1d.weight[:, 0, :], self.conv1d.bias)
        dt, b, c = self._scan_inputs(xc)
        return ops.selective_scan_decode(xc, dt, b, c, self._params(), ssm_pool, slots)

    def _params(self) -> SelectiveScanParams:
        """The scan constants; A = -exp(A_log) is computed again only when A_log was replaced or written."""
        a_log = self.A_log
        cache = self._a_cache
        if cache is None or cache[0] is not a_log or cache[1] != a_log._version:  # loaded (or replaced) since
            cache = self._a_cache = (a_log, a_log._version, -torch.exp(a_log.float()))
        return SelectiveScanParams(cache[2], self.D, self.dt_proj.bias)
