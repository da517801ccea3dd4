"""LFM2 and LFM2-MoE (checkpoints built by transformers, tests/fixtures/lfm2_model.py, with the built-in
tokenizer files) served end to end through a real launch.py with NGRAM speculation on: the reference
prompt's greedy tokens are transformers' own, prompts sharing a system prompt hit the prefix cache from
the third on (the conv windows checkpointed at the branch point) with the runtime's outputs alone, and
concurrent requests batched together give theirs too; the server's model info names the state kind. Both are
served at TP=1 and TP=2 (conv channels, attention heads, SwiGLU and expert widths split over the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.family_server import check_serves_reference_with_prefix_hits_and_drafts, served_copy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.mark.parametrize("name, tp", [("lfm2_bias", 1), ("lfm2_bias", 2), ("lfm2_moe", 1), ("lfm2_moe", 2)])
def test_lfm2_serves_transformers_tokens_with_prefix_hits_and_drafts(tmp_path: Path, name: str, tp: int) -> None:
    from tests.fixtures.lfm2_model import lfm2_dir

    path = served_copy(tmp_path, name, lfm2_dir(name))
    check_serves_reference_with_prefix_hits_and_drafts(path, tp, {"short_conv": "conv window"})
