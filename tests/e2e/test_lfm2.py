"""LFM2 and LFM2-MoE (checkpoints built by transformers, tests/fixtures/lfm2_model.py, with the built-in
tokenizer files) served end to end through a real launch.py with NGRAM speculation on: the reference
prompt's greedy tokens are transformers' own, prompts sharing a system prompt hit the prefix cache from
the third on (the conv windows checkpointed at the branch point) with the runtime's outputs alone, and
concurrent requests batched together give theirs too; the server's model info names the state kind. Both are
served at TP=1 and TP=2 (conv channels, attention heads, SwiGLU and expert widths split over the ranks)."""

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
    from tests.fixtures.lfm2_model import lfm2_dir

    out = tmp_path / name
    out.mkdir()
    for f in ("config.json", "model.safetensors", "reference.safetensors"):
        shutil.copy(os.path.join(lfm2_dir(name), f), out / f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), out / f)
    return str(out)


@pytest.mark.parametrize("name, tp", [("lfm2_bias", 1), ("lfm2_bias", 2), ("lfm2_moe", 1), ("lfm2_moe", 2)])
def test_lfm2_serves_transformers_tokens_with_prefix_hits_and_drafts(tmp_path, name: str, tp: int) -> None:
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
    assert first["output_ids"] == hf["gen_tokens"].tolist()
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6), i
        if i >= 2:
            assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
    for prompt, res in zip(others, concurrent, strict=True):
        assert res["output_ids"] == generate_greedy(ref, prompt, 5)
    assert info["state_kinds"] == {"short_conv": "conv window"}
