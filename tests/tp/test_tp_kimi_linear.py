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

import pytest
import torch

from tests.fixtures.kimi_linear_model import KIMI_CONFIGS, kimi_dir
from tests.tp.family_tp import (
    Traces,
    check_tp2_matches_tp1_and_transformers,
    check_tp2_pools_per_rank,
    family_traces,
)
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import slot_bytes

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(KIMI_CONFIGS)


@pytest.fixture(scope="module")
def traces() -> Traces:
    return family_traces(NAMES, kimi_dir, timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_tp1_and_transformers(name: str, traces: Traces) -> None:
    check_tp2_matches_tp1_and_transformers(traces, name, kimi_dir(name))


@pytest.mark.parametrize("name", NAMES)
def test_tp2_pools_are_per_rank(name: str, traces: Traces) -> None:
    """The ranks plan the same capacities; a state slot (conv windows and delta-rule state) costs each rank
    exactly half, a KV token slot (the latent, replicated) as much as on one rank."""
    check_tp2_pools_per_rank(traces, name, kimi_dir(name))
    cfg = load_config(kimi_dir(name))
    whole = slot_bytes(cfg, torch.float32).kv_token
    assert whole > 0 and all(slot_bytes(cfg, torch.float32, 2, rank).kv_token == whole for rank in (0, 1))
