"""`--mamba-ssm-dtype`: state pools storing the recurrent states as bfloat16 or int8, end to end in the runner.

What must hold: the pools declare and allocate the values and (int8) scales and count them per slot,
so the same budget plans more slots; copies and clears move the scales with the values; a resumed
request (copy-on-write of a cached state) computes bitwise what the uninterrupted one does with the
same state dtype; greedy output and logits stay close to the float32 state's.

Bounds below were measured on the tiny random fixtures (tests/fixtures) with the default `fast`
kernels, 16 tokens teacher-forced on the float32 state's greedy output, and set about 25% above the
largest value seen. Relative error = ||logits - logits_fp32|| / ||logits_fp32|| at the last position.
Random-weight fixtures have near-tied logits, and int8 per-row quantisation moves logits by tenths of
that norm on them: greedy agreement is asserted on the fixtures where no tie falls within that drift
in 16 tokens (Granite's nope_groups2, Qwen3.5's qwen3_5_dense); the pure Mamba2 and Qwen3-Next
fixtures are held to the logit bounds only.
"""

from __future__ import annotations

import pytest
import torch

from shared.config import ConfigError, ServerArgs, builtin_model_dir
from shared.messages import CopyOp
from tests.model_driver import forward_all_logits, forward_logits, generate_greedy
from tests.worker.util import batch, fixture_dir, reference, req, runner
from worker_proc.loading.checkpoint import load_config
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner
from worker_proc.state.pools import StatePools, plan_capacities, slot_bytes, state_tensors

TOKENS = 16
REL_BOUND = {"bfloat16": 0.03, "int8": 0.1}
"""Largest relative logit error at any of the TOKENS positions (measured: bf16 <= 0.019, int8 <= 0.066
with a scale per row; one scale per head gave 0.361)."""
MEAN_REL_BOUND = {"bfloat16": 0.008, "int8": 0.035}
"""Mean over the positions (measured: bf16 <= 0.0056, int8 <= 0.025)."""


def _prompt(name: str) -> list[int]:
    return reference(name)["prompt"].tolist()


def _teacher_forced_logits(name: str, state_dtype: str, tokens: list[int]) -> torch.Tensor:
    """Last-position logits [len(tokens), V]: the prompt's, then one decode step per token fed."""
    r = runner(name, kv_slots=400, state_slots=4, state_dtype=state_dtype)
    prompt = _prompt(name)
    n = len(prompt)
    kv = list(range(1, n + len(tokens) + 1))
    rows = [forward_logits(r, batch(0, [req("a", prompt, 0, kv[:n], 2)], clears=[2]))["a"]]
    for i, tok in enumerate(tokens[:-1], start=1):
        pos = n + i - 1
        rows.append(forward_logits(r, batch(i, [req("a", [tok], pos, kv[: pos + 1], 2)]))["a"])
    r.check_integrity()  # slot 0 of every pool, scales included, is still zero
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["mamba2", "nope_groups2", "qwen3_5_dense", "qwen3_next_moe"])
def test_logits_stay_within_the_measured_drift(name: str) -> None:
    greedy = generate_greedy(runner(name, kv_slots=400, state_slots=4), _prompt(name), TOKENS)
    ref = _teacher_forced_logits(name, "float32", greedy)
    errors = {}
    for state_dtype in ("bfloat16", "int8"):
        got = _teacher_forced_logits(name, state_dtype, greedy)
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        # the prompt's logits come before the state is stored: exactly the float32 state's
        assert torch.equal(got[0], ref[0]), state_dtype
        assert rel.max() <= REL_BOUND[state_dtype] and rel.mean() <= MEAN_REL_BOUND[state_dtype], (state_dtype, rel)
        errors[state_dtype] = float(rel.mean())
    assert 0 < errors["bfloat16"] < errors["int8"]  # the stored states do differ, int8 more than bfloat16


@pytest.mark.parametrize("name", ["nope_groups2", "qwen3_5_dense"])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_greedy_output_agrees_with_the_float32_state(name: str, state_dtype: str) -> None:
    want = generate_greedy(runner(name, kv_slots=400, state_slots=4), _prompt(name), TOKENS)
    r = runner(name, kv_slots=400, state_slots=4, state_dtype=state_dtype)
    assert generate_greedy(r, _prompt(name), TOKENS) == want
    r.check_integrity()


def test_bfloat16_greedy_agrees_on_the_pure_mamba2_and_qwen3_next_fixtures() -> None:
    for name in ("mamba2", "qwen3_next_moe"):
        want = generate_greedy(runner(name, kv_slots=400, state_slots=4), _prompt(name), TOKENS)
        got = generate_greedy(runner(name, kv_slots=400, state_slots=4, state_dtype="bfloat16"), _prompt(name),
                              TOKENS)  # fmt: skip
        assert got == want, name


def _slot(r: ModelRunner, slot: int) -> dict[str, torch.Tensor]:
    return {name: pool[:, slot].clone() for name, pool in r.pools.states.items() if pool.numel()}


