"""Mamba, FalconMamba and Jamba (checkpoints built by transformers, tests/fixtures/mamba1_model.py, with the built-in
tokenizer files) served end to end through a real launch.py with NGRAM speculation on: the reference prompt's
greedy tokens are transformers' own, prompts sharing a system prompt hit the prefix cache from the third on
(the conv windows and per-channel SSM states checkpointed at the branch point) with the runtime's outputs
alone, and concurrent requests batched together give theirs too; the server's model info names the state
kinds. Mamba and Jamba are served at TP=1 and TP=2, FalconMamba at TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.family_server import check_serves_reference_with_prefix_hits_and_drafts, served_copy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KINDS = {"mamba1": "conv window + per-channel SSM state"}
CASES = [("mamba_bias", 1), ("mamba_bias", 2), ("falcon_mamba", 2), ("jamba", 1), ("jamba", 2)]


@pytest.mark.parametrize("name, tp", CASES)
def test_mamba1_serves_transformers_tokens_with_prefix_hits_and_drafts(tmp_path: Path, name: str, tp: int) -> None:
    from tests.fixtures.mamba1_model import mamba1_dir

    path = served_copy(tmp_path, name, mamba1_dir(name))
    check_serves_reference_with_prefix_hits_and_drafts(path, tp, KINDS)
