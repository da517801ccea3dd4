"""`ModelRunner`: the worker rank's model + state pools + sampler behind one `step()` call.

Owned by the worker runtime; the worker process (worker_proc/process.py, the lead's) owns the
sockets and calls `step` once per `ForwardBatch`. The runner keeps no per-request state: the
scheduler owns every slot number, the runner only holds the tensors (weights, KV pool, Mamba
state pools). Within one step the order is fixed: copies (minus refused requests' copies), then
clears, then one forward over every non-refused slice, then sampling. Under tensor parallelism
every rank runs the same step on its shard (weights and pools, see worker_proc.model.tp); only
rank 0 computes logits and samples, the other ranks' StepResult carries no tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from shared.messages import ForwardBatch, ReqSlice, SamplingParams, StepResult
from shared.model_info import ModelInfo
from worker_proc.kernels import get_ops
from worker_proc.loader import load_model
from worker_proc.model import StepBatch, build_step_batch
from worker_proc.pools import StatePools, plan_capacities
from worker_proc.sampling import SampleRequest, greedy_params, sample

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET_BYTES = 256 * 2**20
CUDA_FREE_FRACTION = 0.85


class ModelRunner:
    """One rank's model runtime. Attributes read by the worker process: `kv_capacity`,
    `mamba_capacity` (usable slots, padding slot 0 excluded), `model_info`, `device`, `dtype`."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        kv_slots: int = 0,
        mamba_slots: int = 0,
        mem_budget_bytes: int = 0,
        mamba_ratio: float = 0.5,
        seed: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: object = None,
    ) -> None:
        self.model_info = ModelInfo.from_dir(model_dir)
        self.device = torch.device(device)
        self.model = load_model(
            model_dir, device=self.device, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group
        )
        self.cfg = self.model.cfg
        self.dtype = self.model.dtype
        self.seed = seed
        self.tp_rank = tp_rank
        kv, mamba = kv_slots, mamba_slots
        if kv <= 0 or mamba <= 0:
            budget = mem_budget_bytes or self._default_budget()
            planned_kv, planned_mamba = plan_capacities(self.cfg, budget, mamba_ratio, self.dtype, tp_size, tp_rank)
            kv = kv if kv > 0 else planned_kv
            mamba = mamba if mamba > 0 else planned_mamba
        self.pools = StatePools(self.cfg, kv, mamba, self.dtype, self.device, tp_size, tp_rank)
        self.kv_capacity = kv
        self.mamba_capacity = mamba
        self.ops = get_ops(self.device)

    def _default_budget(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * CUDA_FREE_FRACTION)
        return DEFAULT_CPU_BUDGET_BYTES

    # ------------------------------------------------------------------ the step
    def step(self, batch: ForwardBatch, refused: frozenset[str] = frozenset()) -> StepResult:
        """Apply state ops, run one forward over the non-refused slices, sample. See module doc."""
        t0 = time.perf_counter()
        self.apply_state_ops(batch, refused)
        reqs = [r for r in batch.reqs if r.rid not in refused]
        next_tokens: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        if reqs:
            sb = self._build(reqs, all_rows=False)
            sampler = self.tp_rank == 0  # rank 0 samples and replies; the others only advance state
            logits = self.model.forward_step(sb, self.pools, self.ops, want_logits=sampler)
            if sb.logit_rids and sampler:
                next_tokens, logprobs = self._sample(logits, sb, {r.rid: r for r in reqs})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(
            step=batch.step,
            next_tokens=next_tokens,
            logprobs=logprobs,
            refused=sorted(refused),
            elapsed_s=time.perf_counter() - t0,
        )

    def apply_state_ops(self, batch: ForwardBatch, refused: frozenset[str] = frozenset()) -> None:
        """Copies first (skipping refused requests' copy-on-write), then clears; in message order."""
        for op in batch.copies:
            if op.rid is not None and op.rid in refused:
                continue
            self.pools.copy_state(op.src, op.dst)
        for slot in batch.clears:
            self.pools.clear_state(slot)

    def _build(self, reqs: list[ReqSlice], all_rows: bool) -> StepBatch:
        return build_step_batch(
            reqs, self.device, self.kv_capacity, self.mamba_capacity, bool(self.cfg.mamba_layer_ids), all_rows,
            uses_attention=bool(self.cfg.attn_layer_ids),
        )

    def _sample(
        self, logits: torch.Tensor, sb: StepBatch, by_rid: dict[str, ReqSlice]
    ) -> tuple[dict[str, int], dict[str, float]]:
        sreqs = []
        for rid in sb.logit_rids:
            r = by_rid[rid]
            sreqs.append(SampleRequest(rid, r.sampling or greedy_params(), r.output_len))
        want = any(s.params.logprobs for s in sreqs)
        tokens, lps = sample(logits, sreqs, self.seed, want_logprobs=want)
        next_tokens = dict(zip(sb.logit_rids, tokens, strict=True))
        logprobs: dict[str, float] = {}
        if lps is not None:
            logprobs = {s.rid: lp for s, lp in zip(sreqs, lps, strict=True) if s.params.logprobs}
        return next_tokens, logprobs

    # ------------------------------------------------------------------ test helpers
    def forward_logits(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Apply the batch's state ops, run it, and return the last-position float32 logits [V] of
        every slice with sample=True (no sampling). Advances state exactly like `step`."""
        self.apply_state_ops(batch)
        if not batch.reqs:
            return {}
        sb = self._build(list(batch.reqs), all_rows=False)
        logits = self.model.forward_step(sb, self.pools, self.ops)
        return {rid: logits[i] for i, rid in enumerate(sb.logit_rids)}

    def forward_all_logits(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Like `forward_logits` but returns logits of every input position: rid -> [L, V]."""
        self.apply_state_ops(batch)
        sb = self._build(list(batch.reqs), all_rows=True)
        logits = self.model.forward_step(sb, self.pools, self.ops)
        out: dict[str, list[torch.Tensor]] = {}
        for i, rid in enumerate(sb.logit_rids):
            out.setdefault(rid, []).append(logits[i])
        return {rid: torch.stack(rows) for rid, rows in out.items()}

    def check_integrity(self) -> None:
        self.pools.check_integrity()


def generate_greedy(
    runner: ModelRunner, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> list[int]:
    """Reference generation of one prompt alone: KV slots 1..n for positions 0..n-1, Mamba slot 1,
    whole-prompt prefill then one token per step, greedy; stops after an EOS token (included)."""
    if max_new_tokens <= 0:
        return []
    if len(prompt) + max_new_tokens > runner.kv_capacity + 1:
        raise ValueError(f"prompt {len(prompt)} + {max_new_tokens} new tokens exceed {runner.kv_capacity} KV slots")
    greedy = SamplingParams(temperature=0.0)
    out: list[int] = []
    ids, start = list(prompt), 0
    for step in range(max_new_tokens):
        end = start + len(ids)
        req = ReqSlice(rid="ref", input_ids=ids, start_pos=start, kv_slots=list(range(1, end + 1)),
                       mamba_slot=1, sample=True, sampling=greedy, output_len=len(out))
        res = runner.step(ForwardBatch(step=step, reqs=[req], clears=[1] if start == 0 else []))
        tok = res.next_tokens["ref"]
        out.append(tok)
        if tok in eos_ids:
            break
        ids, start = [tok], end
    return out
