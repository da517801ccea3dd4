"""Drive a `ModelRunner` directly, without a scheduler: logits of a batch and greedy reference
generation. For tests and benchmarks only; the worker process uses `ModelRunner.step` alone.

Each call advances the runner's state and KV slot mirror exactly as `step` does for the same
batch (state ops, then one forward over every slice); a failure leaves the mirror empty.
"""

from __future__ import annotations

import torch

from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.model import StepBatch
from worker_proc.runtime import ModelRunner


def _run_logits(runner: ModelRunner, batch: ForwardBatch, all_rows: bool) -> tuple[StepBatch, torch.Tensor]:
    """Like `runner.step` without refusals or sampling: the float32 logits of every logit row."""
    try:
        sb = runner.build_batch(list(batch.reqs), batch.step, all_rows)
        runner.apply_state_ops(batch)
        logits = runner.model.forward_step(sb, runner.pools, runner.ops) if batch.reqs else torch.zeros(0)
    except BaseException:
        runner.kv_mirror.clear()
        raise
    runner.kv_mirror.commit(batch.step, [r.rid for r in batch.reqs], sb.kv_full)
    return sb, logits


def forward_logits(runner: ModelRunner, batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """The last-position logits [V] of every slice with sample=True."""
    sb, logits = _run_logits(runner, batch, all_rows=False)
    return {rid: logits[i] for i, rid in enumerate(sb.logit_rids)}


def forward_all_logits(runner: ModelRunner, batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """The logits of every input position of every slice with sample=True: rid -> [L, V]."""
    sb, logits = _run_logits(runner, batch, all_rows=True)
    out: dict[str, list[torch.Tensor]] = {}
    for i, rid in enumerate(sb.logit_rids):
        out.setdefault(rid, []).append(logits[i])
    return {rid: torch.stack(rows) for rid, rows in out.items()}


def generate_greedy(
    runner: ModelRunner, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> list[int]:
    """Reference generation of one prompt alone through `runner.step`: KV slots 1..n for positions
    0..n-1, state slot 1, whole-prompt prefill then one token per step, greedy; stops after an EOS
    token (included)."""
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
                       state_slot=1, sample=True, sampling=greedy, output_len=len(out))
        res = runner.step(ForwardBatch(step=step, reqs=[req], clears=[1] if start == 0 else []))
        tok = res.next_tokens["ref"]
        out.append(tok)
        if tok in eos_ids:
            break
        ids, start = [tok], end
    return out
