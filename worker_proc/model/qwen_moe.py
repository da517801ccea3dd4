"""The sparse MoE of Qwen3-Next / Qwen3.5-MoE (`mlp.gate`, `mlp.experts`, `mlp.shared_expert`,
`mlp.shared_expert_gate`).

Routing, per token: p = softmax(x @ gate.weightᵀ) over all experts in float32; the top-k experts
are taken with weights p (renormalised to sum 1 with `norm_topk_prob`), cast to the model dtype.
Experts are split gated SiLU MLPs (per-expert checkpoint tensors `experts.<j>.gate_proj|up_proj|
down_proj.weight`, stacked by the loader into [E, I, H] / [E, H, I]). The shared expert (a split
gated MLP) is scaled per token by sigmoid(shared_expert_gate(x)) and added. Tensor parallelism:
expert and shared-expert widths are split, the router and the shared gate replicated; the output is
this rank's partial sum (the per-token gate is the same on every rank, so it commutes with the
all-reduce the decoder does).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.model.layers import Linear, SplitGatedMLP, empty_param, expert_groups, expert_site, silu
from worker_proc.model.shard import ShardSpec, TPInfo, column_spec


class Experts(nn.Module):
    def __init__(self, experts: int, inner: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = empty_param(experts, inner, hidden, dtype=dtype, device=device)
        self.up_proj = empty_param(experts, inner, hidden, dtype=dtype, device=device)
        self.down_proj = empty_param(experts, hidden, inner, dtype=dtype, device=device)


class SharedGateMoE(nn.Module, GemmOwner):
    reduced = False

    def __init__(self, cfg: HybridConfig, inner: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        hidden = cfg.hidden_size
        self.gate = nn.Module()
        self.gate.weight = empty_param(cfg.moe.num_experts, hidden, dtype=dtype, device=device)
        self.experts = Experts(cfg.moe.num_experts, inner // tp.size, hidden, dtype, device)
        self.shared_expert: SplitGatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.moe.shared_size:
            self.shared_expert = SplitGatedMLP(hidden, cfg.moe.shared_size // tp.size, False, dtype, device, tp)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, device=device, quantizable=False)
        self.gate_gemm = GemmSite(cfg.moe.num_experts, hidden, dtype, packable=False, quantizable=False)
        self.gate_proj_gemm = expert_site(self.experts.gate_proj)
        self.up_proj_gemm = expert_site(self.experts.up_proj)
        self.down_gemm = expert_site(self.experts.down_proj)

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        yield self.gate_gemm, self.gate, "weight"
        yield self.gate_proj_gemm, self.experts, "gate_proj"
        yield self.up_proj_gemm, self.experts, "up_proj"
        yield self.down_gemm, self.experts, "down_proj"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        logits = self.gate_gemm.apply(x, self.gate.weight)
        probs = logits.float().softmax(dim=-1)
        top, idx = probs.topk(self.cfg.moe.experts_per_tok, dim=-1)
        if self.cfg.moe.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx, top.to(x.dtype)

    def _shared_gate_logit(self, x: torch.Tensor) -> torch.Tensor:
        """x @ shared_expert_gate.weightᵀ [T, 1]. In the deterministic mode a row-wise dot product: a
        one-column GEMM's rounding depends on the row count on CPU, which padding the rows does not
        fix. The sigmoid after it is taken in float64 (float32 SIMD and scalar tails differ)."""
        assert self.shared_expert_gate is not None
        gate = self.shared_expert_gate
        if not self.gate_gemm.batch_invariant:
            return gate(x)
        out = (x * gate.weight[0]).sum(-1, keepdim=True)
        return out if gate.lora is None else gate.lora.add(x, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        e = self.experts
        if all(g.gathers(x.shape[0]) for g in (self.gate_proj_gemm, self.up_proj_gemm, self.down_gemm)):
            h = silu(self.gate_proj_gemm.apply_gathered(x, e.gate_proj, idx, per_choice=False))
            h = h * self.up_proj_gemm.apply_gathered(x, e.up_proj, idx, per_choice=False)
            h = self.down_gemm.apply_gathered(h, e.down_proj, idx, per_choice=True)
            out = (h.view(*idx.shape, -1) * weights[..., None]).sum(1)
        else:
            out = self._grouped(x, idx, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self._shared_gate_logit(x).double()).to(x.dtype)
            out = out + gate * self.shared_expert(x)
        return out

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum, one product per chosen expert over the tokens that chose it."""
        out = torch.zeros_like(x)
        e = self.experts
        for expert, sel, tokens in expert_groups(idx, self.cfg.moe.num_experts):
            xs = x[tokens]
            gemm = self.gate_proj_gemm
            h = silu(gemm.apply_expert(xs, e.gate_proj, expert), gemm.batch_invariant)
            h = self.down_gemm.apply_expert(h * self.up_proj_gemm.apply_expert(xs, e.up_proj, expert), e.down_proj,
                                            expert)
            out.index_add_(0, tokens, h * weights.flatten()[sel][:, None])
        return out

    def shard_spec(self, sub: str) -> ShardSpec | None:
        if sub.startswith("shared_expert.") and self.shared_expert is not None:
            return self.shared_expert.shard_spec(sub.removeprefix("shared_expert."))
        inner = self.experts.down_proj.shape[2]
        return column_spec(self.tp, sub, inner, ("experts.gate_proj", "experts.up_proj"), ("experts.down_proj",),
                           lead=1)
