"""A real launch.py serving checkpoints quantized by their own library: compressed-tensors W4A16 and
W8A8 (the files llm-compressor writes) and a block-fp8 checkpoint; every request's greedy tokens are
the in-process runner's on the same checkpoint (deterministic mode), prefix-cache hits included."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_families import greedy
from tests.fixtures.make_prequant import write_compressed, write_fp8_block

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHUNK = 16
SYSTEM = 48


def _with_tokenizer(path: str) -> str:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), os.path.join(path, f))
    return path


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8", "fp8_block"])
def test_a_prequantized_checkpoint_serves_as_the_runner_computes(tmp_path, scheme: str) -> None:
    pytest.importorskip("compressed_tensors")
    from tests.model_driver import generate_greedy
    from worker_proc.plan.execution_plan import product_sites
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    out = str(tmp_path / scheme)
    if scheme == "fp8_block":
        write_fp8_block("rope_moe", out, (32, 32))
    else:
        write_compressed("rope_moe", out, scheme, group=32)
    path = _with_tokenizer(out)
    ref = ModelRunner(path, WorkerConfig(dtype="float32", kv_slots=512, state_slots=4, deterministic=True))
    assert any(site.quantized is not None for _, site, _ in product_sites(ref.model))
    rng = random.Random(5)
    system = [rng.randrange(3, 256) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(9)] for _ in range(4)]
    args = ["--model-path", path, "--chunked-prefill-size", str(CHUNK), "--max-prefill-tokens", "64",
            "--dtype", "float32", *DETERMINISTIC]
    with running_server(args) as server, server.client() as client:
        results = [greedy(client, p, 6) for p in prompts]
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res["output_ids"] == generate_greedy(ref, prompt, 6), i
        if i >= 2:
            assert res["meta_info"]["cached_tokens"] >= SYSTEM - CHUNK, (i, res["meta_info"])
    method = "fp8" if scheme == "fp8_block" else "compressed-tensors"
    assert f"pre-quantized checkpoint, {method}" in server.output  # the worker says what it found
