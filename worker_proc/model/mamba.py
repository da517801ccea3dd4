"""The Mamba2 mixer shared by every family (`mamba.*` or `mixer.*` of a layer).

in_proj (its z | x | B | C | dt segments optionally scaled by
Falcon-H1's `ssm_multipliers`) -> split (z | xBC | dt) -> causal depthwise conv1d + SiLU over
xBC -> split (x | B | C) -> SSD scan (A = -exp(A_log), D skip, dt_bias, softplus, time_step_limit)
-> gated RMSNorm grouped by n_groups (RMSNorm(y * silu(z)), or RMSNorm(y) * silu(z) with
`mamba_norm_before_gate`, or only y * silu(z) without `mamba_norm`) -> out_proj. The conv and
SSM states live in the worker's pools and are read/advanced in place by slot; this module owns no
state of its own.
Under tensor parallelism every size here is this rank's (`MambaShard`, see worker_proc.model.tp).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.kernels.interface import Spans, SsdParams
from worker_proc.kernels.state_codec import StatePool
from worker_proc.model.batch import DecodeGroup, StepBatch, rows_of
from worker_proc.model.layers import GatedRMSNorm, Linear, empty_param
from worker_proc.model.tp import MambaShard, ShardSpec, SpanGatedRMSNorm, TPInfo, mamba_spec, row_parallel


class MambaMixer(nn.Module):
    reduced = True  # out_proj is all-reduced here
    state_kind = "mamba"  # its pools: StatePools.layer_state("mamba", i)

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        s = self.shard = MambaShard.of(cfg, tp.rank, tp.size)
        proj = s.inner + s.conv_dim + s.heads
        self.in_proj = Linear(cfg.hidden_size, proj, bias=cfg.mamba.proj_bias, dtype=dtype, device=device)
        self.conv1d = nn.Module()
        self.conv1d.weight = empty_param(s.conv_dim, 1, cfg.mamba.d_conv, dtype=dtype, device=device)
        self.conv1d.bias = empty_param(s.conv_dim, dtype=dtype, device=device) if cfg.mamba.conv_bias else None
        self.A_log = empty_param(s.heads, dtype=dtype, device=device)
        self.D = empty_param(s.heads, dtype=dtype, device=device)
        self.dt_bias = empty_param(s.heads, dtype=dtype, device=device)
        before = cfg.mamba.norm_before_gate
        self.norm: GatedRMSNorm | SpanGatedRMSNorm | None = None
        if cfg.mamba.norm:
            self.norm = (
                SpanGatedRMSNorm(s, cfg.mamba.n_groups, cfg.rms_norm_eps, tp, dtype, device, before)
                if s.norm_shared
                else GatedRMSNorm(s.inner, s.norm_groups, cfg.rms_norm_eps, dtype, device, before)
            )
        out_bias = cfg.mamba.proj_bias if cfg.mamba.out_proj_bias is None else cfg.mamba.out_proj_bias
        self.out_proj = Linear(s.inner, cfg.hidden_size, bias=out_bias, dtype=dtype, device=device)
        self.param_dtype = dtype
        self.derive_buffers(device)
        self._a_cache: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def derive_buffers(self, device: torch.device) -> None:
        """(Re)make the buffers computed from the config and shard, on `device` (the loader of a
        pre-quantized checkpoint builds the model on the meta device, then calls this on the real one)."""
        s = self.shard
        # expands B/C to one group per head when this rank's heads spread unevenly over its groups
        head_group = None if s.head_group is None else torch.tensor(s.head_group, dtype=torch.int64, device=device)
        self.register_buffer("head_group", head_group, persistent=False)
        self.register_buffer("mup", self._mup_vector(self.cfg, self.param_dtype, device), persistent=False)

    def _mup_vector(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """This rank's in_proj output scale (z | x | B | C | dt), or None when all are 1."""
        m = cfg.mamba.multipliers
        if not m or all(v == 1.0 for v in m):
            return None
        s = self.shard
        sizes = (s.inner, s.inner, s.group_dim, s.group_dim, s.heads)
        parts = [torch.full((n,), float(v), dtype=dtype, device=device) for n, v in zip(sizes, m, strict=True)]
        return torch.cat(parts)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else mamba_spec(self.cfg, self.shard, sub)

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """[T, groups * N] -> [T, G', N] with this rank's heads spread evenly over the G' groups."""
        t = t.reshape(t.shape[0], len(self.shard.groups), self.shard.d_state)
        return t if self.head_group is None else t.index_select(1, self.head_group)

    def forward(
        self,
        h: torch.Tensor,
        batch: StepBatch,
        conv_pool: torch.Tensor,
        ssm_pool: StatePool,
        ops: KernelOps,
    ) -> torch.Tensor:
        """h: [T, hidden]; conv_pool: [S, conv_dim, K-1] and ssm_pool: [S, H, P, N] of this layer."""
        s = self.shard
        proj = self.in_proj(h)
        if self.mup is not None:
            proj = proj * self.mup
        z, xbc, dt = proj.split([s.inner, s.conv_dim, s.heads], dim=-1)

        def decode(group: DecodeGroup, rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_decode((xbc, dt), rows, group.state_slots, conv_pool, ssm_pool, ops)

        def prefill(rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_prefill((rows_of(xbc, rows), rows_of(dt, rows)), batch.prefill_spans, conv_pool,
                                      ssm_pool, ops)  # fmt: skip

        batch.keep_recurrent_inputs(self, (xbc, dt), conv_pool, ssm_pool)
        return self._output(batch.by_group(decode, prefill), z, h, ops)

    def recur_prefill(self, inputs: tuple[torch.Tensor, torch.Tensor], spans: Spans, conv_pool: torch.Tensor,
                      ssm_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv and scan of prefill segments: the in_proj outputs `inputs` = (xBC, dt) of every segment's
        rows, concatenated in `spans` order, advance each span's slot past its segment; the scan output
        [rows, H, P]. A forward's prefill group, and the plan's timing of it (worker_proc.plan.mixer_timer)."""
        s = self.shard
        xbc, dt = inputs
        conv_out = ops.conv_prefill_many(xbc, conv_pool, spans, self.conv1d.weight[:, 0, :], self.conv1d.bias)
        x, b, c = conv_out.split([s.inner, s.group_dim, s.group_dim], dim=-1)
        return ops.ssd_prefill_many(x.reshape(-1, s.heads, s.d_head), dt, self._groups(b), self._groups(c),
                                    self._ssd_params(), ssm_pool, spans)  # fmt: skip

    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, ssm_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv and scan of one token per state slot: `rows` of the in_proj outputs `inputs` =
        (xBC, dt) advance `slots` by one; the scan output [rows, H, P]. A forward's decode group, and
        the replay of a verify slice's accepted tokens (worker_proc.spec.verify)."""
        xbc, dt = inputs
        return ops.mamba_decode(rows_of(xbc, rows), rows_of(dt, rows), conv_pool, slots, self.conv1d.weight[:, 0, :],
                                self.conv1d.bias, self._ssd_params(), ssm_pool, len(self.shard.groups),
                                self.head_group)  # fmt: skip

    def _output(self, y: torch.Tensor, z: torch.Tensor, h: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """The scan output y [T, H, P] through the gate/norm and out_proj (all-reduced under TP)."""
        y = y.reshape(h.shape[0], self.shard.inner)
        norm = self.norm
        out = norm(y, z) if isinstance(norm, SpanGatedRMSNorm) else ops.gate_norm(y, z, norm, h.dtype)
        return row_parallel(out.to(h.dtype), self.out_proj, self.tp)

    def _ssd_params(self) -> SsdParams:
        """The scan constants; A = -exp(A_log) is computed again only when A_log was replaced or written."""
        a_log = self.A_log
        cache = self._a_cache
        if cache is None or cache[0] is not a_log or cache[1] != a_log._version:  # loaded (or replaced) since
            cache = self._a_cache = (a_log, a_log._version, -torch.exp(a_log.float()))
        cfg = self.cfg
        return SsdParams(cache[2], self.D, self.dt_bias, cfg.mamba.time_step_limit, cfg.mamba.chunk_size)
