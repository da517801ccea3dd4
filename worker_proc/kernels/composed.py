"""`ComposedSteps`: the `KernelOps` methods every implementation can build from its other methods and
torch (a mixin of `ReferenceOps` and `TritonOps`); an implementation with a fused kernel for one of them
overrides it (`NativeOps`). Contracts: worker_proc.kernels.interface."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import GateNorm, ResidualNorm, SsdParams
from worker_proc.kernels.state_codec import StatePool


class ComposedSteps:
    """`mamba_decode` from the class's own `conv_decode` and `ssd_decode`, `short_conv_decode` from its
    `conv_decode`; the norms as their modules run them;
    the gated MLP activation as torch computes it."""

    def mamba_decode(self, xbc: Tensor, dt: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                     bias: Tensor | None, p: SsdParams, ssm_pool: StatePool, groups: int,
                     head_group: Tensor | None) -> Tensor:  # fmt: skip
        heads = dt.shape[1]
        d_head, n = codec.state_shape(ssm_pool)[-2:]
        conv = self.conv_decode(  # type: ignore[attr-defined]
            xbc, conv_pool, slots, weight, bias)
        x, b, c = conv.split([heads * d_head, groups * n, groups * n], dim=-1)

        def grouped(t: Tensor) -> Tensor:  # [Bt, groups, N], or one group per head
            t = t.reshape(t.shape[0], groups, n)
            return t if head_group is None else t.index_select(1, head_group)

        return self.ssd_decode(  # type: ignore[attr-defined]
            x.reshape(-1, heads, d_head), dt, grouped(b), grouped(c), p, ssm_pool, slots)

    def short_conv_decode(self, bcx: Tensor, conv_pool: Tensor, slots: Tensor, weight: Tensor,
                          bias: Tensor | None) -> Tensor:  # fmt: skip
        b, c, x = bcx.chunk(3, dim=-1)
        return c * self.conv_decode(  # type: ignore[attr-defined]
            b * x, conv_pool, slots, weight, bias, silu=False)

    def rms_norm(self, norm: ResidualNorm, x: Tensor) -> Tensor:
        return norm(x)

    def add_rms_norm(self, norm: ResidualNorm, h: Tensor, y: Tensor, multiplier: float) -> tuple[Tensor, Tensor]:
        summed = h + y if multiplier == 1.0 else torch.add(h, y, alpha=multiplier)
        return summed, self.rms_norm(norm, summed)

    def gate_norm(self, y: Tensor, z: Tensor, norm: GateNorm | None, out_dtype: torch.dtype | None = None) -> Tensor:
        out = y * F.silu(z.float()) if norm is None else norm(y, z)
        return out if out_dtype is None else out.to(out_dtype)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up
