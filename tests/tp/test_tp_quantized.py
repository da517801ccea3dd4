"""Quantized weights at TP=2 on CPU with gloo: each rank quantizes the slice it holds with TP=1's scales
(row-parallel slices take each row's max over the ranks), every rank computes the very same logits,
in the deterministic mode (whose products a measured plan cannot change from run to run),
and they stay with TP=1's quantized model (and, on the trained built-in model, with the unquantized
one); models: the built-in one, a Granite hybrid fixture with MoE experts, a Gated DeltaNet fixture, a
Kimi Linear checkpoint (KDA and MLA, whose absorbed per-head kv_b_proj products each rank quantizes for
its own heads)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file

from shared.config import builtin_model_dir
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from tests.fixtures.kimi_linear_model import kimi_dir
from tests.model_driver import forward_all_logits
from tests.tp.harness import run_ranks
from tests.worker.util import fixture_dir, reference
from worker_proc.plan.execution_plan import product_sites
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(240)

FORMATS = ("int8", "int4")
FIXTURE_MIN_COSINE = 0.6
"""TP=2 against TP=1, both quantized, on the random fixtures: the scales are the same, but the
row-parallel partial sums round their activations (bfloat16, per-row int8) where TP=1 rounds the whole
row, and these fixtures amplify every rounding difference."""
BUILTIN_PROMPT = list(range(40, 120))
MODELS = {"builtin": (builtin_model_dir(), BUILTIN_PROMPT), "rope_moe": (fixture_dir("rope_moe"), None),
          "qwen3_5_dense": (fixture_dir("qwen3_5_dense"), None), "kimi_qlora": (kimi_dir("kimi_qlora"), None)}
"""Each model's directory and prompt (None: its reference's)."""


def _prompt_logits(rank: int, size: int, group: Any, model_dir: str, prompt: list[int], fmt: str) -> np.ndarray:
    r = ModelRunner(
        model_dir,
        WorkerConfig(
            dtype="float32",
            kv_slots=len(prompt) + 4,
            state_slots=2,
            tp_rank=rank,
            tp_size=size,
            quantization=fmt,
            deterministic=True,
        ),
        tp_group=group,
    )
    assert all((s.quantized is not None) == bool(fmt) for _, s, _ in product_sites(r.model) if s.quantizable)
    sl = ReqSlice(rid="p", input_ids=prompt, start_pos=0, kv_slots=list(range(1, len(prompt) + 1)), state_slot=1,
                  sample=True, sampling=SamplingParams(temperature=0.0))  # fmt: skip
    return forward_all_logits(r, ForwardBatch(step=0, reqs=[sl], clears=[1]))["p"].numpy()


def _reference_prompt(name: str, path: str) -> list[int]:
    if name.startswith("kimi"):
        return load_file(os.path.join(path, "reference.safetensors"))["prompt"].tolist()
    return reference(name)["prompt"].tolist()


def _all(rank: int, size: int, group: Any, jobs: list[tuple[str, str, list[int], str]]) -> dict[tuple[str, str], Any]:
    return {(name, fmt): _prompt_logits(rank, size, group, path, prompt, fmt) for name, path, prompt, fmt in jobs}


@pytest.fixture(scope="module")
def jobs() -> list[tuple[str, str, list[int], str]]:
    out = []
    for name, (path, prompt) in MODELS.items():
        ids = prompt if prompt is not None else _reference_prompt(name, path)
        out += [(name, path, ids, fmt) for fmt in ("", *FORMATS)]
    return out


@pytest.fixture(scope="module")
def tp1(jobs: list) -> dict:
    return _all(0, 1, None, jobs)


@pytest.fixture(scope="module")
def tp2(jobs: list) -> list[dict]:
    return run_ranks(_all, 2, ([j for j in jobs if j[3]],), timeout=200)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_quantized_matches_every_rank_and_stays_with_tp1(name: str, fmt: str, tp1: dict, tp2: list[dict]) -> None:
    ranks = [r[(name, fmt)] for r in tp2]
    assert np.array_equal(ranks[0], ranks[1])  # the all-reduced logits are the same on every rank
    one, dense = tp1[(name, fmt)], tp1[(name, "")]
    if name == "builtin":  # trained: the quantization moves it little, wherever the scales are taken
        assert float((ranks[0].argmax(-1) == one.argmax(-1)).mean()) >= 0.95
        assert float((ranks[0].argmax(-1) == dense.argmax(-1)).mean()) >= 0.85
        assert float(np.abs(ranks[0] - one).max()) <= 0.15 * float(np.abs(one).max())
    else:  # random fixtures amplify rounding (tests/worker/test_quantized_models.py): the rows' direction
        assert _cosine(ranks[0], one) >= FIXTURE_MIN_COSINE
