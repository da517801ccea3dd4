"""Token sampling for one step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Rank 0 samples. Determinism rule: the random draw of a request
depends only on (its seed, its output_len), so a retried or replayed step picks the same token.
A request without a seed derives one from the runner seed and a stable hash of its rid.
Logprobs are those of the chosen token under the model's raw distribution (before penalties,
logit_bias, temperature and filtering); `top_logprobs` are the most likely tokens of that same
distribution. Penalties, logit_bias and min_tokens (logit_processing.py) change only the choice.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from shared.messages import SamplingParams
from worker_proc.output.logit_processing import SampleRequest, process_logits

_GREEDY = SamplingParams(temperature=0.0)
_MASK64 = (1 << 63) - 1


def draw_seed(params: SamplingParams, rid: str, output_len: int, base_seed: int) -> int:
    """The generator seed of one draw: a fixed mix of (seed, output_len)."""
    seed = params.seed if params.seed is not None else (base_seed * 1_000_003) ^ zlib.crc32(rid.encode())
    return (seed * 6_364_136_223_846_793_005 + output_len * 1_442_695_040_888_963_407 + 1) & _MASK64


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits: [B, V] float32 (no greedy rows)."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    x = logits / temps[:, None]
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    need_sort = any(k < vocab for k in ks) or any(p.top_p < 1.0 for p in params)
    if need_sort:
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        drop = rank >= torch.tensor(ks, device=x.device)[:, None]
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=x.device)
        probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps the first)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=x.device)
    if bool((min_p > 0).any()):
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def sample(
    logits: torch.Tensor, reqs: list[SampleRequest], base_seed: int = 0, want_logprobs: bool = False,
    eos_ids: tuple[int, ...] = (), constrain: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[int], list[float] | None]:
    """Pick one token per row of `logits` [B, V] (float32). Returns (tokens, logprobs or None).
    `eos_ids`: the model's EOS tokens (masked while a request is below its min_tokens);
    `constrain`: masks the processed logits in place (grammar token masks), before any choice."""
    chosen_from = process_logits(logits, reqs, eos_ids)
    if constrain is not None:
        if chosen_from is logits:
            chosen_from = logits.clone()
        constrain(chosen_from)
    tokens = torch.argmax(chosen_from, dim=-1)
    random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
        filtered = filter_logits(chosen_from[rows], [reqs[i].params for i in random_rows])
        probs = filtered.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            r = reqs[i]
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(draw_seed(r.params, r.rid, r.output_len, base_seed))
            noise[j].exponential_(generator=gen)
        noise.clamp_(min=1e-30)  # an exact 0 draw would make 0/0 = NaN win the argmax
        # argmax(p / E) with E ~ Exp(1) draws exactly from p; zero-probability tokens never win
        tokens[rows] = torch.argmax(probs / noise, dim=-1)
    token_list = tokens.tolist()
    if not want_logprobs:
        return token_list, None
    logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return token_list, logp.tolist()


def top_logprobs(logp: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """The `ks[i]` most likely (token, logprob) of row i of log-probabilities `logp` [B, V], most
    likely first (ties: lower token id first, as torch.topk orders them on CPU)."""
    k = min(max(ks, default=0), logp.shape[-1])
    if k <= 0:
        return [[] for _ in ks]
    vals, ids = torch.topk(logp, k, dim=-1)
    vals_l, ids_l = vals.tolist(), ids.tolist()
    return [list(zip(ids_l[i][: ks[i]], vals_l[i][: ks[i]], strict=True)) for i in range(len(ks))]


def greedy_params() -> SamplingParams:
    return _GREEDY
