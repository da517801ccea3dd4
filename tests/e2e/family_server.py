"""A family checkpoint (tests/fixtures/family_checkpoint.py) served end to end through a real launch.py
with NGRAM speculation on, at a TP size: the reference prompt's greedy tokens are transformers' own,
prompts sharing a SYSTEM-token system prompt hit the prefix cache from the third on (the recurrent state
checkpointed at the branch point) with the outputs of the single-process runtime without a cache, and
concurrent requests batched together give theirs too; the server's model info names the state kinds."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_families import greedy, model_dir

CHUNK = 16
SYSTEM = 40
CHECKPOINT_FILES = ("config.json", "model.safetensors", "reference.safetensors")


def served_copy(tmp_path: Path, name: str, source: str) -> str:
    """A servable copy in tmp_path/name of the family checkpoint in `source` (its weights, config and
    `reference.safetensors`) with the built-in tokenizer files."""
    return model_dir(tmp_path, name, source, CHECKPOINT_FILES)


def check_serves_reference_with_prefix_hits_and_drafts(path: str, tp: int,
                                                       state_kinds: dict[str, str]) -> dict[str, Any]:
    """Serve the checkpoint copy in `path` (a `served_copy`) at TP size `tp` in float32, deterministic, with
    CHUNK-token prefill chunks and NGRAM drafts of 3 tokens: the reference prompt gives transformers' greedy
    tokens; four prompts sharing a SYSTEM-token prefix give the runtime's greedy tokens, the third and
    fourth with at least SYSTEM - CHUNK cached tokens; five concurrent prompts give the runtime's tokens;
    `/get_model_info` names `state_kinds`. Returns the server's `/get_server_info`."""
    from safetensors.torch import load_file

    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

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
        server_info = client.get("/get_server_info").json()
    assert first["output_ids"] == hf["gen_tokens"].tolist()
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6), i
        if i >= 2:
            assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
    for prompt, res in zip(others, concurrent, strict=True):
        assert res["output_ids"] == generate_greedy(ref, prompt, 5)
    assert info["state_kinds"] == state_kinds
    return server_info
