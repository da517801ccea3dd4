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

from worker_proc.model.shard import ShardSpec, TPInfo, column_spec

MIN_GEMM_ROWS = 16
"""Row count below which CPU BLAS switches to kernels whose rounding depends on the row count;
padding small inputs up to it makes every row's result independent of what it is batched with."""

SPLIT_GEMM_MAX_ROWS = 4
"""Up to this many rows a dense float32 CPU product goes through `split_gemm`. Measured (350M shapes,
weights streamed from memory, 1 thread): 2x faster than F.linear at one row, 1.5-3x at 2-4 rows; at
8 rows and more F.linear is as fast or faster."""


def split_gemm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T with the weight's output rows cut into `parts` equal blocks, one
    batch entry of a bmm each. MKL's one-row product streams the weight at about half the memory
    bandwidth the bmm reaches, and the CPU bmm runs its batch entries on separate threads. The weight
    is only viewed, never copied."""
    rows = x.shape[0]
    blocks = weight.view(parts, weight.shape[0] // parts, weight.shape[1])
    out = torch.bmm(blocks, x.t().unsqueeze(0).expand(parts, -1, -1))  # [parts, out/parts, M]
    return out.permute(2, 0, 1).reshape(rows, weight.shape[0]).contiguous()


def gemm_parts(out_features: int) -> int:
    """How many blocks `split_gemm` cuts a weight into: one per torch thread and at least two (also
    faster on one thread), fewer when the rows do not divide evenly (1: the weight as one block)."""
    parts = max(2, torch.get_num_threads())
    while out_features % parts:
        parts -= 1
    return parts


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 0,
    split_rows: int = SPLIT_GEMM_MAX_ROWS,
) -> torch.Tensor:
    """F.linear over [T, in]. With `min_rows` (the deterministic mode passes MIN_GEMM_ROWS) a CPU input
    of fewer rows is zero-padded up to it, so each row's result does not depend on T (batch
    invariance; measured with MKL on x86: every row count >= MIN_GEMM_ROWS gives identical rows).
    Padding is the price of that rule: a one-row GEMV becomes a 16-row GEMM. Without it, a float32
    CPU input of at most `split_rows` rows goes through `split_gemm` (16-bit dtypes are faster in
    F.linear: oneDNN handles them at every row count; weights that stay in the CPU's cache between
    steps pass 0, see `Linear.split_rows`)."""
    rows = x.shape[0]
    if x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if rows < min_rows:
        padded = torch.cat([x, x.new_zeros(min_rows - rows, x.shape[1])])
        return F.linear(padded, weight, bias)[:rows]
    if (min_rows or rows > split_rows or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    out = split_gemm(x, weight, gemm_parts(weight.shape[0]))
    return out if bias is None else out + bias


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


PACK_ROWS = 8
"""The row count oneDNN lays a packed weight out for. Measured on the 350M shape (1 and 2 threads):
a weight packed for 8 rows multiplies faster than F.linear at every row count from 1 to 1024
(1.1x at 1024 rows, 2-3x at 2-32), float32 and bfloat16."""

PACKED_DTYPES = (torch.float32, torch.bfloat16)


PACK_MIN_FLOAT32_ELEMENTS = 1 << 20
"""A float32 weight smaller than this stays dense: a oneDNN call costs ~15 us of fixed overhead,
more than a small MKL product takes (measured: 4 us for 256x128 at one row; 1536x768 is already faster
packed). bfloat16 weights are faster packed at every size measured (128x256 and up)."""


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN weight packing applies: a CPU build with oneDNN and a dtype it packs."""
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


def worth_packing(weight: torch.Tensor) -> bool:
    """Packing applies to this weight and pays (see PACK_MIN_FLOAT32_ELEMENTS)."""
    if not packing_supported(weight.dtype, weight.device):
        return False
    return weight.dtype != torch.float32 or weight.numel() >= PACK_MIN_FLOAT32_ELEMENTS


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed through `linear`; `min_rows` is set by the model
    (`HybridForCausalLM.set_batch_invariant`). After `pack()` the weight lives in oneDNN's packed
    layout (`packed`; `weight` is then empty unless a dense copy was kept for one-row products) and
    every other product runs through oneDNN."""

    min_rows = 0
    split_rows = SPLIT_GEMM_MAX_ROWS
    """`linear`'s split rule. `split_gemm` pays where the weight streams from memory on each step; a model
    whose weights all stay in the CPU's cache sets 0 (`HybridForCausalLM.set_split_rows`): measured on
    the built-in model's shapes, F.linear takes 4-7 us per one-row product and `split_gemm` 11-15 us."""
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T without the bias (a row-parallel rank's partial sum)."""
        return self._product(x, None)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None:
            return linear(x, self.weight, bias, self.min_rows, self.split_rows)
        if self.weight.numel() and x.dim() == 2 and x.shape[0] == 1:  # a kept dense copy: one row is faster split
            return linear(x, self.weight, bias, split_rows=self.split_rows)
        return packed_product(x, self.packed, bias)

    def pack(self, keep_dense: bool = False) -> None:
        """Move the weight into oneDNN's packed layout, freeing the dense copy unless `keep_dense`
        (float32 only: one-row products then run as `split_gemm` over it, ~30% faster than the packed
        product; every other row count uses the packed one). Only for the throughput mode: packed
        products are not batch invariant (see `linear`)."""
        if self.min_rows:
            raise RuntimeError("packed weights are not batch invariant; the deterministic mode keeps them dense")
        if not packing_supported(self.weight.dtype, self.weight.device):
            raise RuntimeError(f"oneDNN cannot pack a {self.weight.dtype} weight on {self.weight.device}")
        self.packed = pack_weight(self.weight)
        if not (keep_dense and self.weight.dtype == torch.float32):
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight in oneDNN's packed layout (an opaque tensor only `packed_product` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a weight from `pack_weight`; x: [..., in]."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """weight * x / rms(x), the normalisation computed in float32 and cast back before the weight;
    with `fp32_weight` (Nemotron-H) the weight is applied in float32 and the product cast back."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps
        self.fp32_weight = fp32_weight

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

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(size: int, eps: float, dtype: torch.dtype, device: torch.device, unit_offset: bool = False,
              fp32_weight: bool = False) -> nn.Module:
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
        self.weight = _empty(size, dtype=dtype, device=device)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)

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
        self.min_rows = 0  # MIN_GEMM_ROWS in the deterministic mode: the SiLU is then exact (see `silu`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_mult != 1.0:
            gate = gate * self.gate_mult
        out = self.down_proj(silu(gate, bool(self.min_rows)) * self.up_proj(x))
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
        self.layer = Linear(hidden, experts, bias=False, dtype=dtype, device=device)


class SparseMoE(nn.Module):
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
        for expert, sel, tokens in expert_groups(top_idx, self.num_experts):
            gate, up = linear(x[tokens], w_in[expert], min_rows=self.min_rows).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, w_out[expert], min_rows=self.min_rows)
            h = h * top_w.flatten()[sel][:, None]
            out.index_add_(0, tokens, h)
        return out

    def shard_spec(self, sub: str) -> ShardSpec | None:
        if sub.startswith("router."):
            return None
        return fused_mlp_spec(self.output_linear.weight.shape[2] * self.tp.size, self.tp, sub, 1)
