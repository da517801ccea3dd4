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

from tests.model_driver import forward_all_logits, generate_greedy
from tests.worker.util import (
    GDN_FIXTURES,
    batch,
    chunked_prompt_logits,
    decode_logit_diffs,
    max_diff,
    reference,
    req,
    runner,
)

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
    assert max_diff(chunked_prompt_logits(r, prompt, _chunks(len(prompt), pattern)), ref["prompt_logits"]) <= TOL
    r.check_integrity()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", GDN_FIXTURES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    ref = reference(name)
    prompt, gen = ref["prompt"].tolist(), ref["gen_tokens"].tolist()
    r = runner(name, kv_slots=KV, deterministic=deterministic)
    diffs = decode_logit_diffs(r, prompt, gen, ref["gen_logits"])
    assert len(diffs) == len(gen) and max(diffs) <= TOL, diffs
    r.check_integrity()
    assert generate_greedy(r, prompt, len(gen)) == gen
