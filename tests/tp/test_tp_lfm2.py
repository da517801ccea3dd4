"""LFM2 and LFM2-MoE at TP=2 against TP=1 and transformers on CPU with gloo (tests/tp/test_tp_parity.py's serving
script: staggered arrivals, chunked prefill, decode, a copy-on-write fork): each rank holds half of
the hidden channels of every short convolution (those rows of B, C and x in in_proj, those conv
channels and conv-window columns, those input columns of out_proj), attention heads split, KV heads
split or replicated (MQA), the SwiGLU and every expert split on their width (router and
expert bias replicated). Identical greedy tokens, logits within 1e-4
(fp32) of TP=1 at every step, the same logits on every rank, the prompt's logits within 1e-4 of
transformers', and a state slot costing each rank half the bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.tp.harness import models_traces, run_ranks
from tests.tp.test_tp_parity import N_NEW, TOL, _compare
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import slot_bytes

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(LFM2_CONFIGS)


def _reference(name: str) -> dict:
    return load_file(f"{lfm2_dir(name)}/reference.safetensors")


@pytest.fixture(scope="module")
def jobs() -> list[tuple[str, str, int, list[int] | None]]:
    return [(name, lfm2_dir(name), N_NEW, _reference(name)["prompt"].tolist()) for name in NAMES]


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
    """The ranks plan the same capacities; a state slot (the conv windows) costs each rank exactly half."""
    kv, states, nbytes = tp1[name]["capacity"]
    for r in tp2:
        r_kv, r_states, r_bytes = r[name]["capacity"]
        assert (r_kv, r_states) == (kv, states) and r_bytes < nbytes  # KV costs as much where a KV head is replicated
    cfg = load_config(lfm2_dir(name))
    whole = slot_bytes(cfg, torch.float32).state_slot
    assert whole > 0 and all(2 * slot_bytes(cfg, torch.float32, 2, rank).state_slot == whole for rank in (0, 1))
