"""Mamba1 (Mamba, FalconMamba, Jamba) at TP=2 against TP=1 and transformers on CPU with gloo
(tests/tp/test_tp_parity.py's serving script: staggered arrivals, chunked prefill, decode, a copy-on-write
fork): each rank holds half of the d_inner channels of every Mamba1 mixer (those rows of x and z in
in_proj, those conv channels and conv-window rows, those input columns of x_proj, whose dt | B | C are
all-reduced, those rows of dt_proj, A_log and D and of the per-channel SSM state, those input columns of
out_proj); Jamba's attention heads and KV heads split, its SwiGLU and every expert split on their width
(router replicated). Identical greedy tokens, logits within 1e-4 (fp32) of TP=1 at every step, the same
logits on every rank, the prompt's logits within 1e-4 of transformers', and a state slot costing each rank
half the bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.mamba1_model import MAMBA1_CONFIGS, mamba1_dir
from tests.tp.harness import models_traces, run_ranks
from tests.tp.test_tp_parity import N_NEW, TOL, _compare
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import slot_bytes

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(MAMBA1_CONFIGS)


def _reference(name: str) -> dict:
    return load_file(f"{mamba1_dir(name)}/reference.safetensors")


@pytest.fixture(scope="module")
def jobs() -> list[tuple[str, str, int, list[int] | None]]:
    return [(name, mamba1_dir(name), N_NEW, _reference(name)["prompt"].tolist()) for name in NAMES]


@pytest.fixture(scope="module")
def tp1(jobs: list) -> dict[str, Any]:
    return models_traces(0, 1, None, jobs)


@pytest.fixture(scope="module")
def tp2(jobs: list) -> list[dict[str, Any]]:
    return run_ranks(models_traces, 2, (jobs,), timeout=150)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_tp1_and_transformers(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    _compare(tp1[name], [r[name] for r in tp2])
    hf = _reference(name)["prompt_logits"].numpy()
    for r in (tp1, *tp2):
        assert float(np.abs(r[name]["prompt_logits"] - hf).max()) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_tp2_pools_are_per_rank(name: str, tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    """The ranks plan the same capacities; a state slot (conv windows and SSM states) costs each rank half."""
    kv, states, nbytes = tp1[name]["capacity"]
    for r in tp2:
        r_kv, r_states, r_bytes = r[name]["capacity"]
        assert (r_kv, r_states) == (kv, states) and r_bytes < nbytes
    cfg = load_config(mamba1_dir(name))
    whole = slot_bytes(cfg, torch.float32).state_slot
    assert whole > 0 and all(2 * slot_bytes(cfg, torch.float32, 2, rank).state_slot == whole for rank in (0, 1))
