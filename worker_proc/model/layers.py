"""The shared norms and MLP blocks: RMSNorm, gated RMSNorm, the fused gated MLP (GraniteMoeHybrid's
`shared_mlp`), the split gated MLP (`gate_proj`/`up_proj`/`down_proj`), the relu2 MLP, the softmax
top-k MoE (`block_sparse_moe`).

Parameter names mirror the Hugging Face checkpoints so the loader
maps tensors 1:1. Everything here is vectorised over all tokens of a step ([T, hidden]). MLP blocks
are column-parallel in, row-parallel out; they return this rank's *partial* sum (the decoder
all-reduces a sublayer's partial sums once) and name the slice of each weight a rank holds
(`shard_spec`, the rules of worker_proc.model.tp).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc.host.memory import weight_tensor
from worker_proc.kernels.interface import KernelOps
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.lora.layer import LoraLayer
from worker_proc.model.shard import ShardSpec, TPInfo, column_spec


def silu(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """SiLU; `exact` (the deterministic mode) takes it in float64 and rounds: float32 SIMD and scalar
    tails differ in the last bit, and where a row's elements fall relative to the tail depends on
    the row count whenever the width is not a multiple of the vector length."""
    return F.silu(x.double()).to(x.dtype) if exact else F.silu(x)


def expert_groups(idx: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Top-k routing choices idx [T, k] grouped by expert, in expert order: (expert, positions in the
    flattened idx, the token of each position); experts nobody chose are skipped."""
    k = idx.shape[1]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            sel = order[start : start + count]
            start += count
            yield expert, sel, sel // k


class Linear(nn.Linear, GemmOwner):
    """nn.Linear (same parameter names) whose products go through its `gemm` site: the execution plan
    binds the site's method per row count (worker_proc.plan.execution_plan), and may replace `weight` by an
    empty tensor when every bound method reads the site's packed copy instead (and the quantization
    does when it quantizes the site). `lora`: the layer's adapters when the rank serves them
    (worker_proc.lora.layer; None: the base product alone), added to both products."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, quantizable: bool = True, timed_rows: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        if self.weight.device.type == "cpu":  # the weight a few-row product streams lies on huge pages
            held = weight_tensor(tuple(self.weight.shape), self.weight.dtype).copy_(self.weight.detach())
            self.weight = nn.Parameter(held, requires_grad=self.weight.requires_grad)
        self.gemm = GemmSite(out_features, in_features, self.weight.dtype, packable=True, quantizable=quantizable,
                             timed_rows=timed_rows)  # fmt: skip
        self.lora: LoraLayer | None = None

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        yield self.gemm, self, "weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gemm.apply(x, self.weight, self.bias)
        return out if self.lora is None else self.lora.add(x, out)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T without the bias (a row-parallel rank's partial sum, its LoRA term's partial included)."""
        out = self.gemm.apply(x, self.weight, None)
        return out if self.lora is None else self.lora.add(x, out)


def expert_site(stacked: torch.Tensor) -> GemmSite:
    """The site of one expert's slice of a stacked [E, out, in] weight (no packed copy: the slice
    changes with each expert)."""
    return GemmSite(stacked.shape[1], stacked.shape[2], stacked.dtype, packable=False, experts=True)


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised frozen parameter (the loader fills it from the checkpoint); on the CPU in
    `host_memory.weight_tensor`'s storage."""
    data = weight_tensor(shape, dtype) if torch.device(device).type == "cpu" else torch.empty(*shape, dtype=dtype,
                                                                                              device=device)
    return nn.Parameter(data, requires_grad=False)


