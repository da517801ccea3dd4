"""Parity with Hugging Face transformers (fixtures made by tests/fixtures/make_parity.py), for every
model family (GraniteMoeHybrid, Nemotron-H dense and MoE, Falcon-H1, Bamba, Mamba2).

Full-prompt logits, chunked prefill with chunk boundaries not aligned to mamba_chunk_size,
per-step decode logits and greedy tokens, for every fixture config, through ModelRunner with real
(msgpack round-tripped) ForwardBatch messages, in the default (fast kernels) and the deterministic
mode. Tolerance: 1e-4 max abs logit difference (fp32).
"""

from __future__ import annotations

import pytest

from tests.model_driver import forward_all_logits, generate_greedy
from tests.worker.util import (
    ALL_FIXTURES,
    batch,
    chunked_prompt_logits,
    decode_logit_diffs,
    fixture_dir,
    max_diff,
    reference,
    req,
    runner,
)
from worker_proc.loading.checkpoint import load_config

TOL = 1e-4


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_full_prompt_logits(name: str, deterministic: bool) -> None:
    ref = reference(name)
    r = runner(name, deterministic=deterministic)
    prompt = ref["prompt"].tolist()
    n = len(prompt)
    out = forward_all_logits(r, batch(0, [req("a", prompt, 0, list(range(1, n + 1)), 1)], clears=[1]))
    assert out["a"].shape == ref["prompt_logits"].shape
    assert max_diff(out["a"], ref["prompt_logits"]) <= TOL
    r.check_integrity()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ALL_FIXTURES)
@pytest.mark.parametrize("chunks", [(4, 6, 9), (1, 10, 8), (3, 3, 3, 3, 3, 3, 1)])
def test_chunked_prefill_logits(name: str, chunks: tuple[int, ...], deterministic: bool) -> None:
    ref = reference(name)
    cfg = load_config(fixture_dir(name))
    prompt = ref["prompt"].tolist()
    assert sum(chunks) == len(prompt)
    assert any(c % cfg.mamba.chunk_size for c in chunks)  # boundaries not aligned to the SSD chunk
    r = runner(name, deterministic=deterministic)
    assert max_diff(chunked_prompt_logits(r, prompt, chunks), ref["prompt_logits"]) <= TOL
    r.check_integrity()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_decode_logits_and_greedy_tokens(name: str, deterministic: bool) -> None:
    ref = reference(name)
    prompt = ref["prompt"].tolist()
    gen = ref["gen_tokens"].tolist()
    r = runner(name, deterministic=deterministic)
    diffs = decode_logit_diffs(r, prompt, gen, ref["gen_logits"])
    assert len(diffs) == len(gen) and max(diffs) <= TOL, diffs
    r.check_integrity()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_greedy_generation_through_step(name: str, deterministic: bool) -> None:
    ref = reference(name)
    r = runner(name, deterministic=deterministic)
    gen = ref["gen_tokens"].tolist()
    assert generate_greedy(r, ref["prompt"].tolist(), len(gen)) == gen
    # stops right after an EOS token, which is included (the first token not generated before it)
    i = next(i for i in range(2, len(gen)) if gen[i] not in gen[:i])
    assert generate_greedy(r, ref["prompt"].tolist(), len(gen), eos_ids=(gen[i],)) == gen[: i + 1]