@pytest.mark.parametrize("name, cut", [("mamba2", 9), ("qwen3_5_dense", 70)])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_resume_from_a_copied_state_equals_the_uninterrupted_run_exactly(name: str, cut: int,
                                                                         state_dtype: str) -> None:  # fmt: skip
    """The uninterrupted request stores its state at the same split (a checkpoint is taken at a chunk
    boundary), so the resumed one differs only by the copy: values and scales move bit for bit."""
    prompt = _prompt(name)
    n = len(prompt)
    r = runner(name, kv_slots=600, state_slots=6, state_dtype=state_dtype, deterministic=True)
    own = list(range(300, 300 + n + 8))
    forward_logits(r, batch(0, [req("x", prompt[:cut], 0, own[:cut], 4, sample=False)], clears=[4]))
    whole = forward_all_logits(r, batch(1, [req("x", prompt[cut:], cut, own[:n], 4)]))["x"]
    kv = list(range(1, n + 9))
    forward_logits(r, batch(2, [req("p", prompt[:cut], 0, kv[:cut], 1, sample=False)], clears=[1]))
    cached = _slot(r, 1)
    if state_dtype == "int8":
        assert ("ssm_scale" if name == "mamba2" else "gdn_state_scale") in cached
    r.pools.copy_state(1, 5)  # copy-on-write is lossless: every tensor of the slot, scales included
    assert all(torch.equal(t, r.pools.states[k][:, 5]) for k, t in cached.items())
    rest = forward_all_logits(r, batch(3, [req("y", prompt[cut:], cut, kv[:n], 2)],
                                       copies=[CopyOp(src=1, dst=2, rid="y")]))["y"]  # fmt: skip
    assert torch.equal(rest, whole)
    assert all(torch.equal(t, r.pools.states[k][:, 1]) for k, t in cached.items())  # the source is untouched
    assert all(torch.equal(r.pools.states[k][:, 2], r.pools.states[k][:, 4]) for k in cached)
    tok_x, tok_y = int(whole[-1].argmax()), int(rest[-1].argmax())
    for step in range(4):  # and the decodes that follow stay identical
        pos = n + step
        lx = forward_logits(r, batch(4 + 2 * step, [req("x", [tok_x], pos, own[: pos + 1], 4)]))["x"]
        ly = forward_logits(r, batch(5 + 2 * step, [req("y", [tok_y], pos, kv[: pos + 1], 2)]))["y"]
        assert torch.equal(lx, ly)
        tok_x, tok_y = int(lx.argmax()), int(ly.argmax())
    r.check_integrity()


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5_dense"])
def test_int8_pools_hold_values_and_scales_and_slot_ops_move_both(name: str) -> None:
    cfg = load_config(fixture_dir(name))
    p = StatePools(cfg, kv_slots=4, state_slots=3, dtype=torch.float32, device="cpu", state_dtype="int8")
    state = "ssm" if name == "mamba2" else "gdn_state"
    values, scale = p.states[state], p.states[state + "_scale"]
    assert values.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == values.shape[:-1]  # [layers, slots, heads, rows]: one scale per row of a head
    grown = StatePools(cfg, kv_slots=4, state_slots=4, dtype=torch.float32, device="cpu", state_dtype="int8")
    assert grown.nbytes() - p.nbytes() == slot_bytes(cfg, torch.float32, state_dtype="int8").state_slot
    for pool in p.states.values():
        if pool.is_floating_point():
            pool[:, 1].uniform_(0.5, 1.0)
        else:
            pool[:, 1].random_(-127, 128)
    p.copy_state(1, 3)
    assert all(torch.equal(pool[:, 3], pool[:, 1]) for pool in p.states.values())
    p.clear_state(1)
    assert not values[:, 1].any() and not scale[:, 1].any() and scale[:, 3].all()
    p.check_integrity()
    scale[0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match=f"padding slot 0 of the {state}_scale pool"):
        p.check_integrity()


@pytest.mark.parametrize("name", ["mamba2", "nope_groups2", "qwen3_5_dense", "qwen3_next_moe", "builtin"])
def test_narrower_states_give_more_slots_in_the_same_budget(name: str) -> None:
    cfg = load_config(builtin_model_dir() if name == "builtin" else fixture_dir(name))
    budget = 64 << 20
    slots = {sd: plan_capacities(cfg, budget, 0.5, torch.float32, state_dtype=sd)[1]
             for sd in ("float32", "bfloat16", "int8")}  # fmt: skip
    assert slots["int8"] >= 1.8 * slots["float32"], slots
    # bfloat16 halves the recurrent state; the conv windows stay in the model dtype (here float32)
    assert slots["bfloat16"] >= 1.6 * slots["float32"], slots
    recurrent = {sd: sum(t.slot_bytes for t in state_tensors(cfg, torch.float32, state_dtype=sd)
                         if t.name in ("ssm", "gdn_state")) for sd in slots}  # fmt: skip
    assert recurrent["float32"] == 2 * recurrent["bfloat16"] == 4 * recurrent["int8"]


def test_the_runner_reports_the_larger_capacity() -> None:
    """What the worker sends in WorkerReady (and the scheduler admits against) is the runner's capacity."""
    caps = {sd: ModelRunner(fixture_dir("mamba2"),
        WorkerConfig(mem_budget_bytes=4_000_000, state_dtype=sd)).state_capacity
            for sd in ("float32", "int8")}  # fmt: skip
    assert caps["int8"] >= 1.8 * caps["float32"], caps


def test_server_args_validate_the_state_dtype() -> None:
    assert ServerArgs().mamba_ssm_dtype == "float32"
    assert ServerArgs.from_bytes(ServerArgs(mamba_ssm_dtype="int8").to_bytes()).mamba_ssm_dtype == "int8"
    with pytest.raises(ConfigError, match="--mamba-ssm-dtype"):
        ServerArgs(mamba_ssm_dtype="float16")  # type: ignore[arg-type]
    from hyssm.flags import build_parser

    action = next(a for a in build_parser()._actions if "--mamba-ssm-dtype" in a.option_strings)
    assert action.default == "float32" and tuple(action.choices) == ("float32", "bfloat16", "int8")
