"""Kimi Linear (checkpoints built by transformers, tests/fixtures/kimi_linear_model.py, with the built-in
tokenizer files) served end to end through a real launch.py with NGRAM speculation on, at TP=1 and at
TP=2 (gloo; MLA and KDA heads and MLP widths split over two workers, the MLA latent replicated): the
reference prompt's greedy tokens are transformers' own, prompts sharing a system prompt hit the prefix
cache from the third on (the KDA conv windows and delta-rule state checkpointed at the branch point,
MLA's cached latents in the radix tree) with the outputs of the single-process runtime without a cache,
and concurrent requests batched together give theirs too; the server's model info names the state kind
and its server info the TP size. With `--mamba-ssm-dtype bfloat16` the server's tokens are those of the
runtime under the same state dtype."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.e2e.family_server import check_serves_reference_with_prefix_hits_and_drafts, served_copy
from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_families import greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KINDS = {"kda": "conv window + delta-rule state (per-channel decay)"}


@pytest.mark.parametrize("name, tp", [("kimi_moe", 1), ("kimi_qlora", 1), ("kimi_moe", 2), ("kimi_qlora", 2)])
def test_kimi_linear_serves_transformers_tokens_with_prefix_hits_and_drafts(tmp_path: Path, name: str, tp: int) -> None:
    from tests.fixtures.kimi_linear_model import kimi_dir

    path = served_copy(tmp_path, name, kimi_dir(name))
    server_info = check_serves_reference_with_prefix_hits_and_drafts(path, tp, KINDS)
    assert server_info["tp_size"] == tp


def test_kimi_linear_bfloat16_state_serves_the_runtimes_tokens(tmp_path: Path) -> None:
    import torch

    from tests.fixtures.kimi_linear_model import kimi_dir
    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = served_copy(tmp_path, "kimi_moe", kimi_dir("kimi_moe"))
    ref = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=512, state_slots=4, deterministic=True,
                                         state_dtype="bfloat16"))
    assert ref.pools.states["kda_state"].dtype == torch.bfloat16
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    args = ["--model-path", path, "--dtype", "float32", "--mamba-ssm-dtype", "bfloat16", *DETERMINISTIC]
    with running_server(args) as server, server.client() as client:
        results = [greedy(client, p, 6) for p in prompts]
    for prompt, res in zip(prompts, results, strict=True):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6)

