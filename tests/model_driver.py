"""Drive a `ModelRunner` directly, without a scheduler: logits of a batch and greedy reference
generation. For tests and benchmarks only; the worker process uses `ModelRunner.step` alone.

Each call advances the runner's state and KV slot mirror exactly as `step` does for the same
batch (state ops, then one forward over every slice); a failure leaves the mirror empty.
"""

from __future__ import annotations

import torch

from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.model import StepBatch
from worker_proc.runtime.runner import ModelRunner


def _run_logits(runner: ModelRunner, batch: ForwardBatch, all_rows: bool) -> tuple[StepBatch, torch.Tensor]:
    """Like `runner.step` without refusals or sampling: the float32 logits of every logit row."""
    try:
        staged = runner.stage_adapters(batch)
        sb = runner.build_batch(list(batch.reqs), batch.step, all_rows, staged=staged)
        runner.apply_state_ops(batch, staged=staged)
        logits = runner.forward(sb) if batch.reqs else torch.zeros(0)
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


def generate_speculative(
    runner: ModelRunner, prompt: list[int], max_new_tokens: int, propose, sampling: SamplingParams | None = None,
    logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None,
) -> tuple[list[int], list[int]]:
    """Like `generate_greedy` (state slot 1, KV slot p + 1 for position p), but every decode step
    verifies `propose(tokens_so_far)` drafted tokens (backup state slot 2), as the scheduler sends
    them (with the request's tokens so far when its sampling needs them). Returns (output tokens,
    accepted count of each verify step); stops at max_new_tokens or when the grammar is complete.
    `logprobs` (when given) receives (logprob, top logprobs) of every output token, None where not asked."""
    params = sampling or SamplingParams(temperature=0.0)
    out: list[int] = []
    accepted: list[int] = []
    ids, start, step = list(prompt), 0, 0
    while len(out) < max_new_tokens:
        drafts = list(propose(prompt + out))[: max(0, max_new_tokens - len(out) - 1)] if out else []
        end = start + len(ids) + len(drafts)
        req = ReqSlice(rid="spec", input_ids=ids + drafts, start_pos=start, kv_slots=list(range(1, end + 1)),
                       state_slot=1, sample=True, sampling=params, output_len=len(out),
                       drafts=len(drafts), backup_slot=2 if drafts else 0,
                       history=prompt + out if params.needs_history else None)
        res = runner.step(ForwardBatch(step=step, reqs=[req], clears=[1] if start == 0 else []))
        n_ok = res.accepted.get("spec", 0)
        if drafts:
            accepted.append(n_ok)
        out.extend(drafts[:n_ok] + [res.next_tokens["spec"]])
        if logprobs is not None:
            lps = res.logprobs.get("spec") or [None] * (n_ok + 1)
            tops = res.top_logprobs.get("spec") or [None] * (n_ok + 1)
            assert len(lps) == len(tops) == n_ok + 1, (lps, tops, n_ok)
            logprobs.extend(zip(lps, tops, strict=True))
        assert "spec" not in res.grammar_errors, res.grammar_errors
        if "spec" in res.grammar_done:
            break
        start += len(ids) + n_ok
        ids, step = [out[-1]], step + 1
    return out[:max_new_tokens], accepted
