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

import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_families import greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK = 16
SYSTEM = 40


def _model_dir(tmp_path, name: str) -> str:
    from tests.fixtures.kimi_linear_model import kimi_dir

    out = tmp_path / name
    out.mkdir()
    for f in ("config.json", "model.safetensors", "reference.safetensors"):
        shutil.copy(os.path.join(kimi_dir(name), f), out / f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), out / f)
    return str(out)


@pytest.mark.parametrize("name, tp", [("kimi_moe", 1), ("kimi_qlora", 1), ("kimi_moe", 2), ("kimi_qlora", 2)])
def test_kimi_linear_serves_transformers_tokens_with_prefix_hits_and_drafts(tmp_path, name: str, tp: int) -> None:
    from safetensors.torch import load_file

    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = _model_dir(tmp_path, name)
    hf = load_file(os.path.join(path, "reference.safetensors"))
    ref = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=512, state_slots=4, deterministic=True))
    rng = random.Random(11)
    system = [rng.randrange(3, 256) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(7)] for _ in range(4)]
    others = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 30))] for _ in range(5)]
    args = ["--model-path", path, "--chunked-prefill-size", str(CHUNK), "--max-prefill-tokens", "64",
            "--dtype", "float32", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3",
            "--tp-size", str(tp), *DETERMINISTIC]
    with running_server(args) as server, server.client() as client:
        first = greedy(client, hf["prompt"].tolist(), len(hf["gen_tokens"]))
        results = [greedy(client, p, 6) for p in prompts]
        with ThreadPoolExecutor(len(others)) as pool:
            concurrent = list(pool.map(lambda p: greedy(server.client(), p, 5), others))
        info = client.get("/get_model_info").json()
        tp_size = client.get("/get_server_info").json()["tp_size"]
    assert tp_size == tp
    assert first["output_ids"] == hf["gen_tokens"].tolist()
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6), i
        if i >= 2:
            assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
    for prompt, res in zip(others, concurrent, strict=True):
        assert res["output_ids"] == generate_greedy(ref, prompt, 5)
    assert info["state_kinds"] == {"kda": "conv window + delta-rule state (per-channel decay)"}


def test_kimi_linear_bfloat16_state_serves_the_runtimes_tokens(tmp_path) -> None:
    import torch

    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = _model_dir(tmp_path, "kimi_moe")
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

