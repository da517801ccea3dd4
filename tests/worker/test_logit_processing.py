"""Penalties, logit_bias, min_tokens and top logprobs of the sampler against a plain per-request
reference written from the rules (OpenAI / vLLM semantics), in mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from shared.messages import SamplingParams, ThinkingBudget
from worker_proc.output.logit_processing import process_logits
from worker_proc.output.sampling import SampleRequest, sample, top_logprobs

V = 40
EOS = (3,)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3.0


def reference(row: list[float], r: SampleRequest, eos: tuple[int, ...]) -> list[float]:
    """One request, one token at a time, straight from the rules."""
    p, x = r.params, list(row)
    hist = list(r.history or [])
    out = hist[len(hist) - r.output_len:] if r.output_len else []
    for t in set(hist):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    if r.output_len < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = -math.inf
    return x


CASES = [
    SampleRequest("plain", SamplingParams(temperature=0.0), 2, None),
    SampleRequest("freq", SamplingParams(frequency_penalty=1.5), 4, [1, 2, 5, 5, 5, 7]),
    SampleRequest("pres", SamplingParams(presence_penalty=-0.7), 3, [9, 9, 1, 1, 2]),
    SampleRequest("rep", SamplingParams(repetition_penalty=1.8), 1, [0, 4, 11, 12, 4]),
    SampleRequest("all", SamplingParams(frequency_penalty=0.3, presence_penalty=0.4, repetition_penalty=0.6,
                                        logit_bias={6: 5.0, 7: -100.0}), 2, [6, 7, 8, 6]),
    SampleRequest("bias", SamplingParams(logit_bias={0: 100.0, 39: -3.5}), 0, None),
    SampleRequest("min", SamplingParams(min_tokens=3, stop_token_ids=[10, 11]), 2, None),
    SampleRequest("min-done", SamplingParams(min_tokens=3, stop_token_ids=[10]), 3, None),
    SampleRequest("min-ignore-eos", SamplingParams(min_tokens=5, ignore_eos=True, stop_token_ids=[12]), 0, None),
]


def test_batched_processing_equals_reference() -> None:
    logits = _logits(len(CASES))
    got = process_logits(logits, CASES, EOS)
    for i, r in enumerate(CASES):
        want = torch.tensor(reference(logits[i].tolist(), r, EOS))
        assert torch.allclose(got[i], want, atol=1e-5), r.rid
    assert torch.equal(logits, _logits(len(CASES)))  # the input (raw logits for logprobs) is untouched


def test_effects_on_the_choice() -> None:
    logits = torch.zeros(4, V)
    logits[:, 5] = 1.0  # token 5 wins unless processing changes it
    reqs = [
        SampleRequest("bias", SamplingParams(temperature=0.0, logit_bias={8: 2.0}), 0),
        SampleRequest("freq", SamplingParams(temperature=0.0, frequency_penalty=2.0), 1, [1, 5]),
        SampleRequest("min", SamplingParams(temperature=0.0, min_tokens=1), 0),
        SampleRequest("none", SamplingParams(temperature=0.0), 0),
    ]
    logits[2, 3] = 9.0  # EOS would win, but min_tokens masks it
    toks, _ = sample(logits, reqs, eos_ids=EOS)
    assert toks[0] == 8 and toks[1] != 5 and toks[2] == 5 and toks[3] == 5


def test_no_processing_returns_the_same_tensor() -> None:
    logits = _logits(2)
    reqs = [SampleRequest("a", SamplingParams(), 0), SampleRequest("b", SamplingParams(temperature=0.0), 3)]
    assert process_logits(logits, reqs, EOS) is logits


def test_out_of_vocab_history_is_ignored() -> None:
    logits = _logits(1)
    r = SampleRequest("x", SamplingParams(presence_penalty=1.0), 2, [1, 2, V + 5])
    got = process_logits(logits, [r], EOS)
    assert torch.allclose(got[0, :], torch.tensor(reference(logits[0].tolist(), SampleRequest(
        "x", r.params, 1, [1, 2]), EOS)))  # the in-vocab output token 2 is penalised, nothing else


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_stay_raw_and_seeded_draws_are_reproducible(temperature: float) -> None:
    logits = _logits(1, seed=3)
    p = SamplingParams(temperature=temperature, seed=7, logprobs=True, presence_penalty=2.0)
    r = SampleRequest("s", p, 2, [0, 1, 2, 3])
    a, lpa = sample(logits, [r], want_logprobs=True)
    b, lpb = sample(logits, [r], want_logprobs=True)
    assert a == b and lpa == lpb
    raw = torch.log_softmax(logits, dim=-1)[0, a[0]].item()
    assert lpa is not None and lpa[0] == pytest.approx(raw)


def test_top_logprobs_per_row() -> None:
    logp = torch.log_softmax(_logits(3, seed=5), dim=-1)
    tops = top_logprobs(logp, [2, 0, 5])
    assert [len(t) for t in tops] == [2, 0, 5]
    for row, top in zip(logp, tops, strict=True):
        order = torch.argsort(row, descending=True).tolist()
        assert [t for t, _ in top] == order[: len(top)]
        assert all(v == pytest.approx(row[t].item()) for t, v in top)


def test_a_thinking_budget_forces_the_end_of_the_reasoning() -> None:
    start, end = (30, 31), (32, 33, 34)
    budget = ThinkingBudget(tokens=3, start=start, end=end)
    prompt = [5, 6]

    def forced(output: list[int], b: ThinkingBudget = budget) -> int | None:
        r = SampleRequest("r", SamplingParams(thinking_budget=b), len(output), prompt + output)
        x = process_logits(_logits(1), [r])
        allowed = torch.isfinite(x[0]).nonzero().flatten().tolist()
        return allowed[0] if len(allowed) == 1 else None

    assert forced([7, 8, 9, 10]) is None  # never entered the reasoning
    assert forced([30, 31, 7, 8]) is None  # two tokens of reasoning: under the budget
    assert forced([30, 31, 7, 8, 9]) == 32  # three: the end tag is forced, token by token
    assert forced([30, 31, 7, 8, 9, 32]) == 33 and forced([30, 31, 7, 8, 9, 32, 33]) == 34
    assert forced([30, 31, 7, 8, 9, 32, 33, 34]) is None  # ended: the answer is free
    assert forced([30, 31, 7, 8, 32, 33, 34, 9, 9, 9]) is None  # the model ended it itself
    assert forced([30, 31, 7, 32]) is None  # it began closing under the budget: its own end goes on
    assert forced([30, 31, 7, 8, 32, 9]) == 32  # a tag begun and dropped is reasoning: over the budget
    assert forced([], ThinkingBudget(tokens=0, start=start, end=end, inside=True)) == 32  # no thinking at all
    assert forced([7, 8], ThinkingBudget(tokens=2, start=start, end=end, inside=True)) == 32
