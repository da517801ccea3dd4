"""The DeepSeek-V3-style MoE of Kimi Linear (`block_sparse_moe.gate`, `.experts`, `.shared_experts`).

Routing, per token (float32): scores = sigmoid(x @ gate.weightᵀ); the choice adds
`e_score_correction_bias`; the experts are split into `n_group` groups, each scored by the sum of its
two best choices, and only the `topk_group` best groups are eligible (Nemotron-H's rule,
worker_proc.model.moe.SigmoidMoE.route); the weights are the uncorrected scores of the top-k, divided
by their sum + 1e-20 with `norm_topk_prob`, times `routed_scaling`. The experts are gated SiLU MLPs
stored and split as `SharedGateMoE`'s (worker_proc.model.qwen_moe; per-expert w1 / w3 / w2 tensors
renamed by the family, stacked by the loader); the shared expert (a gated SiLU MLP of
`MoeConfig.shared_size`) is added without a gate. The router is replicated under tensor parallelism.
"""

from __future__ import annotations

import torch

from shared.model_config import HybridConfig
from worker_proc.linear.site import GemmSite
from worker_proc.model.layers import empty_param
from worker_proc.model.moe import SigmoidMoE
from worker_proc.model.qwen_moe import SharedGateMoE
from worker_proc.model.shard import TPInfo


class GroupedSwigluMoE(SharedGateMoE):
    def __init__(self, cfg: HybridConfig, inner: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        e, g = cfg.moe.num_experts, cfg.moe.n_group
        if e % g or e // g < 2 and g > 1:
            raise ValueError(f"n_group {g} must divide num_experts {e} into groups of at least 2")
        super().__init__(cfg, inner, dtype, device, tp)
        del self.shared_expert_gate
        self.shared_expert_gate = None
        self.gate.weight = empty_param(e, cfg.hidden_size, dtype=torch.float32, device=device)
        self.gate.e_score_correction_bias = empty_param(e, dtype=torch.float32, device=device)
        self.gate_gemm = GemmSite(e, cfg.hidden_size, torch.float32, packable=False, quantizable=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        idx, weights = SigmoidMoE.route(self, x)  # type: ignore[arg-type]
        return idx, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_expert is None else out + self.shared_expert(x)
