"""`--mamba-ssm-dtype` over Kimi Delta Attention's [heads, head_dim, head_dim] state (checkpoints built by
transformers, tests/fixtures/kimi_linear_model.py): the pools store it as bfloat16 or int8 with one scale
per (head, row), the conv windows stay in the model dtype; logits teacher-forced on the float32 state's
greedy output stay within tests/worker/test_state_dtype.py's measured bounds; a request resumed from a
copied int8 state computes bitwise what the uninterrupted one does. The batch-invariant kernels run, so
that the only difference between the runs is the stored state."""

from __future__ import annotations

import pytest
import torch

from shared.messages import CopyOp
from tests.fixtures.kimi_linear_model import kimi_dir
from tests.model_driver import forward_all_logits, forward_logits, generate_greedy
from tests.worker.test_state_dtype import MEAN_REL_BOUND, REL_BOUND
from tests.worker.util import batch, req, runner_at

NAME, TOKENS = "kimi_moe", 12


def _prompt() -> list[int]:
    from safetensors.torch import load_file

    return load_file(f"{kimi_dir(NAME)}/reference.safetensors")["prompt"].tolist()


def _teacher_forced(state_dtype: str, tokens: list[int]) -> torch.Tensor:
    r = runner_at(kimi_dir(NAME), kv_slots=400, state_slots=4, state_dtype=state_dtype, deterministic=True)
    prompt = _prompt()
    n = len(prompt)
    kv = list(range(1, n + len(tokens) + 1))
    rows = [forward_logits(r, batch(0, [req("a", prompt, 0, kv[:n], 2)], clears=[2]))["a"]]
    for i, tok in enumerate(tokens[:-1], start=1):
        pos = n + i - 1
        rows.append(forward_logits(r, batch(i, [req("a", [tok], pos, kv[: pos + 1], 2)]))["a"])
    r.check_integrity()
    return torch.stack(rows)


def test_pools_store_the_state_dtype_and_leave_the_conv_windows_alone() -> None:
    for state_dtype, storage in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        states = runner_at(kimi_dir(NAME), kv_slots=64, state_slots=3, state_dtype=state_dtype).pools.states
        assert states["kda_state"].dtype == storage and states["kda_conv"].dtype == torch.float32
        assert ("kda_state_scale" in states) == (storage == torch.int8)
        if storage == torch.int8:
            assert states["kda_state_scale"].shape == states["kda_state"].shape[:-1]


def test_logits_stay_within_the_measured_drift() -> None:
    greedy = generate_greedy(runner_at(kimi_dir(NAME), kv_slots=400, state_slots=4, deterministic=True), _prompt(),
                             TOKENS)  # fmt: skip
    ref = _teacher_forced("float32", greedy)
    errors = {}
    for state_dtype in ("bfloat16", "int8"):
        got = _teacher_forced(state_dtype, greedy)
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert torch.equal(got[0], ref[0]), state_dtype  # the prompt's logits come before the state is stored
        assert rel.max() <= REL_BOUND[state_dtype] and rel.mean() <= MEAN_REL_BOUND[state_dtype], (state_dtype, rel)
        errors[state_dtype] = float(rel.mean())
    assert 0 < errors["bfloat16"] < errors["int8"]


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_resume_from_a_copied_state_equals_the_uninterrupted_run_exactly(state_dtype: str) -> None:
    prompt, cut = _prompt(), 9
    n = len(prompt)
    r = runner_at(kimi_dir(NAME), kv_slots=600, state_slots=6, state_dtype=state_dtype, deterministic=True)
    own = list(range(300, 300 + n))
    forward_logits(r, batch(0, [req("x", prompt[:cut], 0, own[:cut], 4, sample=False)], clears=[4]))
    whole = forward_all_logits(r, batch(1, [req("x", prompt[cut:], cut, own, 4)]))["x"]
    kv = list(range(1, n + 1))
    forward_logits(r, batch(2, [req("p", prompt[:cut], 0, kv[:cut], 1, sample=False)], clears=[1]))
    rest = forward_all_logits(r, batch(3, [req("y", prompt[cut:], cut, kv, 2)],
                                       copies=[CopyOp(src=1, dst=2, rid="y")]))["y"]  # fmt: skip
    assert torch.equal(rest, whole)
    assert all(torch.equal(pool[:, 2], pool[:, 4]) for pool in r.pools.states.values() if pool.numel())
    r.check_integrity()