class RMSNorm(nn.Module):
    """weight * x / rms(x), the normalisation computed in float32 and cast back before the weight;
    with `fp32_weight` (Nemotron-H) the weight is applied in float32 and the product cast back."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.fp32_weight = fp32_weight
        self.weighting = "float32" if fp32_weight else "model_dtype"  # kernels.interface.RMS_WEIGHTINGS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the same arithmetic, one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class UnitOffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen3-Next / Qwen3.5): (x / rms(x) * (1 + weight)) in float32, cast back
    to x's dtype; the weight is stored around 0."""

    weighting = "unit_offset"  # kernels.interface.RMS_WEIGHTINGS

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(size: int, eps: float, dtype: torch.dtype, device: torch.device, unit_offset: bool = False,
              fp32_weight: bool = False) -> RMSNorm | UnitOffsetRMSNorm:
    """The residual-stream (and q/k) norm of a family: zero-centred with `unit_offset`, else RMSNorm."""
    if unit_offset:
        return UnitOffsetRMSNorm(size, eps, dtype, device)
    return RMSNorm(size, eps, dtype, device, fp32_weight)


class GatedRMSNorm(nn.Module):
    """Mamba2 output norm: RMSNorm(y * silu(z)) computed per group of `size // groups` channels;
    with `before_gate`, RMSNorm(y) * silu(z) (Falcon-H1's `mamba_norm_before_gate`)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype, device: torch.device,
                 before_gate: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.groups = groups
        self.eps = eps
        self.before_gate = before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y: [T, I] (float32 scan output), z: [T, I] gate -> [T, I] float32."""
        gate = F.silu(z.float())
        h = y.float() if self.before_gate else y.float() * gate
        g = h.view(h.shape[0], self.groups, -1)
        out = F.rms_norm(g, (g.shape[-1],), None, self.eps).view_as(h) * self.weight.float()
        return out * gate if self.before_gate else out


