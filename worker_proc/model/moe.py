"""The sigmoid-routed MoE of Nemotron-H / Nemotron-3-Nano (`mixer.gate`, `mixer.experts`,
`mixer.shared_experts`, optional `fc1_latent_proj`/`fc2_latent_proj`).

Routing, per token (float32): scores = sigmoid(x @ gate.weightᵀ);
the choice adds `e_score_correction_bias`; experts are split into `n_group` groups, each group scored
by the sum of its two best choices, only the `topk_group` best groups are eligible; the top-k
eligible experts are taken, their weights are the *uncorrected* scores (normalised to sum 1 with
`norm_topk_prob`) times `routed_scaling_factor`. Experts are relu2 MLPs (up_proj [E, I, L],
down_proj [E, L, I]) over the latent x (fc1_latent_proj, when present, L = moe_latent_size, else
hidden); their weighted sum goes through fc2_latent_proj, and the shared expert (relu2 MLP over x)
is added. Tensor parallelism: expert and shared-expert widths are split, gate and latent
projections replicated; the output is this rank's partial sum (fc2 is linear, so it commutes with
the all-reduce the decoder does).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.model.layers import Linear, Relu2MLP, empty_param, expert_groups, expert_site
from worker_proc.model.shard import ShardSpec, TPInfo, column_spec


class Gate(nn.Module):
    def __init__(self, hidden: int, experts: int, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(experts, hidden, dtype=torch.float32, device=device)
        self.e_score_correction_bias = empty_param(experts, dtype=torch.float32, device=device)


class Experts(nn.Module):
    def __init__(self, experts: int, inner: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.up_proj = empty_param(experts, inner, width, dtype=dtype, device=device)
        self.down_proj = empty_param(experts, width, inner, dtype=dtype, device=device)


class SigmoidMoE(nn.Module, GemmOwner):
    reduced = False

    def __init__(self, cfg: HybridConfig, inner: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        e, g = cfg.moe.num_experts, cfg.moe.n_group
        if e % g or e // g < 2 and g > 1:
            raise ValueError(f"n_group {g} must divide n_routed_experts {e} into groups of at least 2")
        self.tp = tp
        self.cfg = cfg
        width = cfg.moe.latent_size or cfg.hidden_size
        self.gate = Gate(cfg.hidden_size, e, device)
        self.experts = Experts(e, inner // tp.size, width, dtype, device)
        shared = cfg.moe.shared_size // tp.size
        self.shared_experts = Relu2MLP(cfg.hidden_size, shared, dtype, device, tp) if shared else None
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.moe.latent_size:
            self.fc1_latent_proj = Linear(cfg.hidden_size, width, bias=False, dtype=dtype, device=device)
            self.fc2_latent_proj = Linear(width, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        self.gate_gemm = GemmSite(e, cfg.hidden_size, torch.float32, packable=False, quantizable=False)
        self.up_gemm = expert_site(self.experts.up_proj)
        self.down_gemm = expert_site(self.experts.down_proj)

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        yield self.gate_gemm, self.gate, "weight"
        yield self.up_gemm, self.experts, "up_proj"
        yield self.down_gemm, self.experts, "down_proj"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] float32)."""
        cfg = self.cfg
        e, g = cfg.moe.num_experts, cfg.moe.n_group
        # the sigmoid is taken in float64 and rounded: float32 SIMD and scalar tails differ in the last
        # bit, which would make a token's routing weights depend on the batch's size
        logits = self.gate_gemm.apply(x.float(), self.gate.weight.float())
        scores = logits.double().sigmoid().float()
        choice = scores + self.gate.e_score_correction_bias.float()
        if g > 1:
            grouped = choice.view(-1, g, e // g)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.moe.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
        idx = choice.topk(cfg.moe.experts_per_tok, dim=-1).indices
        weights = scores.gather(1, idx)
        if cfg.moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.moe.routed_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        latent = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        if self.up_gemm.gathers(x.shape[0]) and self.down_gemm.gathers(x.shape[0]):
            h = torch.relu(self.up_gemm.apply_gathered(latent, self.experts.up_proj, idx, per_choice=False)).square()
            h = self.down_gemm.apply_gathered(h, self.experts.down_proj, idx, per_choice=True)
            out = (h.view(*idx.shape, -1) * weights[..., None]).sum(1).to(x.dtype)
        else:
            acc = torch.zeros(latent.shape, dtype=torch.float32, device=x.device)
            for expert, sel, tokens in expert_groups(idx, self.cfg.moe.num_experts):
                h = torch.relu(self.up_gemm.apply_expert(latent[tokens], self.experts.up_proj, expert)).square()
                h = self.down_gemm.apply_expert(h, self.experts.down_proj, expert)
                acc.index_add_(0, tokens, h * weights.flatten()[sel][:, None])
            out = acc.to(x.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        if sub.startswith("shared_experts.") and self.shared_experts is not None:
            return self.shared_experts.shard_spec(sub.removeprefix("shared_experts."))
        inner = self.experts.up_proj.shape[1]
        return column_spec(self.tp, sub, inner, ("experts.up_proj",), ("experts.down_proj",), lead=1)
