"""Every family other than GraniteMoeHybrid served end to end through a real launch.py (issue 14):
Nemotron-H dense and MoE, Falcon-H1 (both fixtures), Bamba and Mamba2 (no attention layer: no KV
pool, the scheduler's token bookkeeping only). Greedy outputs of sequential and concurrent
requests equal the runtime run alone, and prefix caching hits from the third request that shares
a system prompt. The checkpoints are the parity fixtures with the built-in tokenizer files."""

from __future__ import annotations

import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, running_server
from tests.worker.util import FAMILY_FIXTURES, fixture_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK = 16
SYSTEM = 48


def model_dir(tmp_path: Path, name: str, source: str | None = None,
              files: tuple[str, ...] = ("config.json", "model.safetensors")) -> str:
    """A servable copy in tmp_path/name (which must not exist yet) of `files` of the checkpoint in `source`
    (the parity fixture `name` when None), with the built-in tokenizer files."""
    out = tmp_path / name
    out.mkdir()
    for f in files:
        shutil.copy(os.path.join(source or fixture_dir(name), f), out / f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), out / f)
    return str(out)


def greedy(client: httpx.Client, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_family_serves_and_prefix_cache_hits(tmp_path, name: str) -> None:
    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    path = model_dir(tmp_path, name)
    ref = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=512, state_slots=4, deterministic=True))
    rng = random.Random(3)
    system = [rng.randrange(3, 256) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(9)] for _ in range(5)]
    others = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    args = ["--model-path", path, "--chunked-prefill-size", str(CHUNK), "--max-prefill-tokens", "64",
            "--dtype", "float32", *DETERMINISTIC]
    with running_server(args) as server, server.client() as client:
        results = [greedy(client, p, 6) for p in prompts]
        with ThreadPoolExecutor(len(others)) as pool:  # concurrent, batched together
            concurrent = list(pool.map(lambda p: greedy(server.client(), p, 5), others))
        info = client.get("/get_server_info").json()
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6), i
        if i >= 2:
            assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
    for prompt, res in zip(others, concurrent, strict=True):
        assert res["output_ids"] == generate_greedy(ref, prompt, 5)
    state = info["scheduler"]["server"]
    if name == "mamba2":  # no attention: token slots are bookkeeping only, sized by the rule
        from worker_proc.state.pools import attention_free_kv_slots

        assert state["kv_capacity"] == attention_free_kv_slots(0, state["state_capacity"], 512)
    assert state["prefix_state_hit_tokens"] >= 3 * (SYSTEM - CHUNK)
