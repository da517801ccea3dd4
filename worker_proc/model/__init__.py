"""GraniteMoeHybrid-compatible hybrid Mamba2 + attention model (owned by the worker runtime)."""

from __future__ import annotations

from worker_proc.model.batch import StepBatch, build_step_batch
from worker_proc.model.config import HybridConfig
from worker_proc.model.hybrid import HybridForCausalLM, TPInfo

__all__ = ["HybridConfig", "HybridForCausalLM", "StepBatch", "TPInfo", "build_step_batch"]
