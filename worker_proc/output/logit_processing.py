"""Per-request logit processing before sampling (rank 0): penalties, logit_bias, min_tokens.

Rules (OpenAI / vLLM semantics), applied in this order to float32 logits [B, V], batched (the only
Python loops are over requests and over their listed token ids, never over the vocabulary):
- repetition_penalty p (tokens that occur in prompt or output): a positive logit is divided by p, a
  negative one multiplied by p;
- frequency_penalty f and presence_penalty q (tokens of the output only): logit -= f * count + q * [count > 0];
- logit_bias: logit[token] += bias;
- min_tokens m: while output_len < m, the stop tokens (the model's EOS ids unless ignore_eos, and
  stop_token_ids) are -inf;
- thinking_budget b: once b.tokens output tokens were made inside the reasoning and it has not ended,
  every token but the next one of b.end is -inf (the end tokens already made count as its start, so a
  model that began closing it itself is finished off, not restarted).
Logprobs are still reported under the raw distribution (sampling.py); these only change the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.messages import SamplingParams, ThinkingBudget


@dataclass(frozen=True)
class SampleRequest:
    """What rank 0 knows of one request when it picks its next token."""

    rid: str
    params: SamplingParams
    output_len: int
    history: list[int] | None = None  # prompt + output tokens so far (only with params.needs_history)


def _counts(rows: list[int], reqs: Sequence[SampleRequest], vocab: int, device: torch.device,
            output_only: bool) -> torch.Tensor:
    """[len(rows), V] float32 token counts of each row's history (or of its output part only)."""
    seqs = []
    for i in rows:
        r = reqs[i]
        hist = list(r.history or [])
        if output_only:
            hist = hist[len(hist) - r.output_len:] if r.output_len else []
        seqs.append(hist)
    width = max((len(h) for h in seqs), default=0)
    if width == 0:
        return torch.zeros(len(rows), vocab, device=device)
    ids = torch.full((len(rows), width), vocab, dtype=torch.int64)
    for j, h in enumerate(seqs):
        if h:
            ids[j, : len(h)] = torch.tensor(h, dtype=torch.int64).clamp_(0, vocab)
    ids = ids.to(device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _penalties(x: torch.Tensor, reqs: Sequence[SampleRequest]) -> None:
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    vocab, dev = x.shape[-1], x.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    sub = x[idx]
    rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows], dtype=torch.float32, device=dev)
    if bool((rep != 1.0).any()):
        seen = _counts(rows, reqs, vocab, dev, output_only=False) > 0
        scaled = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
        sub = torch.where(seen, scaled, sub)
    freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows], dtype=torch.float32, device=dev)
    pres = torch.tensor([reqs[i].params.presence_penalty for i in rows], dtype=torch.float32, device=dev)
    if bool((freq != 0).any() or (pres != 0).any()):
        out = _counts(rows, reqs, vocab, dev, output_only=True)
        sub = sub - freq[:, None] * out - pres[:, None] * (out > 0).float()
    x[idx] = sub


def _sparse_add(x: torch.Tensor, rows: list[int], cols: list[int], vals: list[float]) -> None:
    if rows:
        dev = x.device
        index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        x.index_put_(index, torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)


def _find(seq: list[int], sub: tuple[int, ...], start: int = 0) -> int | None:
    """The index just after the first occurrence of `sub` in seq[start:], or None."""
    n = len(sub)
    for i in range(start, len(seq) - n + 1):
        if tuple(seq[i: i + n]) == sub:
            return i + n
    return None


def thinking_end_token(budget: ThinkingBudget, output: list[int]) -> int | None:
    """The token the budget forces after `output` (the request's output tokens so far), None when free."""
    begin = 0 if budget.inside else _find(output, budget.start)
    if begin is None or not budget.end or _find(output, budget.end, begin) is not None:
        return None
    made = next((k for k in range(len(budget.end) - 1, 0, -1)
                 if len(output) - k >= begin and tuple(output[len(output) - k:]) == budget.end[:k]), 0)  # fmt: skip
    return budget.end[made] if len(output) - begin - made >= budget.tokens else None


def _thinking_forced(reqs: Sequence[SampleRequest]) -> list[tuple[int, int]]:
    """(row, token) for every request whose thinking budget forces its next token."""
    forced = []
    for i, r in enumerate(reqs):
        b = r.params.thinking_budget
        if b is not None:
            hist = r.history or []
            tok = thinking_end_token(b, hist[len(hist) - r.output_len:] if r.output_len else [])
            if tok is not None:
                forced.append((i, tok))
    return forced


def process_logits(logits: torch.Tensor, reqs: Sequence[SampleRequest], eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """The logits sampling chooses from: `logits` itself when no request processes them, else a
    processed copy (module doc). Token ids outside the vocabulary are ignored."""
    if not any(r.params.processes_logits for r in reqs):
        return logits
    x = logits.clone()
    vocab = x.shape[-1]
    _penalties(x, reqs)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for i, r in enumerate(reqs):
        p = r.params
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
        if r.output_len < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            for tok in stops:
                if 0 <= tok < vocab:
                    mask_rows.append(i)
                    mask_cols.append(tok)
    _sparse_add(x, rows, cols, vals)
    if mask_rows:
        x[torch.tensor(mask_rows, device=x.device), torch.tensor(mask_cols, device=x.device)] = float("-inf")
    for i, tok in _thinking_forced(reqs):
        if 0 <= tok < vocab:
            x[i] = float("-inf")
            x[i, tok] = 0.0
    return x
