"""LFM2 and LFM2-MoE at TP=2 against TP=1 and transformers on CPU with gloo (tests/tp/test_tp_parity.py's serving
script: staggered arrivals, chunked prefill, decode, a copy-on-write fork): each rank holds half of
the hidden channels of every short convolution (those rows of B, C and x in in_proj, those conv
channels and conv-window columns, those input columns of out_proj), attention heads split, KV heads
split or replicated (MQA), the SwiGLU and every expert split on their width (router and
expert bias replicated). Identical greedy tokens, logits within 1e-4
(fp32) of TP=1 at every step, the same logits on every rank, the prompt's logits within 1e-4 of
transformers', and a state slot costing each rank half the bytes."""

from __future__ import annotations

import pytest

from tests.fixtures.lfm2_model import LFM2_CONFIGS, lfm2_dir
from tests.tp.family_tp import (
    Traces,
    check_tp2_matches_tp1_and_transformers,
    check_tp2_pools_per_rank,
    family_traces,
)

pytestmark = pytest.mark.timeout(180)
NAMES = tuple(LFM2_CONFIGS)


@pytest.fixture(scope="module")
def traces() -> Traces:
    return family_traces(NAMES, lfm2_dir, timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_matches_tp1_and_transformers(name: str, traces: Traces) -> None:
    check_tp2_matches_tp1_and_transformers(traces, name, lfm2_dir(name))


@pytest.mark.parametrize("name", NAMES)
def test_tp2_pools_are_per_rank(name: str, traces: Traces) -> None:
    """The ranks plan the same capacities; a state slot (the conv windows) costs each rank exactly half."""
    check_tp2_pools_per_rank(traces, name, lfm2_dir(name))
