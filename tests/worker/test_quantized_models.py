"""Quantized models end to end in the worker runtime: the measured plan's products give the logits of the
dequantized reference (every site on its format's `dequant` product) to the rounding of their
activations, tightly on the trained built-in model and for every family's (random, rounding-amplifying)
fixture as the same direction of every logit row; the deterministic mode stays bitwise batch invariant
with quantized weights; greedy generations of the built-in model stay with the unquantized model's."""

from __future__ import annotations

import pytest
import torch

from shared.config import builtin_model_dir
from tests.model_driver import forward_all_logits, generate_greedy
from tests.worker.test_batch_invariance import mixed_and_alone
from tests.worker.util import ALL_FIXTURES, GDN_FIXTURES, batch, max_diff, reference, req, runner
from worker_proc.linear.kernels import COPIES, DENSE, DEQUANT
from worker_proc.plan.execution_plan import fixed_plan, product_sites
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

REFERENCE = {"dense": DENSE, **DEQUANT}
TRAINED_REL_TOL = 0.15
"""The built-in model's largest logit difference (over every row and token) against its dequantized
reference, relative to the largest logit: the products round their activations to bfloat16 or, in
w8a8, to per-row int8; the reference does not (by this measure a bfloat16 copy of the model lies a
few percent from the float32 one)."""
FIXTURE_MIN_COSINE = 0.6
"""The fixtures are random: rounding differences grow through their layers and flip MoE routing, so
they are held to the direction of each logit row (a wrong scale or layout gives ~0). An int4 product over
the int8 copy rounds three times (4-bit values, their int8 copy, int8 activations): 0.72 on `rope_moe`."""


def _prompt_logits(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    kv = list(range(1, len(prompt) + 1))
    return forward_all_logits(r, batch(0, [req("a", prompt, 0, kv, 1)], clears=[1]))["a"]


def _plan_and_reference(r: ModelRunner, prompt: list[int], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    assert all(site.quantized is not None for _, site, _ in product_sites(r.model) if site.quantizable)
    # the sites left in the model dtype (routers, a head) may read a copy of their weight
    allowed = {"dense", "int8", fmt, *COPIES}
    assert {m.storage for _, site, _ in product_sites(r.model) for m in site.methods} <= allowed
    got = _prompt_logits(r, prompt)
    r.check_integrity()
    r.bind_plan(fixed_plan(r.model, REFERENCE))
    return got, _prompt_logits(r, prompt)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_the_trained_model_gives_its_dequantized_reference(fmt: str) -> None:
    prompt = list(range(40, 140))
    r = ModelRunner(builtin_model_dir(), WorkerConfig(kv_slots=256, state_slots=4, dtype="float32", quantization=fmt))
    got, want = _plan_and_reference(r, prompt, fmt)
    err = max_diff(got, want) / float(want.abs().max())
    assert err <= TRAINED_REL_TOL, f"relative logit error {err:.2e}"
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.95


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("name", [*ALL_FIXTURES, *GDN_FIXTURES])
def test_every_family_runs_its_quantized_products(name: str, fmt: str) -> None:
    prompt = reference(name)["prompt"].tolist()
    r = runner(name, kv_slots=len(prompt) + 8, quantization=fmt)
    got, want = _plan_and_reference(r, prompt, fmt)
    assert bool(torch.isfinite(got).all())
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min())
    assert cosine >= FIXTURE_MIN_COSINE, f"logit rows {cosine:.3f} apart"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("name", ["rope_moe", "nemotron_h_moe", "qwen3_5_moe", "bamba"])
def test_the_deterministic_mode_stays_batch_invariant(name: str, fmt: str) -> None:
    alone = runner(name, deterministic=True, quantization=fmt)
    together = runner(name, deterministic=True, quantization=fmt)
    assert all(site.batch_invariant for _, site, _ in product_sites(alone.model))
    got, expected = mixed_and_alone(alone, together)
    assert set(got) == set(expected) == {"a", "b", "c", "d", "e", "f"}
    for rid in expected:
        assert torch.equal(got[rid], expected[rid]), rid


@pytest.mark.parametrize("fmt,agree", [("int8", 0.95), ("int4", 0.93), ("fp8", 0.95)])
def test_the_next_token_stays_the_unquantized_models(fmt: str, agree: float) -> None:
    """Fed the unquantized model's own greedy text, the quantized model picks the same next token."""
    kw = {"kv_slots": 256, "state_slots": 4, "dtype": "float32"}
    base = ModelRunner(builtin_model_dir(), WorkerConfig(**kw))
    text = list(range(40, 72))
    text += generate_greedy(base, text, 96)
    want = _prompt_logits(base, text).argmax(-1)
    got = _prompt_logits(ModelRunner(builtin_model_dir(), WorkerConfig(quantization=fmt, **kw)), text).argmax(-1)
    same = float((got == want).float().mean())
    assert same >= agree, f"{fmt}: {same:.3f} of the next tokens agree"
