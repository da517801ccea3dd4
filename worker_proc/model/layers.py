"""Norms and MLPs of GraniteMoeHybrid: RMSNorm, the shared gated MLP, the sparse MoE block.

Parameter names mirror the Hugging Face checkpoint so the loader
maps tensors 1:1 (`input_linear.weight`, `output_linear.weight`, `router.layer.weight`).
Everything here is vectorised over all tokens of a step ([T, hidden]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_GEMM_ROWS = 16
"""Row count below which CPU BLAS switches to kernels whose rounding depends on the row count;
padding small inputs up to it makes every row's result independent of what it is batched with."""


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 0
) -> torch.Tensor:
    """F.linear over [T, in]. With `min_rows` (the deterministic mode passes MIN_GEMM_ROWS) a CPU input
    of fewer rows is zero-padded up to it, so each row's result does not depend on T (batch
    invariance; measured with MKL on x86: every row count >= MIN_GEMM_ROWS gives identical rows).
    Padding is the price of that rule: a one-row GEMV becomes a 16-row GEMM."""
    rows = x.shape[0]
    if rows >= min_rows or x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    padded = torch.cat([x, x.new_zeros(min_rows - rows, x.shape[1])])
    return F.linear(padded, weight, bias)[:rows]


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed through `linear`; `min_rows` is set by the model
    (`HybridForCausalLM.set_batch_invariant`)."""

    min_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.min_rows)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """weight * x / rms(x), the normalisation computed in float32 and cast back before the weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2 output norm: RMSNorm(y * silu(z)) computed per group of `size // groups` channels."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y: [T, I] (float32 scan output), z: [T, I] gate -> [T, I] float32."""
        h = y.float() * F.silu(z.float())
        g = h.view(h.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.view_as(h)


class GatedMLP(nn.Module):
    """`shared_mlp`: output_linear(silu(gate) * up), gate/up = the two halves of input_linear."""

    def __init__(self, hidden: int, inner: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_linear = Linear(hidden, 2 * inner, bias=False, dtype=dtype, device=device)
        self.output_linear = Linear(inner, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer = Linear(hidden, experts, bias=False, dtype=dtype, device=device)


class SparseMoE(nn.Module):
    """`block_sparse_moe`: top-k router (softmax over the chosen logits) and stacked experts.

    input_linear.weight: [E, 2 * inner, hidden]; output_linear.weight: [E, hidden, inner].
    """

    def __init__(
        self, hidden: int, inner: int, experts: int, top_k: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.router = Router(hidden, experts, dtype, device)
        self.input_linear = nn.Module()
        self.input_linear.weight = _empty(experts, 2 * inner, hidden, dtype=dtype, device=device)
        self.output_linear = nn.Module()
        self.output_linear.weight = _empty(experts, hidden, inner, dtype=dtype, device=device)
        self.num_experts = experts
        self.top_k = top_k
        self.min_rows = 0  # MIN_GEMM_ROWS in the deterministic mode (see `linear`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # [T, k]
        top_w = top_logits.softmax(dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        w_in = self.input_linear.weight
        w_out = self.output_linear.weight
        flat_idx = top_idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            sel = order[start : start + count]
            start += count
            tokens = sel // self.top_k
            gate, up = linear(x[tokens], w_in[expert], min_rows=self.min_rows).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, w_out[expert], min_rows=self.min_rows)
            h = h * top_w.flatten()[sel][:, None]
            out.index_add_(0, tokens, h)
        return out
