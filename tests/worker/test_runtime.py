"""ModelRunner: capacities, the built-in checkpoint, StepResult contents, sampling through step()."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.config import builtin_model_dir
from shared.messages import SamplingParams
from tests.model_driver import generate_greedy
from tests.worker.util import batch, fixture_dir, reference, req, runner
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner
from worker_proc.state.pools import DEFAULT_CPU_BUDGET_BYTES, plan_capacities


def test_capacities_from_budget_and_explicit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="worker_proc.runtime.runner")
    r = ModelRunner(fixture_dir("nope_groups2"), WorkerConfig(mem_budget_bytes=4_000_000, state_ratio=0.3))
    kv, mamba = plan_capacities(r.cfg, 4_000_000, 0.3, torch.float32)
    assert (r.kv_capacity, r.state_capacity) == (kv, mamba)
    logged = caplog.messages[-1]
    assert "--mem-budget-gb" in logged and f"{kv} KV token slots, {mamba} state slots" in logged
    default = ModelRunner(fixture_dir("nope_groups2"), WorkerConfig(state_ratio=0.3))
    assert (default.kv_capacity, default.state_capacity) == plan_capacities(
        r.cfg, DEFAULT_CPU_BUDGET_BYTES, 0.3, torch.float32)
    assert "the CPU default" in caplog.messages[-1]
    assert r.pools.k.shape[1] == kv + 1 and r.pools.ssm.shape[1] == mamba + 1
    r2 = ModelRunner(
        fixture_dir("nope_groups2"),
        WorkerConfig(kv_slots=17, state_slots=0, mem_budget_bytes=4_000_000, state_ratio=0.3),
    )
    assert (r2.kv_capacity, r2.state_capacity) == (17, mamba)


def test_builtin_model_loads_and_generates() -> None:
    r = ModelRunner(builtin_model_dir(), WorkerConfig(kv_slots=128, state_slots=4))
    info = r.model_info
    assert info.vocab_size == 260 and info.eos_token_ids == (256,) and info.max_position_embeddings == 4096
    assert info.has_recurrent_state and info.has_attention
    out = generate_greedy(r, list(b"Hello, world"), 16)
    assert 1 <= len(out) <= 16 and all(0 <= t < 260 for t in out)
    assert generate_greedy(r, list(b"Hello, world"), 16) == out
    with pytest.raises(ValueError, match="KV slots"):
        generate_greedy(r, [1] * 120, 10)
    r.check_integrity()


def test_step_result_logprobs_and_seeded_retry() -> None:
    name = "rope_moe"
    prompt = reference(name)["prompt"].tolist()
    n = len(prompt)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=42, logprobs=True)
    results = []
    for _ in range(2):  # a retried step (same state, same output_len) reproduces the token
        r = runner(name)
        res = r.step(
            batch(
                3,
                [
                    req("s", prompt, 0, list(range(1, n + 1)), 1, sampling=sp, output_len=5),
                    req("g", prompt[:4], 0, list(range(30, 34)), 2),
                ],
                clears=[1, 2],
            )
        )
        results.append(res)
    a, b = results
    assert a.step == 3 and a.next_tokens == b.next_tokens and set(a.next_tokens) == {"s", "g"}
    assert set(a.logprobs) == {"s"} and len(a.logprobs["s"]) == 1 and a.logprobs["s"][0] <= 0.0
    assert a.logprobs == b.logprobs
    assert a.elapsed_s > 0 and a.refused == [] and a.error is None


def test_greedy_default_when_sampling_missing() -> None:
    name = "nope_groups2"
    ref = reference(name)
    prompt = ref["prompt"].tolist()
    r = runner(name)
    res = r.step(batch(0, [req("a", prompt, 0, list(range(1, len(prompt) + 1)), 1, sampling=None)], clears=[1]))
    assert res.next_tokens == {"a": int(ref["gen_tokens"][0])}


def test_empty_batch_applies_state_ops_only() -> None:
    r = runner("nope_groups2")
    r.pools.ssm[:, 2].fill_(1.0)
    res = r.step(batch(9, [], clears=[2]))
    assert res.step == 9 and res.next_tokens == {} and not r.pools.ssm[:, 2].any()


def test_a_batch_naming_ended_requests_drops_their_matchers() -> None:
    from shared.messages import ForwardBatch, GrammarSpec
    from tests.model_driver import generate_speculative

    r = ModelRunner(builtin_model_dir(), WorkerConfig(device="cpu", dtype="float32", kv_slots=64, state_slots=4))
    params = SamplingParams(temperature=0.0, grammar=GrammarSpec(kind="regex", source="[a-c]{20}"))
    generate_speculative(r, list(b"Code: "), 4, lambda tokens: [], params)  # cut before the grammar ends
    assert "spec" in r.grammars._matchers
    r.step(ForwardBatch(step=99, reqs=[], ended=["spec"]))
    assert "spec" not in r.grammars._matchers
