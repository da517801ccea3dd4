"""Kimi Linear at TP=2 against TP=1 and transformers on CPU with gloo (tests/tp/test_tp_parity.py's serving
script: staggered arrivals, chunked prefill, decode, a copy-on-write fork): each rank holds half of
the heads of every Kimi Delta Attention layer (those rows of q/k/v_proj and their convs, f_b_proj,
g_b_proj, b_proj, dt_bias and A_log, those conv-window channels and state heads, those input columns
of o_proj) and of every MLA layer (those rows of q_proj / q_b_proj and kv_b_proj, those input columns
of o_proj; the latent projection, and so the cached latent, replicated), the dense MLP, every expert
and the shared expert split on their width (router replicated). Identical greedy tokens, logits
within 1e-4 (fp32) of TP=1 at every step, the same logits on every rank, the prompt's logits within
1e-4 of transformers', a state slot costing each rank half the bytes and a KV token slot the whole
latent's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.kimi_linear_model import KIMI_CONFIGS, kimi_dir
from tests.tp.harness import models_traces, run_ranks
from tests.tp.test_tp_parity import N_NEW, TOL, _compare
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import slot_bytes

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(KIMI_CONFIGS)


def _reference(name: str) -> dict:
    return load_file(f"{kimi_dir(name)}/reference.safetensors")


@pytest.fixture(scope="module")
def jobs() -> list[tuple[str, str, int, list[int] | None]]:
    return [(name, kimi_dir(name), N_NEW, _reference(name)["prompt"].tolist()) for name in NAMES]


@pytest.fixture(scope="module")
def tp1(jobs: list) -> dict[str, Any]:
    return models_traces(0, 1, None, jobs)


@pytest.fixture(scope="module")
def tp2(jobs: list) -> list[dict[str, Any]]:
    return run_ranks(models_traces, 2, (jobs,), timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_tp1_and_transformers(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    _compare(tp1[name], [r[name] for r in tp2])
    hf = _reference(name)["prompt_logits"].numpy()
    for r in (tp1, *tp2):
        assert float(np.abs(r[name]["prompt_logits"] - hf).max()) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_tp2_pools_are_per_rank(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    """The ranks plan the same capacities; a state slot (conv windows and delta-rule state) costs each rank
    exactly half, a KV token slot (the latent, replicated) as much as on one rank."""
    kv, states, nbytes = tp1[name]["capacity"]
    for r in tp2:
        r_kv, r_states, r_bytes = r[name]["capacity"]
        assert (r_kv, r_states) == (kv, states) and r_bytes < nbytes
    cfg = load_config(kimi_dir(name))
    whole = slot_bytes(cfg, torch.float32)
    assert whole.state_slot > 0 and whole.kv_token > 0
    for rank in (0, 1):
        part = slot_bytes(cfg, torch.float32, 2, rank)
        assert (2 * part.state_slot, part.kv_token) == (whole.state_slot, whole.kv_token)
