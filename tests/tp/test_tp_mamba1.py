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

import pytest

from tests.fixtures.mamba1_model import MAMBA1_CONFIGS, mamba1_dir
from tests.tp.family_tp import (
    Traces,
    check_tp2_matches_tp1_and_transformers,
    check_tp2_pools_per_rank,
    family_traces,
)

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(MAMBA1_CONFIGS)


@pytest.fixture(scope="module")
def traces() -> Traces:
    return family_traces(NAMES, mamba1_dir, timeout=150)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_tp1_and_transformers(name: str, traces: Traces) -> None:
    check_tp2_matches_tp1_and_transformers(traces, name, mamba1_dir(name))


@pytest.mark.parametrize("name", NAMES)
def test_tp2_pools_are_per_rank(name: str, traces: Traces) -> None:
    """The ranks plan the same capacities; a state slot (conv windows and SSM states) costs each rank half."""
    check_tp2_pools_per_rank(traces, name, mamba1_dir(name))
