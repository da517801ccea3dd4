"""Parity with transformers for the Gated DeltaNet families (Qwen3-Next MoE, Qwen3.5 dense and
MoE; fixtures by tests/fixtures/make_parity.py, prompts of 100-150 tokens: longer than the 64-token
chunk of the gated delta rule and not a multiple of it).

Full-prompt logits, chunked prefill resuming from the pooled conv + recurrent state (chunk
boundaries off the 64-token grid, a one-token chunk taking the decode path mid-prompt), per-step
decode logits and greedy tokens, through ModelRunner with msgpack round-tripped batches, in the
default and the deterministic mode. Tolerance: 1e-4 max abs logit difference (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tests.model_driver import forward_all_logits, forward_logits, generate_greedy
from tests.worker.util import GDN_FIXTURES, batch, max_diff, reference, req, runner

TOL = 1e-4
KV = 400


def _chunks(n: int, pattern: str) -> list[int]:
    """Chunk lengths summing to n: 'three' = 23 | 64 | rest, 'one' = 70 | 1 | rest, 'small' = 5 | 90 | rest."""
    heads = {"three": [23, 64], "one": [70, 1], "small": [5, 90]}[pattern]
    return [*heads, n - sum(heads)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", GDN_FIXTURES)
def test_full_prompt_logits(name: str, deterministic: bool) -> None:
    ref = reference(name)
    r = runner(name, kv_slots=KV, deterministic=deterministic)
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    assert n > 64 and n % 64
    out = forward_all_logits(r, batch(0, [req("a", prompt, 0, list(range(1, n + 1)), 1)], clears=[1]))
    assert max_diff(out["a"], ref["prompt_logits"]) <= TOL
    r.check_integrity()
    assert r.pools.states["gdn_state"][:, 1].abs().sum() > 0 and r.pools.states["gdn_conv"][:, 1].abs().sum() > 0


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", GDN_FIXTURES)
@pytest.mark.parametrize("pattern", ["three", "one", "small"])
def test_chunked_prefill_logits(name: str, pattern: str, deterministic: bool) -> None:
    ref = reference(name)
    prompt = ref["prompt"].tolist()
    r = runner(name, kv_slots=KV, deterministic=deterministic)
    kv = [5 + 2 * i for i in range(len(prompt))]  # scattered, non-contiguous KV slots
    rows, start = [], 0
    for step, c in enumerate(_chunks(len(prompt), pattern)):
        sl = req("a", prompt[start : start + c], start, kv[: start + c], 3)
        rows.append(forward_all_logits(r, batch(step, [sl], clears=[3] if start == 0 else []))["a"])
        start += c
    assert max_diff(torch.cat(rows), ref["prompt_logits"]) <= TOL
    r.check_integrity()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", GDN_FIXTURES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    ref = reference(name)
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()
    r = runner(name, kv_slots=KV, deterministic=deterministic)
    n = len(prompt)
    kv = list(range(1, n + len(gen) + 1))
    logits = forward_logits(r, batch(0, [req("a", prompt, 0, kv[:n], 2)], clears=[2]))["a"]
    assert max_diff(logits, ref["gen_logits"][0]) <= TOL
    for i in range(1, len(gen)):
        pos = n + i - 1
        logits = forward_logits(r, batch(i, [req("a", [gen[i - 1]], pos, kv[: pos + 1], 2)]))["a"]
        assert max_diff(logits, ref["gen_logits"][i]) <= TOL, f"decode step {i}"
    r.check_integrity()
    assert generate_greedy(r, prompt, len(gen)) == gen
