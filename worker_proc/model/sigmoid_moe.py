"""The sigmoid-routed MoE with gated SiLU experts of LFM2-MoE (`feed_forward.gate`,
`feed_forward.experts`, `feed_forward.expert_bias`).

Routing, per token: scores = sigmoid(x @ gate.weightᵀ) (the sigmoid in float64, rounded to float32:
its float32 SIMD and scalar tails differ in the last bit, which would make a token's weights depend on
the batch's size); the top-k experts are chosen on scores + `expert_bias` (`MoeConfig.choice_bias`,
else on the scores), their weights are the *unbiased* scores, divided by their sum + 1e-6 with
`norm_topk_prob`, times `routed_scaling`. The experts, their checkpoint layout (per-expert tensors
stacked by the loader) and their tensor-parallel split are `SharedGateMoE`'s (worker_proc.model.qwen_moe),
without a shared expert; the router and the bias are replicated.
"""

from __future__ import annotations

import torch

from shared.model_config import HybridConfig
from worker_proc.model.layers import empty_param
from worker_proc.model.qwen_moe import SharedGateMoE
from worker_proc.model.shard import TPInfo

NORM_EPS = 1e-6  # added to the chosen weights' sum before normalising (transformers' Lfm2MoeTopKRouter)


class SigmoidSwigluMoE(SharedGateMoE):
    def __init__(self, cfg: HybridConfig, inner: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        if cfg.moe.shared_size:
            raise ValueError("a sigmoid-routed MoE with gated SiLU experts has no shared expert")
        super().__init__(cfg, inner, dtype, device, tp)
        self.expert_bias = (empty_param(cfg.moe.num_experts, dtype=torch.float32, device=device)
                            if cfg.moe.choice_bias else None)  # fmt: skip

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        moe = self.cfg.moe
        scores = self.gate_gemm.apply(x, self.gate.weight).double().sigmoid().float()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        idx = choice.topk(moe.experts_per_tok, dim=-1).indices
        weights = scores.gather(1, idx)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
        return idx, (weights * moe.routed_scaling).to(x.dtype)