class GatedMLP(nn.Module):
    """`shared_mlp`: output_linear(silu(gate) * up), gate/up = the two halves of input_linear.
    `inner` is this rank's width (the whole width is `inner * tp.size`)."""

    reduced = False

    def __init__(self, hidden: int, inner: int, dtype: torch.dtype, device: torch.device,
                 tp: TPInfo | None = None) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        self.input_linear = Linear(hidden, 2 * inner, bias=False, dtype=dtype, device=device)
        self.output_linear = Linear(inner, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.output_linear(ops.silu_mul(*self.input_linear(x).chunk(2, dim=-1)))

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return fused_mlp_spec(self.output_linear.in_features * self.tp.size, self.tp, sub, 0)


def fused_mlp_spec(inner: int, tp: TPInfo, sub: str, lead: int) -> ShardSpec | None:
    """Fused gated weights: input_linear [.., 2*inner, hidden] (gate | up halves), output_linear
    [.., hidden, inner]; `lead` = 1 for the stacked expert weights [E, ...]."""
    part = inner // tp.size
    own = (tp.rank * part, (tp.rank + 1) * part)
    if sub == "input_linear.weight":
        return ShardSpec(lead, (own, (inner + own[0], inner + own[1])))
    if sub == "output_linear.weight":
        return ShardSpec(lead + 1, (own,))
    return None


class SplitGatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) (Bamba, Falcon-H1 `feed_forward`); Falcon-H1's
    `mlp_multipliers` scale the gate and the output (`gate_mult`, `down_mult`)."""

    reduced = False

    def __init__(self, hidden: int, inner: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 tp: TPInfo, gate_mult: float = 1.0, down_mult: float = 1.0) -> None:
        super().__init__()
        if bias and tp.size > 1:
            raise ValueError("mlp_bias is not supported with tensor parallelism")
        self.tp = tp
        self.gate_proj = Linear(hidden, inner, bias=bias, dtype=dtype, device=device)
        self.up_proj = Linear(hidden, inner, bias=bias, dtype=dtype, device=device)
        self.down_proj = Linear(inner, hidden, bias=bias, dtype=dtype, device=device)
        self.gate_mult, self.down_mult = gate_mult, down_mult

    def forward(self, x: torch.Tensor, ops: KernelOps | None = None) -> torch.Tensor:
        """`ops` (the decoder's sublayers) computes the activation; without it (an MoE's shared expert) torch
        does. Batch-invariant products under batch-invariant kernels (the deterministic mode) need a
        batch-invariant activation between them: torch's, exact. Throughput kernels promise no batch
        invariance, so products that happen to be batch invariant (int8's per-row w8a8) take `ops`' fused one."""
        gate = self.gate_proj(x)
        if self.gate_mult != 1.0:
            gate = gate * self.gate_mult
        exact = self.gate_proj.gemm.batch_invariant and (ops is None or ops.batch_invariant)
        act = silu(gate, exact) * self.up_proj(x) if ops is None or exact else ops.silu_mul(gate, self.up_proj(x))
        out = self.down_proj(act)
        return out if self.down_mult == 1.0 else out * self.down_mult

    def shard_spec(self, sub: str) -> ShardSpec | None:
        cols = ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")
        return column_spec(self.tp, sub, self.down_proj.in_features, cols, ("down_proj.weight",))


class Relu2MLP(nn.Module):
    """down_proj(relu(up_proj(x))^2) (Nemotron-H `mlp` blocks and shared experts)."""

    reduced = False

    def __init__(self, hidden: int, inner: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.up_proj = Linear(hidden, inner, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(inner, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return column_spec(self.tp, sub, self.down_proj.in_features, ("up_proj.weight",), ("down_proj.weight",))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer = Linear(hidden, experts, bias=False, dtype=dtype, device=device, quantizable=False)


class SparseMoE(nn.Module, GemmOwner):
    """`block_sparse_moe`: top-k router (softmax over the chosen logits) and stacked experts.

    input_linear.weight: [E, 2 * inner, hidden]; output_linear.weight: [E, hidden, inner] (`inner`:
    this rank's expert width; the router is replicated).
    """

    reduced = False

    def __init__(
        self, hidden: int, inner: int, experts: int, top_k: int, dtype: torch.dtype, device: torch.device,
        tp: TPInfo | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        self.router = Router(hidden, experts, dtype, device)
        self.input_linear = nn.Module()
        self.input_linear.weight = empty_param(experts, 2 * inner, hidden, dtype=dtype, device=device)
        self.output_linear = nn.Module()
        self.output_linear.weight = empty_param(experts, hidden, inner, dtype=dtype, device=device)
        self.num_experts = experts
        self.top_k = top_k
        self.gemm_in = expert_site(self.input_linear.weight)
        self.gemm_out = expert_site(self.output_linear.weight)

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        yield self.gemm_in, self.input_linear, "weight"
        yield self.gemm_out, self.output_linear, "weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # [T, k]
        top_w = top_logits.softmax(dim=-1).to(x.dtype)
        w_in = self.input_linear.weight
        w_out = self.output_linear.weight
        if self.gemm_in.gathers(x.shape[0]) and self.gemm_out.gathers(x.shape[0]):
            gate, up = self.gemm_in.apply_gathered(x, w_in, top_idx, per_choice=False).chunk(2, dim=-1)
            h = self.gemm_out.apply_gathered(F.silu(gate) * up, w_out, top_idx, per_choice=True)
            return (h.view(*top_idx.shape, -1) * top_w[..., None]).sum(1)
        out = torch.zeros_like(x)
        for expert, sel, tokens in expert_groups(top_idx, self.num_experts):
            gate, up = self.gemm_in.apply_expert(x[tokens], w_in, expert).chunk(2, dim=-1)
            h = self.gemm_out.apply_expert(F.silu(gate) * up, w_out, expert)
            h = h * top_w.flatten()[sel][:, None]
            out.index_add_(0, tokens, h)
        return out

    def shard_spec(self, sub: str) -> ShardSpec | None:
        if sub.startswith("router."):
            return None
        return fused_mlp_spec(self.output_linear.weight.shape[2] * self.tp.size, self.tp, sub, 1)
